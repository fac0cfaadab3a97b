"""Bringing an engine up in a slot: reserve its placement group (kept across replacements), create
the actor (named and detached when the fleet is), start it, open its data channel, then load the
current weights (:mod:`rollout_service.fleet.current_weights`); a failure goes to the health state
machine. A mixin of :class:`~rollout_service.fleet.fleet.EngineFleet`, whose slots, health and
config it uses.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

from rollout_service.config import RolloutServiceConfig
from rollout_service.fleet.adoption import engine_name, placement_name
from rollout_service.fleet.current_weights import short_error
from rollout_service.fleet.types import BASE_VERSION, FLEET_NAMESPACE

logger = logging.getLogger("rollout_service.fleet.fleet")


@dataclass
class Slot:
    """One engine slot: its current actor and what the fleet knows of it."""

    generation: int = -1
    actor: Any = None
    placement: Any = None
    processes: dict[str, Any] | None = None  # node_id + (pid, create_time) of the engine's processes
    channel: Any = None  # the engine's data channel address (engine.channel.ChannelAddress), if it has one
    load: int = 0
    task: asyncio.Task | None = None  # the start / load running for this slot
    starting: bool = False  # inside the engine's start: it answers no call before the start ends
    paused_since: float | None = None  # first probe that found it paused while no refit ran


class BringUp:
    config: RolloutServiceConfig

    def _launch(self, slot: int, generation: int) -> None:
        s = self.slots[slot]
        if s.task is not None and not s.task.done():
            s.task.cancel()  # a start of an earlier generation that never ended
        s.task = asyncio.get_running_loop().create_task(self._bring_up(slot, generation))

    async def _bring_up(self, slot: int, generation: int) -> None:
        """Start an engine in ``slot`` and bring it to the current weights; failures go to the state machine."""
        from rollout_service.engine.actor import create_engine_actor

        s = self.slots[slot]
        ec = self.config.engine
        timeout = self.health.policy.start_timeout_s
        try:
            if s.placement is None:  # kept across replacements: a replacement gets the same GPUs / node
                s.placement = await reserve(ec, slot, timeout, **self._detached(placement_name(self._name, slot)))
            actor = create_engine_actor(ec, slot, placement=s.placement, initial_weight_version=BASE_VERSION,
                                        **self._detached(engine_name(self._name, slot, generation),
                                                         namespace=FLEET_NAMESPACE))
            s.generation, s.actor = generation, actor
            s.starting = True
            try:
                await asyncio.wait_for(actor.start.remote(), timeout)
            finally:
                if s.generation == generation:  # a later start of this slot keeps its own mark
                    s.starting = False
            s.processes = await asyncio.wait_for(actor.process_info.remote(), 60)
            if ec.data_channel == "tcp":
                channel = await asyncio.wait_for(actor.open_channel.remote(), 60)
                if s.actor is actor:
                    s.channel = channel
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            logger.warning("engine slot %d failed to start: %s", slot, short_error(exc))
            await self._failed(slot, generation, short_error(exc))
            return
        await self._load_current(slot, generation)

    async def _failed(self, slot: int, generation: int, error: str) -> None:
        before = self.health.epoch
        self.health.on_start_failed(slot, generation, error)
        if self.slots[slot].generation == generation:
            self._kill(self.slots[slot])
        await self._publish(before)

    def _detached(self, name: str | None, **extra: Any) -> dict[str, Any]:
        """Options that let an engine (or its placement group) outlive this actor, when it is named."""
        return {"name": name, "lifetime": "detached", **extra} if self._name is not None else {}


async def reserve(config, slot: int, timeout: float, **options: Any):
    """Reserve an engine's placement group in a thread. If the bring-up is cancelled while the
    thread waits (fleet stop, a config restart), the thread still finishes: the group it then
    holds is removed instead of keeping its GPUs until the fleet actor dies."""
    from rollout_service.fleet.placement import release_engine_placement, reserve_engine_placement

    reservation = asyncio.ensure_future(asyncio.to_thread(reserve_engine_placement, config, slot, timeout_s=timeout,
                                                          **options))
    try:
        return await asyncio.shield(reservation)
    except asyncio.CancelledError:
        def release_abandoned(done: asyncio.Future) -> None:
            if not done.cancelled() and done.exception() is None:
                release_engine_placement(done.result())

        reservation.add_done_callback(release_abandoned)
        raise
