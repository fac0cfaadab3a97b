"""How the refit controller reaches the engines in a refit's three phases: over each engine's data
channel (``refit.control: channel``) or by Ray actor calls (``ray``).

A refit's stall on a fleet of many engines is mostly the cost of its fan-outs: three calls per
engine, each a Ray actor call (task spec, scheduling, the result as a Ray object) whose cost, paid
by the controller and the engine on every call, grows the stall by milliseconds per engine
(docs/scale.md). The data plane already holds a TCP connection to every engine for generations;
the controller opens its own to each engine and sends the phases as control frames
(:meth:`rollout_service.engine.channel.EngineChannel.control`): the same engine methods
(:class:`rollout_service.engine.refit_steps.RefitSteps`), a fraction of the cost.

Failure semantics stay those of a Ray call. A control call runs to its end in the engine even if
the controller gives up on it (a deadline). A lost connection does not say whether the engine died
(a Ray call's ActorDiedError does): the controller then asks Ray, so an engine that died is
reported as dead (the fleet replaces it on the current version) and one that lives is in an unknown
state (:class:`ControlLost`, not an engine death: after a failed apply it is replaced, never rolled
back blind). An engine without a channel (``engine.data_channel: ray``), weights staged through the
object store (references cannot cross the channel) and every call of the failure path use Ray.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from rollout_service.engine.channel import EngineChannel
from rollout_service.engine.types import EngineLost
from rollout_service.fleet.types import Member, is_actor_dead

logger = logging.getLogger(__name__)

PING_TIMEOUT_S = 5.0  # asking Ray whether an engine whose control connection was lost still lives
READY_TIMEOUT_S = 10.0  # a connection's check before a refit (longer: the engine goes by Ray calls)


class ControlLost(RuntimeError):
    """The control connection to an engine was lost and Ray says the engine lives: whether the
    call ran, and how far, is unknown."""


class EngineControl:
    """The controller's control connections, one per engine actor, kept across refits."""

    def __init__(self, mode: str = "channel"):
        self.mode = mode
        self._channels: dict[tuple, EngineChannel] = {}

    @staticmethod
    def _key(m: Member) -> tuple | None:
        address = getattr(m, "channel", None)
        return None if address is None else (m.slot, m.generation, address.host, address.port, address.token)

    async def prepare(self, members, timeout: float) -> None:
        """Open (and check, by a ``refit_ready`` call) the connections a refit over ``members``
        will use, before its pause: not part of the stall. Closes those of engines that left, or
        all of them when the mode is not ``channel``. An engine whose connection cannot be opened
        or does not answer is reached by Ray calls in this refit."""
        if self.mode != "channel":
            self.close()
            return
        keys = {k for k in map(self._key, members) if k is not None}
        for key in [k for k in self._channels if k not in keys]:
            self._channels.pop(key).close()
        for m in members:
            key = self._key(m)
            if key is not None and key not in self._channels:
                self._channels[key] = EngineChannel(m.channel)

        async def check(key):
            try:
                await asyncio.wait_for(self._channels[key].control("refit_ready"), min(timeout, READY_TIMEOUT_S))
            except Exception as exc:  # noqa: BLE001 - that engine goes by Ray calls
                logger.info("refit control: no channel to engine slot %s (%s); using Ray calls", key[0], exc)
                self._channels.pop(key).close()

        await asyncio.gather(*[check(k) for k in keys if k in self._channels])

    def channel(self, m: Member) -> EngineChannel | None:
        key = self._key(m)
        return None if key is None or self.mode != "channel" else self._channels.get(key)

    async def call(self, m: Member, method: str, *args: Any, ray_only: bool = False) -> Any:
        """``m``'s ``method(*args)``: over its control connection if it has one (and ``ray_only``
        is false), else as a Ray actor call."""
        channel = None if ray_only else self.channel(m)
        if channel is None:
            return await getattr(m.handle, method).remote(*args)
        try:
            return await channel.control(method, *args)
        except EngineLost as exc:
            if getattr(exc, "answered", False):  # the engine said it cannot serve: as a dead engine
                raise
            raise await self._why_lost(m, exc) from None

    async def _why_lost(self, m: Member, lost: EngineLost) -> BaseException:
        """The engine's death as Ray reports it, or ControlLost when Ray reaches it (or cannot tell
        within PING_TIMEOUT_S: a stalled engine is not a dead one)."""
        deadline = time.monotonic() + PING_TIMEOUT_S
        while (left := deadline - time.monotonic()) > 0:
            try:
                await asyncio.wait_for(m.handle.num_in_flight.remote(), left)
                break
            except Exception as exc:  # noqa: BLE001 - classified here
                if is_actor_dead(exc):
                    return exc
                await asyncio.sleep(min(0.2, max(0.0, deadline - time.monotonic())))
        return ControlLost(f"control connection to engine slot {m.slot} lost: {lost}")

    def close(self) -> None:
        for channel in self._channels.values():
            channel.close()
        self._channels.clear()
