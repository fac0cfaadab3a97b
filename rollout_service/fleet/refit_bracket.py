"""The refit bracket and the fleet's durable record of it; a mixin of
:class:`~rollout_service.fleet.fleet.EngineFleet`, whose health, weights and ledger it uses.

The control plane brackets every refit with :meth:`RefitBracket.begin_refit` /
:meth:`RefitBracket.end_refit`: the refit runs over the engines serving at its start, no engine joins
the serving set meanwhile, and a replacement only joins once it holds the version the refit
committed. A bracket not ended within its lease (its controller died) is ended by the fleet's
monitor, with no version change. The last refit and the refit counts are kept for operators
(``stats()``, ``GET /v1/status``).

The bracket, the committed version and the Serve apps are what a new incarnation of the fleet
cannot learn from its engines: every change to them is written to the fleet's ledger
(:mod:`rollout_service.fleet.ledger`) by :meth:`RefitBracket._persist`.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from rollout_service.config import RolloutServiceConfig
from rollout_service.fleet.current_weights import WeightsRecord
from rollout_service.fleet.health import SERVING, EngineState
from rollout_service.fleet.types import REFIT_TIMINGS, FleetView, Member

logger = logging.getLogger("rollout_service.fleet.fleet")


class RefitBracket:
    config: RolloutServiceConfig

    def _init_refit_record(self) -> None:
        """The last refit bracket and the counts by outcome, for operators; kept across restarts."""
        self._last_refit: dict[str, Any] | None = None
        self._refits = {"committed": 0, "not_committed": 0}

    def _reset_bracket(self) -> None:
        self._refit_deadline = float("inf")
        self._refit_members: list[tuple[int, int]] = []  # (slot, generation) of the open bracket's engines

    async def begin_refit(self, lease_s: float = 3600.0) -> FleetView:
        """A refit starts over the returned members; nothing joins the serving set until ``end_refit``
        or until ``lease_s`` passes (a controller that died mid-refit does not block joins forever)."""
        await self._adopt_inherited_engines()
        if self.health.refitting:
            raise RuntimeError("a refit is already bracketed on the fleet")
        self.health.begin_refit()
        self._refit_deadline = time.monotonic() + lease_s
        self._refit_members = [(i, self.health.slots[i].generation) for i in self.health.serving()]
        self._last_refit = {"outcome": "running", "from_version": self.health.current_version, "version": None,
                            "started_at": time.time(), "ended_at": None, "duration_s": None}
        exporting = self.weights.exporting
        if exporting is not None and not exporting.done():
            exporting.cancel()  # an export must not race the refit's load
        await self._persist()  # a restarted fleet keeps the bracket (and so does not resume a paused load)
        return self._view()

    async def end_refit(self, version: str | None = None, path: str | None = None,
                        timings: dict[str, Any] | None = None) -> FleetView:
        """End the bracket. ``version``: the refit committed it on every member (``path``: the
        checkpoint directory it came from, if any); None: nothing changed. ``timings``: the refit
        report's staging and stall fields (:data:`REFIT_TIMINGS`), shown in ``last_refit``."""
        await self._adopt_inherited_engines()
        before = self.health.epoch
        if version is not None and version != self.health.current_version:
            self.weights = WeightsRecord(version=version, path=path)
        if self.health.refitting:
            self._record_refit_end(version, timings)
        self.health.end_refit(version)
        await self._persist()  # the committed version, read back by a restarted fleet
        if self.weights.path is None and self.weights.ref is None and self.config.fleet.keep_weights_copy:
            self._start_export()
        await self._publish(before)
        return self._view()

    def _record_refit_end(self, version: str | None, timings: dict[str, Any] | None = None) -> None:
        """``committed`` (the bracket ended on a new version) or ``not_committed`` (the refit failed or
        was abandoned: nothing changed); ``lease_expired`` when the fleet ended it for a lost controller."""
        last = self._last_refit or {"from_version": None, "started_at": None}
        now = time.time()
        expired = time.monotonic() > self._refit_deadline
        outcome = "committed" if version is not None else ("lease_expired" if expired else "not_committed")
        self._refits["committed" if version is not None else "not_committed"] += 1
        started = last.get("started_at")
        self._last_refit = {**last, "outcome": outcome, "version": version, "ended_at": now,
                            "duration_s": round(now - started, 3) if started else None,
                            **{k: (timings or {}).get(k) for k in REFIT_TIMINGS}}

    async def _end_bracket_past_its_lease(self) -> None:
        """The monitor's check: a bracket its controller did not end within the lease is ended here."""
        if self.health.refitting and time.monotonic() > self._refit_deadline:
            logger.warning("refit bracket not ended within its lease: ending it (no version change)")
            await self.end_refit(None)

    async def loaded_members(self) -> tuple[Member, ...]:
        """The engines a restarted refit controller brings back to one version: the serving ones,
        and while a refit bracket is open, every live engine the bracket's refit ran over (a
        restarted fleet keeps those that carry a label it never recorded out of the serving set,
        STALE). Other STALE engines (a replacement still reloading) are the fleet's own business."""
        await self._adopt_inherited_engines()
        members = set(self.health.serving())
        if self.health.refitting:
            members |= {slot for slot, generation in self._refit_members
                        if self.health.slots[slot].generation == generation
                        and self.health.slots[slot].state in (*SERVING, EngineState.STALE)}
        return tuple(Member(i, self.slots[i].generation, self.slots[i].actor, self.slots[i].load, self.slots[i].channel)
                     for i in sorted(members) if self.slots[i].actor is not None)


    # ------------------------------------------------------------------ the durable record
    def _ledger_record(self) -> dict[str, Any]:
        refit = None
        if self.health.refitting:  # lease_until None: no lease (a bracket ended only by end_refit)
            left = self._refit_deadline - time.monotonic()
            refit = {"lease_until": time.time() + left if left != float("inf") else None,
                     "members": [list(m) for m in self._refit_members]}
        w = self.weights
        return {"version": self.health.current_version,
                "path": w.path if w.version == self.health.current_version else None,
                "apps": sorted(self._apps), "refit": refit, "last_refit": self._last_refit,
                "refits": dict(self._refits), "incarnation": self.incarnation,
                "versions": list(self.health.versions)}

    async def _persist(self) -> None:
        """Write the durable record (see rollout_service.fleet.ledger) after each change to it."""
        await self.ledger.write(self._ledger_record())
