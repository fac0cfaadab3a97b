"""Where a replacement engine gets the current weights from, and the record the fleet keeps of them.

The current version's source is, in order: the checkpoint directory it was loaded from (the model
path at start, the path transport), a copy in the Ray object store owned by the fleet (taken from a
serving engine after an in-memory refit, off the refit's stall: ``fleet.keep_weights_copy``), or,
lacking both, a live engine that streams them at replacement time.

A mixin of :class:`~rollout_service.fleet.fleet.EngineFleet`, whose slots, health and view it uses.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any

import ray

from rollout_service.fleet.types import Member

logger = logging.getLogger(__name__)


@dataclass
class WeightsRecord:
    """Where the current version's weights can be loaded from."""

    version: str
    path: str | None = None  # a checkpoint directory holding exactly these weights
    ref: Any = None  # ObjectRef of {"version", "weights"} in the object store, owned by the fleet
    exporting: asyncio.Task | None = field(default=None, repr=False)


class CurrentWeights:
    async def _load_current(self, slot: int, generation: int) -> None:
        """Load the current version into the slot's engine (nothing to do for the model's own weights),
        label it, and report it loaded: it serves if that is still the current version."""
        s = self.slots[slot]
        while self.health.refitting and not self._closing:
            await asyncio.sleep(0.05)  # a load must not race a refit; the new version comes after it
        target = self.weights
        timeout = self.health.policy.start_timeout_s
        try:
            if not self.health.is_current(slot, generation) or s.actor is None:
                return
            loaded = await asyncio.wait_for(s.actor.weight_version.remote(), 60)
            if loaded != target.version:
                source = await self._source_for(target, exclude=slot)
                actor = s.actor
                await asyncio.wait_for(actor.stage_weights_from_object_store.remote([source], timeout), timeout)
                await asyncio.wait_for(actor.collective_rpc.remote("rs_load_staged", timeout=timeout), timeout)
                await asyncio.wait_for(actor.collective_rpc.remote("rs_commit", timeout=timeout), timeout)
                await asyncio.wait_for(actor.set_weight_version.remote(target.version), 60)
                loaded = target.version
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            logger.warning("engine slot %d could not load version %s: %s", slot, target.version, short_error(exc))
            await self._failed(slot, generation, f"loading version {target.version}: {short_error(exc)}")
            return
        before = self.health.epoch
        state = self.health.on_loaded(slot, generation, loaded)
        logger.info("engine slot %d (generation %d) loaded version %s: %s", slot, generation, loaded, state.value)
        await self._publish(before)

    async def _source_for(self, target: WeightsRecord, exclude: int):
        """An object ref a replacement stages from: the path, the kept copy, or a live engine's export."""
        import ray

        if target.path is not None:
            return ray.put({"path": target.path})
        if target.exporting is not None and not target.exporting.done():
            await asyncio.shield(target.exporting)
        if target.ref is not None:
            return target.ref
        for m in self._view().members:
            if m.slot != exclude:
                version_ref, weights_ref = self._export(m)
                if await version_ref == target.version:
                    return weights_ref
        raise RuntimeError(f"no source for weight version {target.version}: no checkpoint path, no kept copy, "
                           "no live engine to stream it from")

    def _export(self, member: Member):
        """(version ref, weights ref) of a serving engine's weights. Both are return values of a call
        this actor makes, so this actor owns them: they outlive the engine that produced them."""
        return member.handle.export_weights.options(num_returns=2).remote(self.health.policy.start_timeout_s)

    def _start_export(self) -> None:
        """Keep a copy of the current weights in the object store, owned by this actor."""
        target = self.weights

        async def export():
            for m in self._view().members:
                try:
                    version_ref, weights_ref = self._export(m)
                    if await version_ref == target.version and self.weights is target:
                        await _ready(weights_ref)
                        target.ref = weights_ref
                        return
                except asyncio.CancelledError:
                    raise
                except Exception as exc:
                    logger.warning("export of version %s from slot %d failed: %s", target.version, m.slot, short_error(exc))

        target.exporting = asyncio.get_running_loop().create_task(export())


async def _ready(ref) -> None:
    import ray

    await asyncio.to_thread(ray.wait, [ref], num_returns=1, fetch_local=False)


def short_error(exc: BaseException) -> str:
    cause = getattr(exc, "cause", None) or exc
    lines = [ln.strip() for ln in str(cause).splitlines() if ln.strip()]
    return f"{type(cause).__name__}: {lines[-1] if lines else ''}"[:300]
