"""``rollout-service up``: local Ray + engines + embedded Redis + the Serve app, on one machine."""

from __future__ import annotations

import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from rollout_service.config import RolloutServiceConfig
from rollout_service.ops.runtime import apply_ray_env

apply_ray_env()  # before anything imports ray: keeps a local cluster on 127.0.0.1

APP_NAME = "rollout-service"
_INGRESS = {"haproxy": "HAProxy (Serve's HAProxy mode, hashing X-Rollout-Id to a replica that serves HTTP itself)",
            "serve": "Serve's HTTP proxy (consistent hash on X-Rollout-Id)"}


class LocalService:
    """Start / stop the whole service in-process (the CLI, tests and benchmarks use it)."""

    def __init__(self, config: RolloutServiceConfig, *, host: str = "127.0.0.1", port: int = 8000,
                 data_dir: str | None = None, log=print, metrics_port: int | None = None,
                 proxy: str | None = None, verbose: bool = True):
        self.config = config.model_copy(deep=True)
        # The HTTP ingress (runtime.PROXY_ENV) for a Ray this starts; None: whatever the environment says.
        self.proxy = proxy
        self.host, self.port = host, port
        self.metrics_port = metrics_port  # Ray's metrics export port when this starts Ray (None: Ray picks)
        self.metrics_url: str | None = None
        self.data_dir = data_dir or tempfile.mkdtemp(prefix="rollout-service-")
        # verbose: Ray's workers (engines, replicas, HAProxy) print here, as Ray does by default; off:
        # their output stays in the session's log files, linked as <data_dir>/logs (self.logs_dir).
        self.verbose = verbose
        self.logs_dir: str | None = None
        self.redis = None
        self.fleet = None
        self.controller = None
        self.log = log

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> "LocalService":
        import ray

        from rollout_service.ops.runtime import apply_proxy_env, proxy_mode

        # Before ray.serve is imported: Serve reads the HAProxy switch once per process, at import.
        if self.proxy is not None:
            if not ray.is_initialized():
                apply_proxy_env(self.proxy)
            elif proxy_mode() != self.proxy:
                self.log(f"[up] Ray is already running: its HTTP ingress stays as it was started, not {self.proxy}")
        from ray import serve

        from rollout_service.fleet.fleet import get_or_create_fleet
        from rollout_service.refit.controller import get_or_create_controller
        from rollout_service.ops.runtime import start_local_ray
        from rollout_service.serve.app import build_app

        if not self.verbose:
            quiet_driver_loggers()
        t0 = time.perf_counter()
        if not ray.is_initialized() and not os.environ.get("RAY_ADDRESS"):  # the ingress this starts binds it
            from rollout_service.ops.runtime import check_port_free

            check_port_free(self.port, "HTTP", host=self.host, flag="--port")
        if not self.config.store.redis_url and not os.environ.get("ROLLOUT_SERVICE_REDIS_URL"):
            from rollout_service.store.embedded import EmbeddedRedis

            self.redis = EmbeddedRedis(Path(self.data_dir) / "redis")
            self.config.store.redis_url = self.redis.start()
            self.log(f"[up] embedded redis-server at {self.config.store.redis_url} (pid {self.redis.pid})")
            self.redis.supervise(log=self.log)  # restarted on the same port and AOF if it dies
        model = self.config.engine.resolved_model()
        self.log(f"[up] model: {model}")
        # On a cluster this process only joins, its workers' output has no local log directory: stream it.
        start_local_ray(metrics_port=self.metrics_port,
                        log_to_driver=self.verbose or ray.is_initialized() or bool(os.environ.get("RAY_ADDRESS")))
        self._link_logs()
        self.log(f"[up] HTTP ingress: {_INGRESS[proxy_mode()]}")
        self.log(f"[up] Ray started ({time.perf_counter() - t0:.1f}s); loading {self.config.engine.num_engines} engine(s)...")
        self.fleet = get_or_create_fleet(self.config)
        changed = ray.get(self.fleet.ensure_config.remote(self.config.model_dump()))
        if changed:
            self.log(f"[up] engine config differs from the running fleet's ({', '.join(changed)}): restarted it")
        self.controller = get_or_create_controller(self.config)
        ref = self.controller.start.remote()
        while True:
            ready, _ = ray.wait([ref], timeout=5)
            if ready:
                ray.get(ref)
                break
            self.log(f"[up]   engines loading... {time.perf_counter() - t0:.0f}s")
        self.log(f"[up] engines ready ({time.perf_counter() - t0:.1f}s); deploying the Serve app")
        # The proxy logs every request unless told not to (~0.5 ms CPU per call, docs/benchmarks.md).
        serve.start(http_options={"host": self.host, "port": self.port},
                    logging_config={"enable_access_log": self.config.service.access_log})
        serve.run(build_app(self.config), name=APP_NAME, route_prefix="/")
        self._wait_healthy()
        from rollout_service.ops.runtime import metrics_url

        self.metrics_url = metrics_url()
        self.log(f"[up] ready in {time.perf_counter() - t0:.1f}s: {self.url}/v1 (OpenAI base_url)")
        return self

    def _link_logs(self) -> None:
        """``<data_dir>/logs``: the Ray session's log directory (Ray's, the engines', the replicas',
        HAProxy's output), kept after the service stops."""
        from rollout_service.ops.runtime import local_ray_logs_dir

        logs = local_ray_logs_dir()
        if logs is None:  # a cluster this process only connected to keeps its logs on its nodes
            return
        link = Path(self.data_dir) / "logs"
        try:
            if link.is_symlink():
                link.unlink()
            link.symlink_to(logs, target_is_directory=True)
            self.logs_dir = str(link)
        except OSError:
            self.logs_dir = logs
        if not self.verbose:
            self.log(f"[up] logs of Ray, the engines, the app and HAProxy: {self.logs_dir} (--verbose prints them here)")

    def _wait_healthy(self, timeout: float = 300) -> None:
        import httpx

        headers = {}
        deadline = time.time() + timeout
        last = None
        while time.time() < deadline:
            try:
                r = httpx.get(f"{self.url}/health", timeout=30, headers=headers)
                if r.status_code == 200:
                    return
                last = r.text
            except Exception as exc:  # not listening yet
                last = repr(exc)
            time.sleep(0.5)
        raise RuntimeError(f"service not healthy after {timeout}s: {last}")

    def stop(self) -> None:
        """Delete the app, stop the engines, then the embedded redis-server (its AOF flushed).

        Ray itself stays up (the tests share one); ``run_up`` shuts it down. The redis-server is
        stopped even when a step before fails or is interrupted (a second Ctrl-C).
        """
        import ray
        from ray import serve

        try:
            if ray.is_initialized():  # never start a Ray just to delete an app that was not deployed
                try:
                    serve.delete(APP_NAME)
                except Exception:
                    pass
            # The controller first (no refit may start), then the fleet, which owns and stops the engines.
            for attr in ("controller", "fleet"):
                actor = getattr(self, attr)
                if actor is not None and ray.is_initialized():
                    try:
                        ray.get(actor.shutdown.remote(), timeout=60)
                    except Exception:
                        pass
                    ray.kill(actor)
                    setattr(self, attr, None)
                    if attr == "fleet":  # its engines are detached: any the fleet could not stop go now
                        from rollout_service.fleet.adoption import kill_named_engines
                        from rollout_service.fleet.fleet import fleet_name

                        kill_named_engines(fleet_name(self.config.service.instance_name))
        finally:
            if self.redis is not None:
                self.redis.stop()
                self.redis = None


