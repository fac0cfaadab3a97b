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
from rollout_service.runtime import apply_ray_env

apply_ray_env()  # before anything imports ray: keeps a local cluster on 127.0.0.1

APP_NAME = "rollout-service"


class LocalService:
    """Start / stop the whole service in-process (the CLI, tests and benchmarks use it)."""

    def __init__(self, config: RolloutServiceConfig, *, host: str = "127.0.0.1", port: int = 8000,
                 data_dir: str | None = None, log=print):
        self.config = config.model_copy(deep=True)
        self.host, self.port = host, port
        self.data_dir = data_dir or tempfile.mkdtemp(prefix="rollout-service-")
        self.redis = None
        self.controller = None
        self.log = log

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> "LocalService":
        from ray import serve

        from rollout_service.refit.controller import get_or_create_controller
        from rollout_service.runtime import start_local_ray
        from rollout_service.serve.app import build_app

        t0 = time.perf_counter()
        if not self.config.store.redis_url and not os.environ.get("ROLLOUT_SERVICE_REDIS_URL"):
            from rollout_service.store.embedded import EmbeddedRedis

            self.redis = EmbeddedRedis(Path(self.data_dir) / "redis")
            self.config.store.redis_url = self.redis.start()
            self.log(f"[up] embedded redis-server at {self.config.store.redis_url} (pid {self.redis.pid})")
        model = self.config.engine.resolved_model()
        self.log(f"[up] model: {model}")
        start_local_ray()
        self.log(f"[up] Ray started ({time.perf_counter() - t0:.1f}s); loading {self.config.engine.num_engines} engine(s)...")
        self.controller = get_or_create_controller(self.config)
        import ray

        ref = self.controller.start.remote()
        while True:
            ready, _ = ray.wait([ref], timeout=5)
            if ready:
                ray.get(ref)
                break
            self.log(f"[up]   engines loading... {time.perf_counter() - t0:.0f}s")
        self.log(f"[up] engines ready ({time.perf_counter() - t0:.1f}s); deploying the Serve app")
        serve.start(http_options={"host": self.host, "port": self.port})
        serve.run(build_app(self.config), name=APP_NAME, route_prefix="/")
        self._wait_healthy()
        self.log(f"[up] ready in {time.perf_counter() - t0:.1f}s: {self.url}/v1 (OpenAI base_url)")
        return self

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
        import ray
        from ray import serve

        if ray.is_initialized():  # never start a Ray just to delete an app that was not deployed
            try:
                serve.delete(APP_NAME)
            except Exception:
                pass
        if self.controller is not None and ray.is_initialized():
            try:
                ray.get(self.controller.shutdown.remote(), timeout=60)
            except Exception:
                pass
            ray.kill(self.controller)
            self.controller = None
        if self.redis is not None:
            self.redis.stop()
            self.redis = None


def run_up(host: str = "127.0.0.1", port: int = 8000, config_path: str | None = None, redis_url: str | None = None) -> int:
    config = RolloutServiceConfig.from_yaml(config_path) if config_path else RolloutServiceConfig()
    if redis_url:
        config.store.redis_url = redis_url
    svc = LocalService(config, host=host, port=port)
    stop = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        svc.start()
        print(f"rollout-service is up: {svc.url}  (OpenAI base_url {svc.url}/v1; Ctrl-C stops)", flush=True)
        print(f"try: rollout-service demo --url {svc.url}", flush=True)
        stop.wait()
    finally:
        print("[up] stopping", flush=True)
        svc.stop()
        import ray

        ray.shutdown()
    return 0
