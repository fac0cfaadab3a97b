"""What the data plane's replicas report for ``GET /v1/status``: each replica's parity canary
figures (:mod:`rollout_service.canary`) and the rollouts the replicas moved off a live engine
(``routing.policy``: pin moves).

These are the data plane's, not the fleet's: the fleet neither reads nor acts on them. They are
kept in the fleet actor only because it is the one actor every replica already reaches (and the
status page already asks); the fleet composes a :class:`DataPlaneReports` and exposes its three
calls (``report_canary``, ``canary_reports``, ``count_pin_move``) as actor methods. Kept for the
fleet actor's lifetime (a restarted fleet starts with none: the replicas' next reports refill it).
"""

from __future__ import annotations

MAX_CANARY_REPORTS = 256  # data-plane replicas whose parity canary figures are kept (docs/canary.md)


class DataPlaneReports:
    def __init__(self) -> None:
        self.pin_moves = 0  # rollouts the data plane moved off a live engine (routing.policy)
        self._canary: dict[str, dict] = {}  # data-plane replica -> its parity canary's last report

    def count_pin_move(self) -> None:
        """A data-plane process moved a rollout off a live engine (routing.policy)."""
        self.pin_moves += 1

    def report_canary(self, replica: str, report: dict) -> None:
        """A data-plane replica's parity canary figures (cumulative: a report replaces the replica's
        previous one unless it is older, by its ``seq``). The reports of the MAX_CANARY_REPORTS replicas
        heard from last are kept (those of replicas gone since too: their turns were checked)."""
        old = self._canary.pop(replica, None)
        if old is not None and old.get("seq", 0) > report.get("seq", 0):
            report = old
        self._canary[replica] = report
        while len(self._canary) > MAX_CANARY_REPORTS:
            self._canary.pop(next(iter(self._canary)))

    def canary_reports(self) -> list[dict]:
        """The replicas' last canary reports."""
        return list(self._canary.values())