# Loggers of this process that print INFO lines of Ray, Serve, vLLM and the libraries they load.
_DRIVER_LOGGERS = ("ray", "ray.serve", "ray.data", "vllm", "transformers", "filelock", "httpx")


def quiet_driver_loggers() -> None:
    """Only warnings and errors from the libraries in this process (``up`` prints its own progress)."""
    import logging

    for name in _DRIVER_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)


def ready_banner(svc: "LocalService") -> str:
    """The lines ``up`` prints once the service answers: every URL a user needs, and where the logs are."""
    rows = [("API (OpenAI base_url)", f"{svc.url}/v1"),
            ("token in, token out", f"{svc.url}/inference/v1/generate"),
            ("OpenAPI docs", f"{svc.url}/docs"),
            ("status", f"{svc.url}/v1/status   (rollout-service status --url {svc.url})"),
            ("rollouts", f"{svc.url}/rollouts"),
            ("metrics (Prometheus)", svc.metrics_url or "none: this Ray node exports no metrics")]
    if svc.logs_dir:
        rows.append(("logs", svc.logs_dir))
    width = max(len(k) for k, _ in rows)
    lines = [f"rollout-service is up: {svc.url}  (Ctrl-C stops everything)"]
    lines += [f"  {k.ljust(width)}  {v}" for k, v in rows]
    lines.append(f"  try: rollout-service demo --url {svc.url}")
    return "\n".join(lines)


