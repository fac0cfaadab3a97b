"""Local runtime set-up shared by the CLI and the tests: one single-node Ray on 127.0.0.1."""

from __future__ import annotations

import os
import signal
import sys
import tempfile
import threading
import time
from typing import Any, Iterable, NamedTuple

RAY_ENV = {
    # Token auth would write ~/.ray/auth_token; a local dev cluster on loopback does not need it.
    "RAY_AUTH_MODE": "disabled",
    "RAY_USAGE_STATS_ENABLED": "0",
    # Keeps a single-node cluster on 127.0.0.1 (otherwise the node IP is rewritten to eth0).
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "TOKENIZERS_PARALLELISM": "false",
    # Serve's HTTP proxy routes on this header (the request's session id -> ConsistentHashRouter):
    # every call of a rollout reaches its owning replica in one hop (rollout_service.serve.app).
    "RAY_SERVE_SESSION_ID_HEADER_KEY": "x-rollout-id",
    # Serve's controller runs its control loop every 0.1 s by default, ~27 ms of CPU per second on an
    # idle service here (docs/benchmarks.md); every 0.5 s it costs ~11. It reacts to replica and
    # deployment changes within 0.5 s instead of 0.1 (health checks run every 10 s anyway).
    "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5",
}
# A Ray this process starts itself (the raylet reads these): no idle worker processes kept around.
# The raylet prestarts and keeps up to num_cpus idle Python workers for tasks; this service runs
# actors, which get their own workers, and a few rare tasks. Each idle worker costs ~4 ms of CPU per
# second and ~100 MB; a task now waits ~1 s for a worker to start.
LOCAL_RAY_ENV = {
    "RAY_enable_worker_prestart": "0",
    "RAY_prestart_worker_first_driver": "0",
    "RAY_num_workers_soft_limit": "0",
}


