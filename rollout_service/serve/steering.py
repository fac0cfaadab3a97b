"""What a trainer steers on the data plane: aborting a rollout and bounding its staleness.

A mixin of :class:`~rollout_service.serve.turns.TurnRunner` (its store, fleet client and config).

- **Abort** (``POST /v1/rollouts/{id}/abort``): the rollout's status becomes ``aborted`` in the
  store (durable, seen by every replica), then every engine aborts the rollout's running request;
  the call that was generating ends with ``finish_reason: "abort"`` and its tokens so far are stored
  (the store takes that one call after an abort); any later call gets 409 ``rollout_aborted``.
- **Staleness bound** (``rollouts.max_staleness``, ``X-Max-Staleness``): a call is admitted only while
  the rollout's oldest generated token is at most k refits behind the version the fleet serves now
  (``FleetView.versions``); beyond it, 409 ``rollout_stale`` naming both versions, nothing generated
  or stored, and the rollout's status says ``stale``. A call already running at a refit finishes.
"""

from __future__ import annotations

import logging
from typing import Any

from rollout_service.config import RolloutServiceConfig
from rollout_service.metrics import get_metrics
from rollout_service.onpolicy.types import RolloutState
from rollout_service.serve.errors import http_error
from rollout_service.serve.protocol.envelope import ServiceError, bad_request
from rollout_service.serve.turn_types import TurnRequest
from rollout_service.store.base import RolloutAborted, StoreError, validate_rollout_id

logger = logging.getLogger(__name__)

ABORT_REASON_MAX_LEN = 512


def oldest_version(state: RolloutState) -> str | None:
    """The version of the rollout's first generated token (its oldest behaviour policy), None before any."""
    for seg in state.segments:
        for turn in seg.turns:
            if turn.weight_versions:
                return turn.weight_versions[0].version
    return None


class RolloutSteering:
    config: RolloutServiceConfig  # the TurnRunner's

    async def admit(self, state: RolloutState | None, req: TurnRequest) -> None:
        """Refuse a call of an aborted rollout (409 rollout_aborted) or of one past its staleness
        bound (409 rollout_stale, the status marked); nothing is generated or stored either way.
        Under a bound, the fleet's view is read afresh first."""
        if state is None or req.rollout_id is None:
            return
        if state.status == "aborted":
            get_metrics().turn_refused("aborted")
            raise http_error(RolloutAborted(req.rollout_id, state.status_reason)) from None
        rollouts = self.config.rollouts
        bound = req.max_staleness if req.max_staleness is not None else rollouts.max_staleness
        oldest = oldest_version(state)
        view = self.fleet.view
        if oldest is None or view is None:
            return
        if bound is not None:
            # The replica's copy follows the fleet within its watch interval, and a committed refit does
            # not wake the watch: a bounded call reads the fleet's view afresh (one actor call per call
            # of a rollout under a bound), so a copy from before the last refits cannot under-count.
            try:
                view = await self.fleet.refresh()
            except Exception as exc:  # the fleet restarting: judge on the copy at hand
                logger.warning("staleness check on a possibly old fleet view: %s", exc)
        lag = view.lag(oldest)
        known = lag is not None
        if not known:  # older than the fleet remembers (or never served here): past any bound it knows
            lag = len(view.versions)
        get_metrics().rollout_lag(lag)
        if bound is None or lag <= bound:
            return
        get_metrics().turn_refused("stale")
        behind = f"{lag} refits behind" if known else f"more than {lag - 1} refits behind (older than the fleet remembers)"
        message = (f"rollout {req.rollout_id!r} is stale: its oldest generated token's version {oldest!r} is {behind} the "
                   f"version served now, {view.version!r}; the staleness bound is {bound}")
        raise StaleRollout(req.rollout_id, message)

    async def mark_stale(self, exc: "StaleRollout") -> None:
        """Record a refusal for staleness in the rollout's status (best effort: the 409 stands either way)."""
        try:
            await self._store_op("mark", self.store.mark(exc.rollout_id, "stale", exc.message))
        except StoreError as err:
            logger.warning("could not mark rollout %s stale: %s", exc.rollout_id, err)

    async def abort_rollout(self, rollout_id: str, reason: Any = None, *, create: bool = False) -> dict[str, Any]:
        """Abort a rollout (idempotent): its status, then its running request on every engine.
        ``create``: a rollout with nothing stored yet (a group member on its first call) is aborted
        too, instead of a 404."""
        try:
            validate_rollout_id(rollout_id)
        except StoreError as exc:
            raise http_error(exc) from None
        if reason is not None and not isinstance(reason, str):
            raise bad_request("reason must be a string", param="reason")
        if reason is not None and len(reason) > ABORT_REASON_MAX_LEN:
            raise bad_request(f"reason must be at most {ABORT_REASON_MAX_LEN} characters", param="reason")
        try:
            fresh = await self._store_op("mark", self.store.mark(rollout_id, "aborted", reason or "", create=create))
        except StoreError as exc:
            raise http_error(exc) from None
        if fresh is None:
            raise ServiceError(404, f"rollout {rollout_id!r} not found", type="not_found_error", code="rollout_not_found")
        aborted = await self.fleet.abort_rollout(rollout_id)
        state = await self._load(rollout_id)
        return {"id": rollout_id, "object": "rollout.abort", "status": "aborted",
                "reason": state.status_reason if state is not None else reason, "already_aborted": not fresh,
                "aborted_calls": aborted}


class StaleRollout(ServiceError):
    """409 rollout_stale: the rollout is past its staleness bound (``admit``)."""

    def __init__(self, rollout_id: str, message: str):
        super().__init__(409, message, type="conflict_error", code="rollout_stale")
        self.rollout_id = rollout_id
        self.message = message
