"""How far a recompute is from the logprobs tokens were sampled with: the statistics the service's
parity canary reports (``GET /v1/status`` ``canary``, :mod:`rollout_service.canary`) and a trainer
computes from its own forward pass (:func:`rows_parity`), so the two can be read side by side.

Per token, |Δ| = |recomputed logprob − behaviour logprob|, capped at :data:`DIFF_CAP` (a token the
recompute gives no probability at all counts as the cap, and as ``dropped``; a recompute of None,
a position whose recompute is ambiguous, is left out and counted as ``ambiguous``). Over a set of
tokens:

- ``max_abs_diff``, ``mean_abs_diff``;
- ``token_mult_prob_error``: the mean over tokens of exp(|Δ|), NeMo RL's ``token_mult_prob_error``
  (``masked_mean(exp(|generation_logprobs − prev_logprobs|))`` in its loss functions): 1.0 when the
  two agree, 1.01 a 1 % average probability error;
- ``share_above``: the share of tokens with |Δ| above ``threshold``.

Pure Python (no torch): what a trainer imports.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Iterable, Mapping, Sequence

from rollout_service.training.rows import TrainingRow

DIFF_CAP = 10.0  # |Δ| of a token the recompute gives probability 0 (or a NaN): counted, not infinite
DEFAULT_THRESHOLD = 1e-3


@dataclass
class ParityStats:
    """Sums over tokens (and turns), so that stats of disjoint sets merge exactly (:meth:`merge`)."""

    turns: int = 0
    tokens: int = 0
    sum_abs: float = 0.0
    max_abs: float = 0.0
    sum_exp_abs: float = 0.0
    above: int = 0
    dropped: int = 0
    ambiguous: int = 0
    threshold: float = DEFAULT_THRESHOLD

    def add(self, behaviour: Sequence[float], recomputed: Sequence[float | None]) -> "ParityStats":
        """Count one turn's tokens (pairs up to the shorter sequence); returns the turn's own stats."""
        turn = ParityStats(turns=1, threshold=self.threshold)
        for b, r in zip(behaviour, recomputed):
            if r is None:
                turn.ambiguous += 1
                continue
            d = abs(r - b)
            if not math.isfinite(d):
                d = DIFF_CAP
                turn.dropped += 1
            d = min(d, DIFF_CAP)
            turn.tokens += 1
            turn.sum_abs += d
            turn.max_abs = max(turn.max_abs, d)
            turn.sum_exp_abs += math.exp(d)
            turn.above += d > self.threshold
        self.merge(turn)
        return turn

    def merge(self, other: "ParityStats") -> "ParityStats":
        self.turns += other.turns
        self.tokens += other.tokens
        self.sum_abs += other.sum_abs
        self.max_abs = max(self.max_abs, other.max_abs)
        self.sum_exp_abs += other.sum_exp_abs
        self.above += other.above
        self.dropped += other.dropped
        self.ambiguous += other.ambiguous
        return self

    @property
    def mean_abs(self) -> float | None:
        return self.sum_abs / self.tokens if self.tokens else None

    @property
    def token_mult_prob_error(self) -> float | None:
        return self.sum_exp_abs / self.tokens if self.tokens else None

    @property
    def share_above(self) -> float | None:
        return self.above / self.tokens if self.tokens else None

    def summary(self) -> dict[str, Any]:
        """The reported figures (None where no token was compared)."""
        return {"turns": self.turns, "tokens": self.tokens, "max_abs_diff": self.max_abs if self.tokens else None,
                "mean_abs_diff": self.mean_abs, "token_mult_prob_error": self.token_mult_prob_error,
                "share_above_threshold": self.share_above, "threshold": self.threshold, "dropped": self.dropped,
                "ambiguous": self.ambiguous}

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "ParityStats":
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})


def merged(stats: Iterable[ParityStats], threshold: float = DEFAULT_THRESHOLD) -> ParityStats:
    out = ParityStats(threshold=threshold)
    for s in stats:
        out.merge(s)
    return out


def rows_parity(rows: Sequence[TrainingRow], trainer_logprobs: Sequence[Sequence[float]], *,
                threshold: float = DEFAULT_THRESHOLD, include_constrained: bool = False) -> dict[str, ParityStats]:
    """The trainer-side twin of the service's canary: per behaviour weight version, the trainer's own
    recompute (``trainer_logprobs[k][i]``: its logprob of ``rows[k].input_ids[i]`` given the ids before
    it, under the sampling's temperature / top-k / top-p, i.e. the processed semantics the service
    returns) against the logprobs each generated token was sampled with. Compare a version's entry
    with the canary's ``by_engine`` entries of that version: the trainer holds that version's weights
    only right after it refitted them, so recompute before the optimizer step. Each turn of a row
    counts as one turn; constrained turns (renormalized over a grammar) are left out unless asked."""
    out: dict[str, ParityStats] = {}
    for k, row in enumerate(rows):
        for bounds in row.turns:
            if bounds.constrained and not include_constrained:
                continue
            by_version: dict[str, tuple[list[float], list[float]]] = {}
            for i in range(bounds.gen_start, bounds.gen_end):
                if not row.loss_mask[i] and not bounds.constrained:
                    continue
                version = row.versions[i]
                pair = by_version.setdefault(version if version is not None else "unknown", ([], []))
                pair[0].append(row.behaviour_logprobs[i])
                pair[1].append(trainer_logprobs[k][i])
            for version, (behaviour, recomputed) in by_version.items():
                out.setdefault(version, ParityStats(threshold=threshold)).add(behaviour, recomputed)
    return out