# The HTTP ingress in front of the RolloutService replicas, chosen before Ray starts (Serve reads these
# when its controller and proxies start). "haproxy": Serve's HAProxy mode — HAProxy hashes X-Rollout-Id
# to a replica that serves HTTP itself (direct ingress): no Python proxy and no Ray call on the way in
# (measured: docs/benchmarks.md). "serve": Serve's Python HTTP proxy, which routes on the session id it
# copies from X-Rollout-Id through the app's consistent-hash router.
PROXY_MODES = ("haproxy", "serve")
PROXY_ENV = {
    "haproxy": {"RAY_SERVE_ENABLE_HA_PROXY": "1", "RAY_SERVE_HAPROXY_BALANCE_ALGORITHM": "hdr(x-rollout-id)"},
    "serve": {},
}
# HAProxy's stats page and its Prometheus frontend listen on fixed ports by default (8404, 9101):
# a local service takes free ones so that two of them (or anything else) on one machine do not clash.
HAPROXY_PORT_ENV = ("RAY_SERVE_HAPROXY_STATS_PORT", "RAY_SERVE_HAPROXY_METRICS_PORT")
# A replica leaving (stop, downscale, replacement) stays open this long so that load balancers in
# front deregister it first: 30 s by default, sized for cloud load balancers. HAProxy on the same
# machine reloads within ~0.5 s, so a local service stops (Ctrl-C) in seconds instead of 35.
LOCAL_HAPROXY_DEFAULTS = {"RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "5"}


def proxy_mode() -> str:
    """The ingress this process's environment selects (what a Ray started from here will use)."""
    return "haproxy" if os.environ.get("RAY_SERVE_ENABLE_HA_PROXY") == "1" else "serve"


def apply_proxy_env(mode: str) -> None:
    """Select the ingress for a Ray this process is about to start (see PROXY_ENV)."""
    if mode not in PROXY_MODES:
        raise ValueError(f"proxy must be one of {PROXY_MODES}, not {mode!r}")
    for env in PROXY_ENV.values():
        for k in env:
            os.environ.pop(k, None)
    os.environ.update(PROXY_ENV[mode])
    if mode == "haproxy":
        for k in HAPROXY_PORT_ENV:
            if not os.environ.get(k):
                os.environ[k] = str(listen_port())
        for k, v in LOCAL_HAPROXY_DEFAULTS.items():
            os.environ.setdefault(k, v)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def listen_port() -> int:
    """A free port for a server that binds it later (HAProxy's stats and metrics listeners), taken
    below the kernel's ephemeral range and above Ray's worker ports (10002-19999): a port the
    kernel hands out as ephemeral can be taken by any outgoing connection before the server binds
    it (measured once in CI: HAProxy's stats listener failed with "Address already in use")."""
    import random
    import socket

    try:
        low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    candidates = list(range(20000, max(20001, low)))
    random.shuffle(candidates)
    for port in candidates[:200]:
        with socket.socket() as s:
            try:
                s.bind(("0.0.0.0", port))
                return port
            except OSError:
                continue
    return free_port()


# vLLM on this project's CPU machines: the worker inside the engine-core process (faster start, half
# the memory). Engine actors get the same through their runtime_env; their KV cache size is the
# config's engine.cpu_kvcache_space_gib.
LOCAL_ENGINE_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def apply_ray_env() -> None:
    """Set the defaults above; must run before ``import ray`` (Ray reads some of them at import)."""
    for k, v in RAY_ENV.items():
        os.environ.setdefault(k, v)


def apply_local_env() -> None:
    """Ray defaults plus the local CPU engine env: scripts and tests call this before importing ray."""
    apply_ray_env()
    for k, v in LOCAL_ENGINE_ENV.items():
        os.environ.setdefault(k, v)


def start_local_ray(num_cpus: int = 16, address: str | None = None,
                    metrics_port: int | None = None, log_to_driver: bool = True) -> dict[str, Any]:
    """Connect to ``address`` (or RAY_ADDRESS) if given, else start a local single-node Ray.

    ``num_cpus`` is logical: the engines, affinity replicas and Serve proxy each reserve some, and a
    2-core machine must still place them all. ``log_to_driver``: stream the output of Ray's workers
    (engines, replicas, HAProxy) to this process, as Ray does by default; off, it stays in the
    session's log files (:func:`local_ray_logs_dir`). ``metrics_port``: the port Ray's metrics agent serves
    Prometheus text on (``/metrics``: Ray's, Serve's, vLLM's and the service's metrics; see
    :func:`metrics_url`); None lets Ray pick one. A cluster this process only connects to keeps its own.
    """
    apply_ray_env()
    import ray

    if ray.is_initialized():
        return {"address": ray.get_runtime_context().gcs_address}
    on_main_thread = threading.current_thread() is threading.main_thread()
    sigterm_handler = signal.getsignal(signal.SIGTERM) if on_main_thread else None
    try:
        return _init_ray(num_cpus, address, metrics_port, log_to_driver)
    finally:
        if sigterm_handler is not None:  # None: not set from Python, nothing to give back
            _restore_sigterm(sigterm_handler)


def _restore_sigterm(previous) -> None:
    """Take SIGTERM back from the failure handler Ray's core worker installs in the driver.

    ``ray.init`` replaces the Python SIGTERM handler with ``sys.exit``, and the driver's core worker
    then installs Abseil's failure-signal handler on SIGTERM at the C level: it calls the Python
    handler, but also arms ``alarm(3)``, so three seconds after a SIGTERM the process aborts with
    SIGABRT, in the middle of whatever orderly stop the signal started (no ``finally``, no atexit,
    no ``ray.shutdown``: the raylet dies with us and its agents are orphaned). A stop request is
    not a crash: SIGTERM goes back to a plain Python handler, the one this process had, or Ray's
    ``sys.exit`` if it had none; SIGSEGV and the other crash signals keep Ray's handler.
    """
    rays = signal.getsignal(signal.SIGTERM)
    keep_rays = previous == signal.SIG_DFL and callable(rays)
    signal.signal(signal.SIGTERM, rays if keep_rays else previous)


def _init_ray(num_cpus: int, address: str | None, metrics_port: int | None = None,
              log_to_driver: bool = True) -> dict[str, Any]:
    import ray

    address = address or os.environ.get("RAY_ADDRESS")
    if metrics_port and not address:
        check_port_free(metrics_port, "metrics")
    if address:
        ctx = ray.init(address=address, namespace="rollout-service", ignore_reinit_error=True,
                       log_to_driver=log_to_driver)
    else:
        for k, v in LOCAL_RAY_ENV.items():
            os.environ.setdefault(k, v)
        # Socket paths must stay under 108 bytes: keep the temp dir short. On a loaded 2-core
        # machine the raylet can time out waiting for its agents: retry once before giving up.
        for attempt in range(2):
            temp_dir = tempfile.mkdtemp(prefix="ray", dir="/tmp")
            try:
                ctx = ray.init(
                    num_cpus=num_cpus,
                    include_dashboard=False,
                    _temp_dir=temp_dir,
                    _node_ip_address="127.0.0.1",
                    namespace="rollout-service",
                    runtime_env={"env_vars": {k: os.environ[k] for k in (*RAY_ENV, *PROXY_ENV["haproxy"], *HAPROXY_PORT_ENV,
                                                                         *LOCAL_HAPROXY_DEFAULTS) if k in os.environ}},
                    logging_level="WARNING",
                    log_to_driver=log_to_driver,
                    _metrics_export_port=metrics_port or None,
                )
                break
            except Exception:
                if attempt == 1:
                    raise
                ray.shutdown()
    return {"address": ctx.address_info.get("gcs_address")}


def check_port_free(port: int, what: str, host: str = "127.0.0.1", flag: str | None = None) -> None:
    """A taken port is refused here, naming it, not minutes later by a process Ray starts (its
    metrics agent, Serve's proxy or HAProxy). Bound as those listeners bind (``SO_REUSEADDR``): a
    port held only by the closed connections of a service stopped a moment ago (TIME_WAIT) is free
    for them, so it is free here; a process listening on it is not."""
    import socket

    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            raise RuntimeError(f"{what} port {port} is in use ({exc.strerror}): choose another "
                               f"(rollout-service up {flag or f'--{what}-port'} PORT)") from None


def metrics_url() -> str | None:
    """``http://<node>:<port>/metrics`` of the Ray node this process runs on (Ray initialized), from
    the port its metrics agent reported; None if it has none."""
    import ray

    here = ray.get_runtime_context().get_node_id()
    for node in ray.nodes():
        if node.get("NodeID") == here and node.get("Alive"):
            port = node.get("MetricsExportPort")
            if port and int(port) > 0:
                return f"http://{node.get('NodeManagerAddress')}:{port}/metrics"
    return None


class ProcessId(NamedTuple):
    """A process named by pid and start time (clock ticks since boot): a reused pid does not match."""

    pid: int
    start_time: int


def _stat_fields(pid: int) -> list[str] | None:
    """Fields 3.. of /proc/<pid>/stat (after the parenthesised command, which may hold spaces)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read().decode(errors="replace")
    except OSError:
        return None
    return raw[raw.rfind(")") + 2:].split()


def process_id(pid: int) -> ProcessId | None:
    fields = _stat_fields(pid)
    return ProcessId(pid, int(fields[19])) if fields else None


def is_running(proc: ProcessId) -> bool:
    """Still the same process, and not a zombie (an exited child nobody has reaped yet)."""
    fields = _stat_fields(proc.pid)
    return bool(fields) and fields[0] not in ("Z", "X") and int(fields[19]) == proc.start_time


def _own_pids() -> list[int]:
    """The pids of this user's processes, but this one."""
    uid, me = os.getuid(), os.getpid()
    pids = []
    for name in os.listdir("/proc"):
        if name.isdigit() and int(name) != me:
            try:
                if os.stat(f"/proc/{name}").st_uid == uid:
                    pids.append(int(name))
            except OSError:
                pass
    return pids


def process_tree(roots: Iterable[int]) -> set[ProcessId]:
    """``roots`` and all their descendants, as they are now."""
    children: dict[int, list[int]] = {}
    for pid in _own_pids():
        fields = _stat_fields(pid)
        if fields:
            children.setdefault(int(fields[1]), []).append(pid)
    found: set[ProcessId] = set()
    todo = list(roots)
    while todo:
        pid = todo.pop()
        proc = process_id(pid)
        if proc is not None and proc not in found:
            found.add(proc)
            todo.extend(children.get(pid, ()))
    return found


def _files_written_under(pid: int, directory: str) -> list[str]:
    """The paths under ``directory`` that ``pid`` holds open for writing."""
    fd_dir = f"/proc/{pid}/fd"
    try:
        fds = os.listdir(fd_dir)
    except OSError:
        return []
    written = []
    for fd in fds:
        try:
            path = os.readlink(f"{fd_dir}/{fd}")
            if not path.startswith(directory):
                continue
            with open(f"/proc/{pid}/fdinfo/{fd}") as f:
                flags = next(int(line.split()[1], 8) for line in f if line.startswith("flags:"))
        except (OSError, StopIteration, ValueError):
            continue
        if flags & (os.O_WRONLY | os.O_RDWR):
            written.append(path)
    return written


def session_processes(session_dir: str) -> set[ProcessId]:
    """This user's processes writing into a Ray session dir, other drivers connected to it excepted.

    Every process of a Ray session writes its logs there, and a process a worker starts inherits
    the worker's log as its stdout; the command line is no guide, as Ray renames most of its
    processes (``ray::IDLE``, ``ray::DashboardAgent``...). A driver connected to the cluster writes
    its ``python-core-driver-*`` log there too, but it is not the session's: left out. So is a
    process that only reads there (someone's ``tail -f`` on a log).
    """
    directory = session_dir.rstrip("/") + "/"
    found = set()
    for pid in _own_pids():
        written = _files_written_under(pid, directory)
        if written and not any("/python-core-driver-" in path for path in written):
            proc = process_id(pid)
            if proc is not None:
                found.add(proc)
    return found


def _signal(proc: ProcessId, sig: int) -> None:
    if is_running(proc):
        try:
            os.kill(proc.pid, sig)
        except ProcessLookupError:
            pass


def stop_processes(procs: Iterable[ProcessId], grace: float = 5.0) -> list[int]:
    """SIGTERM the processes of ``procs`` still running, SIGKILL those alive after ``grace`` seconds.

    Returns the pids that were still running. Processes are only ever signalled by pid after
    checking their start time, so a pid the kernel has given to someone else is left alone.
    """
    alive = [p for p in procs if is_running(p)]
    for proc in alive:
        _signal(proc, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while any(is_running(p) for p in alive) and time.monotonic() < deadline:
        time.sleep(0.05)
    for proc in alive:
        _signal(proc, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while any(is_running(p) for p in alive) and time.monotonic() < deadline:
        time.sleep(0.05)
    return sorted(p.pid for p in alive)


def local_ray_logs_dir() -> str | None:
    """The log directory of the Ray session this process started (Ray's, the engines', the Serve
    replicas' and HAProxy's output); None when it only connected to a cluster."""
    session_dir, _ = _local_ray_session()
    return f"{session_dir}/logs" if session_dir else None


def _local_ray_session() -> tuple[str | None, list[int]]:
    """The session dir and process ids of the Ray this process started (nothing when it only connected)."""
    import ray._private.worker

    node = ray._private.worker._global_node
    if node is None or not node.all_processes:
        return None, []
    pids = [info.process.pid for infos in node.all_processes.values() for info in infos]
    return node.get_session_dir_path(), pids


def shutdown_local_ray(grace: float = 5.0) -> list[int]:
    """``ray.shutdown()``, then stop by pid whatever process of the Ray this process started is left.

    ``ray.shutdown()`` alone is not always enough. It gives the raylet one second after SIGTERM,
    then SIGKILLs it; the raylet's agents (``ray::DashboardAgent``, ``ray::RuntimeEnvAgent``) then
    try to report its death to a GCS that is being killed too, and sit in that RPC deaf to SIGTERM
    (seen when the driver died mid-stop). And the raylet stops a worker by signalling the worker's
    process group, so a process a worker started in a session of its own outlives it. So the tree
    under the processes Ray started is recorded before the shutdown reparents it, and whatever of
    it still runs afterwards is stopped, as is any process of the session found by the logs it
    writes (``session_processes``: one already orphaned, or started during the shutdown). Other
    drivers connected to this cluster were not started here and are left alone, as is a cluster
    this process only connected to. Returns the pids that had to be stopped.
    """
    if "ray" not in sys.modules:
        return []
    import ray

    session_dir, ray_pids = _local_ray_session() if ray.is_initialized() else (None, [])
    ours = process_tree(ray_pids)
    if session_dir:
        ours |= session_processes(session_dir)
    ray.shutdown(wait_for_processes=True)
    if session_dir:
        ours |= session_processes(session_dir)
    return stop_processes(ours, grace)


def local_ray_gone(wait: float = 1.0) -> bool:
    """True when this process started a Ray whose GCS stopped serving (or does so within ``wait``
    seconds): a signal sent to the whole process group (``kill -TERM -<pgid>``, a service manager
    stopping the unit's processes) reached it and the raylet too, which share this process's group.
    Ray blocks SIGINT in its processes, so a Ctrl-C in a terminal never does this; SIGTERM does: the
    GCS closes its port at once, then lingers. A driver whose GCS is gone must not call into Ray:
    each call waits out the GCS reconnect timeout (60 s), then Ray aborts the process."""
    import socket

    import ray._private.worker

    node = ray._private.worker._global_node
    if node is None or not node.all_processes:
        return False
    gcs = [info.process for info in node.all_processes.get("gcs_server", ())]
    host, _, port = (node.gcs_address or "").rpartition(":")
    deadline = time.monotonic() + wait
    while True:
        if any(p.poll() is not None for p in gcs):
            return True
        try:
            socket.create_connection((host, int(port)), timeout=0.5).close()
        except (ConnectionRefusedError, ValueError):
            return True
        except OSError:  # a timeout: busy, not gone
            pass
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)


def abandon_local_ray(grace: float = 5.0) -> list[int]:
    """Stop by pid every process of the Ray this process started, without calling into Ray (its GCS
    is gone: :func:`local_ray_gone`). Returns the pids that had to be stopped."""
    session_dir, ray_pids = _local_ray_session()
    ours = process_tree(ray_pids)
    if session_dir:
        ours |= session_processes(session_dir)
    return stop_processes(ours, grace)
