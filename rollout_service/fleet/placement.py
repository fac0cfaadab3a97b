"""Where an engine runs: one Ray placement group per engine, so no two engines share a GPU.

Ray only (no vLLM import): the fleet reserves a placement for each engine before it starts the
engine actor, and releases it when the engine is gone for good.

Bundles (:func:`engine_bundles`):

- ``device="cuda"``: one bundle per tensor-parallel worker, ``{"GPU": 1}``. Bundle 0 also carries
  the engine actor's own ``num_cpus_per_engine`` CPUs and ``bundle_resources``. The other bundles
  carry no CPU: vLLM's Ray executor starts its workers with ``num_cpus=0`` (see below), so CPU in
  them would be reserved and never used.
- ``device="cpu"``: a single bundle, ``{"CPU": num_cpus_per_engine}`` plus ``bundle_resources``.
  With ``num_cpus_per_engine=0`` and no ``bundle_resources`` there is nothing to reserve (Ray
  rejects a bundle whose resources are all zero): :func:`engine_bundles` returns ``[]`` and
  :func:`reserve_engine_placement` returns a placement without a group (plain actor options).

Placement groups are created only where they place something: every cuda engine, and a cpu engine
whose ``bundle_resources`` pin it to labelled nodes. A cpu engine without ``bundle_resources``
starts as a plain actor with ``num_cpus_per_engine`` CPUs, exactly as before placement existed (a
one-bundle group would reserve the same CPUs on the same kind of node, only later and slower).

Engine actor options (:attr:`EnginePlacement.actor_options`), always with
``PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=0,
placement_group_capture_child_tasks=True)`` when there is a group:

- cuda, ``tensor_parallel_size == 1``: ``num_gpus=1`` -> Ray sets ``CUDA_VISIBLE_DEVICES`` of the
  engine actor to bundle 0's GPU, and vLLM's in-process ("uni") executor uses it.
- cuda, ``tensor_parallel_size > 1``: ``num_gpus=0``. The engine runs vLLM with
  ``distributed_executor_backend="ray"`` (``EngineReplica.engine_args``). vLLM 0.32 then finds this
  group itself: ``EngineArgs.create_engine_config`` sets ``ParallelConfig.placement_group`` to
  ``ray.util.get_current_placement_group()`` when it runs inside a Ray actor
  (vllm/engine/arg_utils.py), ``initialize_ray_cluster`` (vllm/v1/executor/ray_utils.py) uses
  that group instead of creating one and checks it has >= world_size bundles with exactly one GPU,
  and ``RayExecutorV2`` (vllm/v1/executor/ray_executor_v2.py, the default Ray executor) starts one
  ``RayWorkerProc`` actor per GPU bundle (``get_bundles_sorted_by_node``: the group's bundles with
  a GPU, in index order on one node) with ``num_cpus=0, num_gpus=1`` and
  ``PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i)``. Worker 0 shares bundle
  0 with the engine actor (which holds its CPUs, the worker its GPU).

``placement_strategy`` is ``STRICT_PACK`` by default: all bundles of an engine on one node, so a
tensor-parallel group never spans nodes. ``PACK`` lets Ray spread an engine over nodes when no
single node fits it (tensor parallelism over the network: slow, only for clusters without a node
large enough).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from rollout_service.config import EngineConfig

logger = logging.getLogger(__name__)

PENDING_WARNING_S = 60.0  # a group still pending this long is logged (with what it needs) while it waits on


class PlacementUnavailable(RuntimeError):
    """The cluster could not fit an engine's placement group within the timeout."""


@dataclass
class EnginePlacement:
    """An engine's reservation: its placement group (or None) and the options to start it with."""

    placement_group: Any | None  # ray.util.placement_group.PlacementGroup
    bundle_index: int = 0  # the bundle the engine actor itself is placed in
    actor_options: dict[str, Any] = field(default_factory=dict)  # num_cpus, num_gpus, scheduling_strategy
    bundles: list[dict[str, float]] = field(default_factory=list)  # what the group reserves


def engine_bundles(config: EngineConfig) -> list[dict[str, float]]:
    """The placement group bundles of one engine ([] when it reserves nothing: cpu, 0 CPUs, no pins)."""
    extra = {k: float(v) for k, v in config.bundle_resources.items()}
    cpus = float(config.num_cpus_per_engine)
    if config.device == "cuda":
        bundles: list[dict[str, float]] = [{"GPU": 1.0} for _ in range(config.tensor_parallel_size)]
        if cpus > 0:
            bundles[0]["CPU"] = cpus
    else:
        bundles = [{"CPU": cpus}] if cpus > 0 else [{}]
    bundles[0].update(extra)
    if not any(v > 0 for v in bundles[0].values()):
        return []
    return bundles


def engine_actor_options(config: EngineConfig, placement_group: Any | None = None) -> dict[str, Any]:
    """Ray actor resource options of an engine, inside ``placement_group``'s bundle 0 when given."""
    opts: dict[str, Any] = {"num_cpus": config.num_cpus_per_engine}
    if config.device == "cuda":
        # TP > 1: vLLM's Ray executor places one worker actor (num_gpus=1) per bundle itself.
        opts["num_gpus"] = 1 if config.tensor_parallel_size == 1 else 0
    if placement_group is not None:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
            placement_group=placement_group,
            placement_group_bundle_index=0,
            placement_group_capture_child_tasks=True,
        )
    return opts


