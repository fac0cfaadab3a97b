"""Starting an engine as a Ray actor: its options (its runtime environment, concurrency, no
restarts, no per-task events; the resources and scheduling strategy of its placement, or else the
engine's own CPUs and GPU), its name, namespace and lifetime, and the class it runs:
:class:`~rollout_service.engine.replica.EngineReplica`, or
:class:`~rollout_service.engine.simulated.SimulatedEngine` under ``engine.backend: simulated``. The
engine never imports the fleet: a placement comes in as an object holding its actor options.
"""

from __future__ import annotations

from typing import Any

from rollout_service.config import EngineConfig
from rollout_service.engine.replica import EngineReplica


def engine_runtime_env(config: EngineConfig) -> dict[str, Any]:
    return {"env_vars": {"VLLM_ENABLE_V1_MULTIPROCESSING": "1" if config.multiprocessing else "0"}}


def create_engine_actor(
    config: EngineConfig,
    index: int = 0,
    *,
    placement: Any = None,  # a fleet.placement.EnginePlacement (its .actor_options); the engine never imports the fleet
    name: str | None = None,
    namespace: str | None = None,
    initial_weight_version: str = "0",
    lifetime: str | None = None,
):
    """Start an :class:`EngineReplica` Ray actor, or a
    :class:`~rollout_service.engine.simulated.SimulatedEngine` with ``backend: simulated`` (call
    ``start`` on it before generating).

    With ``placement`` (from :func:`rollout_service.fleet.placement.reserve_engine_placement`) the
    actor takes that placement's resources and scheduling strategy: bundle 0 of the engine's own
    placement group, which holds its GPU(s) (TP > 1: the TP workers vLLM starts go into the same
    group). Without: ``num_cpus_per_engine`` CPUs and, on cuda, ``num_gpus=1`` for TP 1 (0 for
    TP > 1, whose workers then get a placement group vLLM creates itself), anywhere in the cluster.
    """
    import ray

    opts: dict[str, Any] = {
        "runtime_env": engine_runtime_env(config),
        "max_concurrency": 10_000,
        "max_restarts": 0,
        # Ray's per-task events (state API / dashboard task list) are recorded by caller and actor
        # for every call: on the data plane that is CPU per turn on both sides for nothing we read.
        "enable_task_events": False,
    }
    if placement is not None:
        opts.update(placement.actor_options)
    else:
        opts["num_cpus"] = config.num_cpus_per_engine
        if config.device == "cuda":
            opts["num_gpus"] = 1 if config.tensor_parallel_size == 1 else 0
    if name:
        opts["name"] = name
    if namespace:
        opts["namespace"] = namespace
    if lifetime:
        opts["lifetime"] = lifetime
    if config.backend == "simulated":
        from rollout_service.engine.simulated import SimulatedEngine

        # The model path resolved here: building the default tiny model would import torch in the engine.
        return ray.remote(SimulatedEngine).options(**opts).remote(config, index, initial_weight_version,
                                                                   config.resolved_model())
    return ray.remote(EngineReplica).options(**opts).remote(config, index, initial_weight_version)
