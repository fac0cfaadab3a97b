"""The control plane: owns the engine replicas; the Ray-handle API trainers call.

One named, detached actor per deployment (``rollout-service-refit`` in namespace
``rollout-service``). It creates the engines, so they live as long as the service does, whether the
app was started by ``serve run`` on a driver or by ``serve deploy`` on a cluster. The data plane
(affinity replicas) asks it for the engine handles once and then talks to the engines directly;
pause / weight load / resume are fanned out from here to every engine.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from rollout_service.config import RolloutServiceConfig

logger = logging.getLogger(__name__)

CONTROLLER_NAME = "rollout-service-refit"
CONTROLLER_NAMESPACE = "rollout-service"


class RefitController:
    def __init__(self, config: RolloutServiceConfig | dict):
        self.config = config if isinstance(config, RolloutServiceConfig) else RolloutServiceConfig.model_validate(config)
        self.engines: list[Any] = []
        self.weight_version = "0"
        self._started = False
        self._start_lock = asyncio.Lock()
        self._startup_s: float | None = None

    async def start(self) -> float:
        """Create and start every engine (idempotent). Returns seconds taken."""
        async with self._start_lock:
            if self._started:
                return self._startup_s or 0.0
            from rollout_service.engine.replica import create_engine_actor

            t0 = time.perf_counter()
            ec = self.config.engine
            self.engines = [
                create_engine_actor(ec, i, initial_weight_version=self.weight_version)
                for i in range(ec.num_engines)
            ]
            await asyncio.gather(*[e.start.remote() for e in self.engines])
            self._started = True
            self._startup_s = time.perf_counter() - t0
            return self._startup_s

    async def get_engines(self) -> list[Any]:
        await self.start()
        return list(self.engines)

    async def engine_health(self) -> list[dict[str, Any]]:
        async def one(i, e):
            try:
                return await asyncio.wait_for(e.health.remote(), timeout=10)
            except Exception as exc:  # dead or hung engine: report, do not raise
                return {"index": i, "ready": False, "error": f"{type(exc).__name__}: {exc}"[:300]}

        return list(await asyncio.gather(*[one(i, e) for i, e in enumerate(self.engines)]))

    async def stats(self) -> dict[str, Any]:
        return {
            "weight_version": self.weight_version,
            "num_engines": len(self.engines),
            "engines": await self.engine_health(),
            "startup_s": self._startup_s,
        }

    async def shutdown(self) -> None:
        import ray

        for e in self.engines:
            try:
                await asyncio.wait_for(e.shutdown.remote(), timeout=20)
            except Exception:
                pass
            ray.kill(e)
        self.engines = []
        self._started = False


def get_or_create_controller(config: RolloutServiceConfig, *, name: str = CONTROLLER_NAME):
    """The deployment's controller actor, created on first call (detached: it outlives callers)."""
    import ray

    return (
        ray.remote(RefitController)
        .options(
            name=name,
            namespace=CONTROLLER_NAMESPACE,
            lifetime="detached",
            get_if_exists=True,
            num_cpus=0,
            max_concurrency=1000,
        )
        .remote(config.model_dump())
    )


def get_controller(name: str = CONTROLLER_NAME):
    """For trainers: the running service's controller (``ray.get_actor``)."""
    import ray

    return ray.get_actor(name, namespace=CONTROLLER_NAMESPACE)
