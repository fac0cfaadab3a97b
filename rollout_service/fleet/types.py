"""What the fleet publishes and how its users read it: a serving :class:`Member`, the
:class:`FleetView` at one epoch, and the predicates that say an engine call failed because the
engine is gone. The data plane's client, the fleet actor and the control plane all import these;
none imports another for them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import ray.exceptions as rex

from rollout_service.engine.types import EngineLost

FLEET_NAMESPACE = "rollout-service"  # the namespace of the fleet, its engines and the refit controller
BASE_VERSION = "0"  # the label of the model's own weights


@dataclass(frozen=True)
class Member:
    """One serving engine: its slot (GPU / TP group), the generation of the actor in that slot
    (bumped by every replacement), the handle, and its load at the last probe."""

    slot: int
    generation: int
    handle: Any
    load: int = 0
    channel: Any = None  # engine.channel.ChannelAddress: the data plane's path (engine.data_channel: tcp)

    @property
    def key(self) -> tuple[int, int]:
        return (self.slot, self.generation)


@dataclass(frozen=True)
class FleetView:
    """The serving set at one epoch. Pickle-safe: it crosses Ray calls."""

    epoch: int
    version: str
    members: tuple[Member, ...]
    refitting: bool = False
    incarnation: str | None = None  # the fleet actor's life: a new one after every restart of the actor
    # Engines being drained (retired on purpose): routed nothing new, but the calls they run go on, so
    # a data-plane process keeps their channels open.
    draining: tuple[tuple[int, int], ...] = ()
    # The committed versions, oldest first, ``version`` last (fleet.health.VERSION_HISTORY at most):
    # a rollout's lag is how many refits its oldest token's version is behind ``version``.
    versions: tuple[str, ...] = ()

    def lag(self, version: str) -> int | None:
        """Refits between ``version`` and the current one; None: a version not in ``versions``
        (older than the fleet remembers, or never committed here)."""
        for back, v in enumerate(reversed(self.versions)):
            if v == version:
                return back
        return None

    def handles(self) -> list[Any]:
        return [m.handle for m in self.members]


# The refit report's fields a refit bracket's end carries into the fleet's ``last_refit``
# (``GET /v1/status``): how the weights were staged, and how long the engines stalled.
REFIT_TIMINGS = ("staging", "staging_fallback", "staged_bytes", "stage_s", "stall_s", "total_s")


class NoEngineAvailable(RuntimeError):
    """No engine is serving right now (all dead, replacing, or stale); the fleet is healing."""

    status = 503
    error_type = "service_unavailable"
    code = "no_engine"


class EngineCallDeadline(RuntimeError):
    """A generation ran past its deadline (``fleet.call_deadline_s`` + per token of ``max_tokens``): it
    was aborted in its engine and nothing of it was stored; the call can be retried."""

    status = 504
    error_type = "timeout"
    code = "engine_deadline"

    def __init__(self, slot: int, deadline_s: float, generated: int):
        super().__init__(f"the generation did not finish within its deadline of {deadline_s:.1f}s (engine replica "
                         f"{slot}, {generated} tokens generated): it was aborted and nothing was stored; retry the call")
        self.slot = slot
        self.deadline_s = deadline_s


class EngineLostDuringCall(RuntimeError):
    """The engine serving a call died and the call could not go on elsewhere (a generation that
    cannot be continued on another engine, ``reason``; or every engine tried): nothing of the call
    was kept; the rollout continues from its stored tokens on a live engine."""

    status = 503
    error_type = "service_unavailable"
    code = "engine_lost"

    def __init__(self, slot: int, reason: str | None = None):
        super().__init__(f"engine replica {slot} died during the call; nothing was stored, retry the call (the "
                         "rollout continues on a live engine)" + (f"; it could not continue elsewhere: {reason}"
                                                                  if reason else ""))
        self.slot = slot
        self.reason = reason


def is_engine_death(exc: BaseException) -> bool:
    """The engine is gone (killed, crashed, node lost, unreachable): Ray's ways of saying so of the
    actor, or its data channel lost (:class:`~rollout_service.engine.types.EngineLost`)."""
    return isinstance(exc, (rex.ActorDiedError, rex.ActorUnavailableError, rex.RayActorError, EngineLost))


def is_actor_dead(exc: BaseException) -> bool:
    """Dead for good (not merely unreachable for a moment)."""
    return isinstance(exc, rex.RayActorError) and not isinstance(exc, rex.ActorUnavailableError)


def actor_identity() -> tuple[str | None, bool]:
    """(this actor's name, whether Ray restarted it after a death); (None, False) outside an actor."""
    import warnings

    try:
        import ray

        ctx = ray.get_runtime_context()
        with warnings.catch_warnings():  # Ray's property reads its own deprecated actor_id
            warnings.simplefilter("ignore", DeprecationWarning)
            return ctx.get_actor_name() or None, bool(ctx.was_current_actor_reconstructed)
    except Exception:
        return None, False


ABORT_CALL_TIMEOUT_S = 5.0  # an engine that does not answer an abort in this long runs nothing worth waiting for


async def abort_rollout_on(members, rollout_id: str, timeout_s: float = ABORT_CALL_TIMEOUT_S) -> int:
    """Ask each of ``members``' engines to abort the requests of ``rollout_id`` (each ends at its
    engine's next step with finish_reason abort); how many were running. An engine that fails or
    does not answer within ``timeout_s`` counts none. The data plane's and the controller's abort."""
    import asyncio
    import logging

    async def one(m: Member) -> int:
        try:
            return int(await asyncio.wait_for(m.handle.abort_rollout.remote(rollout_id), timeout_s))
        except Exception as exc:
            logging.getLogger(__name__).warning("abort of rollout %s on engine slot %d: %s", rollout_id, m.slot, exc)
            return 0

    return sum(await asyncio.gather(*[one(m) for m in members]))
