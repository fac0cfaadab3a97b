"""The canary's figures: per engine slot and weight version, and the skips by reason.

Each replica keeps its own :class:`CanaryStats` and sends :meth:`CanaryStats.report` (sums, so that
they merge exactly) to the fleet; ``GET /v1/status`` merges every replica's last report with
:func:`status_of`. A report is cumulative since the replica started, so a report lost, or a fleet
restarted (it keeps reports in memory), is made whole by the replica's next one.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any, Iterable, Mapping

from rollout_service.training.parity import DEFAULT_THRESHOLD, ParityStats

MAX_ENTRIES = 512  # (slot, version) entries a replica keeps; the oldest merge into (slot, "older")
OLDER = "older"


class CanaryStats:
    def __init__(self, threshold: float = DEFAULT_THRESHOLD):
        self.threshold = threshold
        self.entries: dict[tuple[int, str], dict[str, Any]] = {}
        self.skipped: Counter[str] = Counter()
        # Tokens sampled by a version over KV an older one computed (a refit that kept the cache):
        # compared against the sampling version's weights, expected off, kept out of every other figure.
        self.mixed = ParityStats(threshold=threshold)
        self.changes = 0  # bumped by every record: a reporter sends only when it moved

    def skip(self, reason: str) -> None:
        self.skipped[reason] += 1
        self.changes += 1

    def add(self, slot: int, version: str, scored_on: int, behaviour, recomputed) -> ParityStats:
        """Count one checked generation; returns its own figures."""
        entry = self.entries.get((slot, version))
        if entry is None:
            entry = self.entries[(slot, version)] = {"stats": ParityStats(threshold=self.threshold), "scored_on": Counter()}
            self._prune()
        entry["scored_on"][scored_on] += 1
        entry["last_seen"] = time.time()
        self.changes += 1
        return entry["stats"].add(behaviour, recomputed)

    def add_mixed(self, behaviour, recomputed) -> ParityStats:
        """Count the mixed tokens of one generation (see ``mixed``)."""
        self.changes += 1
        return self.mixed.add(behaviour, recomputed)

    def _prune(self) -> None:
        while len(self.entries) > MAX_ENTRIES:
            (slot, version), old = next(iter(self.entries.items()))
            del self.entries[(slot, version)]
            into = self.entries.setdefault((slot, OLDER), {"stats": ParityStats(threshold=self.threshold),
                                                           "scored_on": Counter(), "last_seen": 0.0})
            into["stats"].merge(old["stats"])
            into["scored_on"].update(old["scored_on"])
            into["last_seen"] = max(into["last_seen"], old.get("last_seen", 0.0))

    def report(self) -> dict[str, Any]:
        """JSON-able sums (what a replica sends to the fleet). ``seq`` grows with every record: the fleet
        keeps a replica's report with the highest (a late, older one does not replace a newer one)."""
        return {"seq": self.changes, "threshold": self.threshold, "skipped": dict(self.skipped),
                "mixed": self.mixed.to_dict(),
                "entries": [{"slot": slot, "weight_version": version, "stats": e["stats"].to_dict(),
                             "scored_on": {str(k): v for k, v in e["scored_on"].items()},
                             "last_seen": e.get("last_seen", 0.0)}
                            for (slot, version), e in self.entries.items()]}


def status_of(reports: Iterable[Mapping[str, Any]], *, enabled: bool, sample_fraction: float,
              threshold: float = DEFAULT_THRESHOLD) -> dict[str, Any]:
    """``GET /v1/status``'s ``canary``: every replica's report merged. ``checked``: generations compared;
    ``skipped``: drawn but not compared, by reason; the figures over every compared token; ``by_engine``:
    per (slot, weight version) of the engine that sampled (``scored_on``: which slots re-scored them),
    each slot's entries in the order they were last checked (``last_checked_at``, Unix seconds);
    ``mixed``: the tokens sampled over KV an older version computed, against the sampling version's
    weights (expected off; in no other figure)."""
    total = ParityStats(threshold=threshold)
    mixed = ParityStats(threshold=threshold)
    skipped: Counter[str] = Counter()
    merged: dict[tuple[int, str], dict[str, Any]] = {}
    for report in reports:
        skipped.update(report.get("skipped") or {})
        if report.get("mixed"):
            mixed.merge(ParityStats.from_dict(report["mixed"]))
        for e in report.get("entries") or ():
            stats = ParityStats.from_dict(e["stats"])
            total.merge(stats)
            m = merged.setdefault((int(e["slot"]), str(e["weight_version"])),
                                  {"stats": ParityStats(threshold=stats.threshold), "scored_on": Counter(),
                                   "last_seen": 0.0})
            m["stats"].merge(stats)
            m["last_seen"] = max(m["last_seen"], float(e.get("last_seen") or 0.0))
            m["scored_on"].update({int(k): v for k, v in (e.get("scored_on") or {}).items()})
    summary, mixed_summary = total.summary(), mixed.summary()
    by_engine = []
    for (slot, version), m in sorted(merged.items(), key=lambda kv: (kv[0][0], kv[1]["last_seen"])):
        s = m["stats"].summary()
        by_engine.append({"slot": slot, "weight_version": version, "checked": s["turns"], "tokens": s["tokens"],
                          "max_abs_diff": s["max_abs_diff"], "mean_abs_diff": s["mean_abs_diff"],
                          "token_mult_prob_error": s["token_mult_prob_error"],
                          "share_above_threshold": s["share_above_threshold"], "dropped": s["dropped"],
                          "ambiguous": s["ambiguous"],
                          "scored_on": {str(k): v for k, v in sorted(m["scored_on"].items())},
                          "last_checked_at": m["last_seen"] or None})
    return {"enabled": enabled, "sample_fraction": sample_fraction, "threshold": threshold,
            "checked": summary["turns"], "skipped": dict(sorted(skipped.items())), "tokens": summary["tokens"],
            "max_abs_diff": summary["max_abs_diff"], "mean_abs_diff": summary["mean_abs_diff"],
            "token_mult_prob_error": summary["token_mult_prob_error"],
            "share_above_threshold": summary["share_above_threshold"], "dropped": summary["dropped"],
            "ambiguous": summary["ambiguous"], "by_engine": by_engine,
            "mixed": {"checked": mixed_summary["turns"], "tokens": mixed_summary["tokens"],
                      "max_abs_diff": mixed_summary["max_abs_diff"], "mean_abs_diff": mixed_summary["mean_abs_diff"],
                      "share_above_threshold": mixed_summary["share_above_threshold"]}}