def run_up(host: str = "127.0.0.1", port: int = 8000, config_path: str | None = None, redis_url: str | None = None,
           metrics_port: int | None = None, proxy: str | None = "haproxy", verbose: bool = False) -> int:
    """Serve until SIGINT / SIGTERM, then stop everything this process started.

    ``proxy``: the HTTP ingress, ``haproxy`` (measured the cheaper, docs/benchmarks.md) or ``serve``.
    ``verbose``: Ray's workers and the libraries print everything here, as before; by default only
    ``up``'s own lines and warnings, the rest in ``<data dir>/logs``.
    ``metrics_port``: Prometheus metrics on ``http://127.0.0.1:<port>/metrics`` (Ray's metrics agent;
    0 or None: a port Ray picks); printed at start-up either way.

    First signal: an orderly stop (during start-up it cuts the start short). A second one while
    the app and engines wind down skips that wait; Ray, its processes and the redis-server are
    still stopped, and further signals are ignored until they are.
    """
    from rollout_service.ops.runtime import (
        abandon_local_ray,
        local_ray_gone,
        process_id,
        process_tree,
        shutdown_local_ray,
        stop_processes,
    )

    config = RolloutServiceConfig.from_yaml(config_path) if config_path else RolloutServiceConfig()
    if redis_url:
        config.store.redis_url = redis_url
    svc = LocalService(config, host=host, port=port, metrics_port=metrics_port, proxy=proxy, verbose=verbose)
    stop = threading.Event()
    phase = "starting"  # -> up -> stopping -> forced (a second signal) -> final (uninterruptible)

    def on_signal(signum: int, _frame: Any) -> None:
        # Runs in the main thread between two bytecodes: write with os.write (print may be mid-line).
        # KeyboardInterrupt, because Ray's blocking calls turn only that into an exception.
        nonlocal phase
        if phase == "up":
            stop.set()
        elif phase == "starting":
            phase = "stopping"
            raise KeyboardInterrupt
        elif phase == "stopping":
            phase = "forced"
            os.write(2, b"[up] stopping now, without waiting for the app and engines to wind down\n")
            raise KeyboardInterrupt
        else:
            os.write(2, b"[up] still stopping Ray and redis-server: a few more seconds\n")

    def take_signals() -> None:
        signal.signal(signal.SIGINT, on_signal)
        signal.signal(signal.SIGTERM, on_signal)

    take_signals()
    tree_when_up: set = set()  # every process started, recorded while their parents are alive
    try:
        svc.start()
        take_signals()  # ray.init replaces the SIGTERM handler (see runtime._restore_sigterm)
        tree_when_up = process_tree([os.getpid()]) - {process_id(os.getpid())}
        phase = "up"
        print(ready_banner(svc), flush=True)
        stop.wait()
    except KeyboardInterrupt:
        pass
    finally:
        if phase in ("starting", "up"):
            phase = "stopping"
        # A SIGTERM that reached Ray's failure handler armed alarm(3) to abort us: disarm it.
        signal.alarm(0)
        take_signals()
        print("[up] stopping", flush=True)
        stopping_since = time.perf_counter()
        started = process_tree([os.getpid()]) - {process_id(os.getpid())}  # before Ray's exit reparents it
        started |= tree_when_up
        ray_gone = local_ray_gone()
        if ray_gone:
            print("[up] Ray's own processes got the signal too (sent to the whole process group): stopping what "
                  "is left of them by pid", flush=True)
        try:
            if phase == "stopping" and not ray_gone:
                svc.stop()
        except KeyboardInterrupt:
            pass
        finally:
            phase = "final"
            leftovers: list[int] = []
            try:
                leftovers += abandon_local_ray() if ray_gone else shutdown_local_ray()
            finally:
                if svc.redis is not None:  # stop() was cut short before it got there, or skipped
                    svc.redis.stop()
                leftovers += stop_processes(started)
            if leftovers:
                print(f"[up] had to stop leftover processes by pid: {sorted(set(leftovers))}", flush=True)
            print(f"[up] stopped ({time.perf_counter() - stopping_since:.1f}s)", flush=True)
            if ray_gone:  # Ray's exit hook would wait 60 s for the dead GCS, then abort the process
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(0)
    return 0