def reserve_engine_placement(
    config: EngineConfig,
    index: int,
    *,
    timeout_s: float = 300.0,
    name: str | None = None,
    lifetime: str | None = None,
) -> EnginePlacement:
    """Create engine ``index``'s placement group and wait (at most ``timeout_s``) until it is placed.

    ``name`` names the group (``ray list placement-groups``); ``lifetime="detached"`` must match a
    detached engine actor, otherwise the group, and the actor in it, die with the caller. Raises
    :class:`PlacementUnavailable` (naming the bundles, the strategy and the cluster's resources)
    when the cluster cannot fit the group in time; the pending group is removed then. A group still
    pending after :data:`PENDING_WARNING_S` is logged with the same diagnosis while the wait goes on
    (GPU nodes may still be joining; a group no node can ever hold waits the whole ``timeout_s``,
    the fleet's ``start_timeout_s``, and the log says why long before).
    """
    bundles = engine_bundles(config)
    if not bundles:
        return EnginePlacement(None, 0, engine_actor_options(config), [])
    if config.device == "cpu" and not config.bundle_resources:
        # Nothing to pin: a one-bundle group would only delay a plain CPU reservation.
        return EnginePlacement(None, 0, engine_actor_options(config), [])

    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    kwargs: dict[str, Any] = {"strategy": config.placement_strategy}
    if name:
        kwargs["name"] = name
    if lifetime:
        kwargs["lifetime"] = lifetime
    pg = placement_group(bundles, **kwargs)
    ready_ref = pg.ready()
    first_wait = min(timeout_s, PENDING_WARNING_S)
    ready, _ = ray.wait([ready_ref], timeout=first_wait)
    if not ready and timeout_s > first_wait:
        logger.warning(
            "engine %d: placement group of %d bundles %s (strategy %s) still pending after %gs, waiting up to "
            "%gs more; free in the cluster: %s; nodes: %s. %s", index, len(bundles), _bundles_text(bundles),
            config.placement_strategy, first_wait, timeout_s - first_wait, _resources(ray.available_resources()),
            _nodes(ray), _hint(config),
        )
        ready, _ = ray.wait([ready_ref], timeout=timeout_s - first_wait)
    if not ready:
        try:
            remove_placement_group(pg)
        except Exception:  # pragma: no cover - best effort: the group is pending anyway
            pass
        raise PlacementUnavailable(
            f"engine {index}: placement group of {len(bundles)} bundles {_bundles_text(bundles)} "
            f"(strategy {config.placement_strategy}) not placed within {timeout_s:g}s; "
            f"free in the cluster: {_resources(ray.available_resources())}; nodes: {_nodes(ray)}. "
            + _hint(config)
        )
    return EnginePlacement(pg, 0, engine_actor_options(config, pg), bundles)


def adopt_engine_placement(config: EngineConfig, name: str | None) -> EnginePlacement | None:
    """The placement group ``name`` that a fleet actor before a restart reserved for an engine it
    still runs (None: it reserved none, or the group is gone: a replacement reserves anew)."""
    bundles = engine_bundles(config)
    if not name or not bundles or (config.device == "cpu" and not config.bundle_resources):
        return None
    import ray

    try:
        pg = ray.util.get_placement_group(name)
    except ValueError:
        return None
    return EnginePlacement(pg, 0, engine_actor_options(config, pg), bundles)


def release_engine_placement(placement: EnginePlacement | None) -> None:
    """Remove the engine's placement group (idempotent; actors still in it are killed by Ray)."""
    if placement is None or placement.placement_group is None:
        return
    from ray.util.placement_group import remove_placement_group

    try:
        remove_placement_group(placement.placement_group)
    except Exception:  # already removed, or Ray is gone
        pass
    placement.placement_group = None


def _bundles_text(bundles: list[dict[str, float]]) -> str:
    """``[b0, b1, b1, b1]`` as ``[b0] + 3 x b1`` (a TP group's worker bundles are all alike)."""
    rest = bundles[1:]
    if len(rest) > 1 and all(b == rest[0] for b in rest):
        return f"[{bundles[0]}] + {len(rest)} x {rest[0]}"
    return str(bundles)


def _resources(res: dict[str, float]) -> dict[str, float]:
    """A Ray resource dict without node ids, memory and placement-group-internal (``*_group_*``) entries."""
    return {
        k: v for k, v in sorted(res.items()) if not k.startswith("node:") and "memory" not in k and "_group_" not in k
    }


def _nodes(ray) -> list[dict[str, float]]:
    """Each alive node's total resources (a STRICT_PACK group must fit one of them)."""
    try:
        return [_resources(n.get("Resources", {})) for n in ray.nodes() if n.get("Alive")]
    except Exception:  # pragma: no cover - diagnostics only
        return []


def _hint(config: EngineConfig) -> str:
    hints = []
    if config.device == "cuda":
        hints.append(
            f"tensor_parallel_size {config.tensor_parallel_size} must fit the free GPUs of one node"
            if config.placement_strategy == "STRICT_PACK"
            else f"tensor_parallel_size {config.tensor_parallel_size} must fit the free GPUs of the cluster"
        )
    if config.bundle_resources:
        hints.append(f"a node must offer bundle_resources {dict(config.bundle_resources)}")
    return ("Check `ray status`: " + "; ".join(hints) + ".") if hints else "Check `ray status`."
