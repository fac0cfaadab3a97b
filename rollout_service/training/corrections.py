"""Token-level corrections for a train/inference mismatch, from the service's behaviour logprobs and
the trainer's own recompute of the same ids (docs/training.md, "Mismatch corrections").

Per trained token, ``rho = exp(trainer_logprob - behaviour_logprob)``: the trainer's probability of
the token over the probability it was sampled with. On exact ids, processed logprobs and the same
weights rho is 1 up to float32 noise; a mismatch (raw logprobs, another kernel, a token sampled
across a refit) moves it. Each method turns rho into a per-token weight the policy-gradient loss
multiplies by (detached):

- ``tis``: truncated importance sampling (Yao et al., 2025, "Your efficient RL framework secretly
  brings you off-policy RL training"): ``min(rho, cap)``. Counted: tokens with ``rho > cap`` (clipped).
- ``mis``: masked importance sampling (Liu et al., 2025, "When speed kills stability"): ``rho`` where
  ``rho <= cap``, 0 beyond. Counted: tokens masked.
- ``icepop``: IcePop (Ling team, 2025): ``rho`` inside ``[low, high]``, 0 outside (both sides
  masked). Counted: tokens masked.

Only positions with ``loss_mask`` 1 get a weight other than 0 and count in the share.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from rollout_service.training.rows import TrainingRow

METHODS = ("tis", "mis", "icepop")


@dataclass(frozen=True)
class Correction:
    """Which correction and its bounds (the defaults are the papers')."""

    method: str = "tis"
    cap: float = 2.0  # tis: truncation; mis: the mask's upper bound
    low: float = 0.5  # icepop
    high: float = 5.0  # icepop

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"unknown correction {self.method!r} (one of {', '.join(METHODS)})")
        if not (self.cap > 0 and 0 <= self.low < self.high):
            raise ValueError(f"bad bounds: cap={self.cap}, low={self.low}, high={self.high}")

    def weight(self, rho: float) -> tuple[float, bool]:
        """(weight, whether this token was clipped or masked)."""
        if self.method == "tis":
            return (self.cap, True) if rho > self.cap else (rho, False)
        if self.method == "mis":
            return (0.0, True) if rho > self.cap else (rho, False)
        return (rho, False) if self.low <= rho <= self.high else (0.0, True)


@dataclass
class CorrectionWeights:
    weights: list[list[float]]  # per row, per position (0 off the loss mask)
    affected: int  # trained tokens clipped (tis) or masked (mis, icepop)
    tokens: int  # trained tokens

    @property
    def share(self) -> float:
        """Share of trained tokens clipped or masked (NaN with no trained token)."""
        return self.affected / self.tokens if self.tokens else float("nan")


def correction_weights(rows: Sequence[TrainingRow], trainer_logprobs: Sequence[Sequence[float]],
                       correction: Correction | str = "tis") -> CorrectionWeights:
    """Per-token weights of ``correction`` for ``rows``; ``trainer_logprobs[k][i]``: the trainer's
    logprob of ``rows[k].input_ids[i]`` given the ids before it (the weights before its step)."""
    corr = Correction(correction) if isinstance(correction, str) else correction
    out: list[list[float]] = []
    affected = tokens = 0
    for k, row in enumerate(rows):
        lps = trainer_logprobs[k]
        if len(lps) != len(row):
            raise ValueError(f"rollout {row.rollout_id!r} segment {row.segment}: {len(lps)} trainer logprobs for "
                             f"{len(row)} positions")
        w = [0.0] * len(row)
        for i, m in enumerate(row.loss_mask):
            if not m:
                continue
            rho = math.exp(lps[i] - row.behaviour_logprobs[i])
            w[i], hit = corr.weight(rho)
            affected += hit
            tokens += 1
        out.append(w)
    return CorrectionWeights(out, affected, tokens)


def correction_shares(rows: Sequence[TrainingRow], trainer_logprobs: Sequence[Sequence[float]]) -> dict[str, float]:
    """The share each method (default bounds) would clip or mask on these rows, whichever one the
    loss uses: ``{"tis_clipped": .., "mis_masked": .., "icepop_masked": ..}``."""
    names = {"tis": "tis_clipped", "mis": "mis_masked", "icepop": "icepop_masked"}
    return {names[m]: correction_weights(rows, trainer_logprobs, m).share for m in METHODS}
