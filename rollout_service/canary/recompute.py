"""The processed logprob of a sampled token, recomputed from an engine's raw teacher-forced scores.

The engine returns, for a turn, the *processed* logprob of each token it sampled: the log-softmax
of the logits after temperature, top-k and top-p (vLLM's ``processed_logprobs``, the parity
default). A teacher-forced prefill gives *raw* logprobs r (the log-softmax of the logits, before
any sampling processor). Since softmax ignores a constant shift, r / T stands for logits / T, and
vLLM's processing can be replayed from r wherever the set of tokens it keeps is known:

- greedy (T < vLLM's 1e-5) or T = 1 without top-k / top-p: processed = raw, one value per position;
- top-k = k (any T, any top-p): the k highest raw logprobs are the kept set; scaled by 1 / T, then
  top-p applied on their softmax as vLLM does (a token is dropped once the probability of the
  tokens above it reaches p; the first is always kept); processed = r_x / T − logsumexp(kept);
- T = 1 with top-p and no top-k: the same with the engine's ``max_logprobs`` highest, when their
  probabilities reach p (the nucleus lies inside them); otherwise it cannot be known.

Everything else cannot be recomputed from scores the engine can return without its whole
vocabulary at every position, and is skipped with a reason (:data:`SKIP_REASONS`): a temperature
≠ 1 without top-k (the normalizer needs every logit), min-p, repetition / presence / frequency
penalties (they change logits by the history), structured outputs (a grammar masks the logits).

Pure Python: no vLLM, no torch.
"""

from __future__ import annotations

import math
from typing import Sequence

GREEDY_EPS = 1e-5  # vLLM's _SAMPLING_EPS: a temperature below it samples greedily

# Why a drawn generation was not compared (GET /v1/status canary.skipped, the skipped metric's label).
SKIP_REASONS = (
    "queue_full", "structured_output", "penalties", "min_p", "temperature_without_top_k", "greedy_with_truncation",
    "top_k_above_limit", "nucleus_beyond_top_k", "version_moved", "migrated", "no_engine", "engine_cannot_score",
    "score_failed", "score_timeout", "empty",
)


def plan(sampling, max_top: int) -> int | str:
    """How many raw top logprobs per position the recompute of a generation sampled with ``sampling``
    (:class:`~rollout_service.engine.sampling.SamplingOptions`) needs, or the reason it cannot be
    recomputed. ``max_top``: the most the engine returns (its ``max_logprobs``)."""
    if sampling.structured_outputs:
        return "structured_output"
    if sampling.presence_penalty or sampling.frequency_penalty or sampling.repetition_penalty != 1.0:
        return "penalties"
    if sampling.min_p > 0:
        return "min_p"
    top_k = sampling.top_k if sampling.top_k > 0 else 0
    if sampling.temperature < GREEDY_EPS:
        # vLLM scores a greedy row with top-k / top-p applied in a mixed batch and without them in an
        # all-greedy one: which one it was is not known afterwards.
        return "greedy_with_truncation" if top_k or sampling.top_p < 1.0 else 0
    if top_k:
        return top_k if top_k <= max_top else "top_k_above_limit"
    if sampling.temperature != 1.0:
        return "temperature_without_top_k"
    if sampling.top_p < 1.0:
        return max_top if max_top > 0 else "nucleus_beyond_top_k"
    return 0


def processed(sampling, logprobs: Sequence[float], ranks: Sequence[int],
              tops: Sequence[Sequence[float]] | None) -> list[float] | str:
    """The processed logprob of each scored token (``logprobs`` raw, ``ranks`` 1-based, ``tops`` the
    raw top logprobs per position, descending, as :func:`plan` asked), or the skip reason. A token the
    processing would have dropped gets -inf (it could not have been sampled)."""
    top_k = sampling.top_k if sampling.top_k > 0 else 0
    t, p = sampling.temperature, sampling.top_p
    if t < GREEDY_EPS or (t == 1.0 and not top_k and p >= 1.0):
        return [float(x) for x in logprobs]
    if tops is None:
        raise ValueError("the recompute of this sampling needs the top logprobs per position")
    out: list[float] = []
    for lp, rank, top in zip(logprobs, ranks, tops):
        if top_k:
            scaled = [x / t for x in top[:top_k]]
            kept = _nucleus(scaled, p, normalized=False) if p < 1.0 else len(scaled)
        else:  # T = 1: the raw top logprobs are the probabilities themselves
            if sum(math.exp(x) for x in top) < p:
                return "nucleus_beyond_top_k"
            scaled = list(top)
            kept = _nucleus(scaled, p, normalized=True)
        if rank > kept:
            out.append(-math.inf)
            continue
        out.append(lp / (t if top_k else 1.0) - _logsumexp(scaled[:kept]))
    return out


def _nucleus(scaled: Sequence[float], p: float, *, normalized: bool) -> int:
    """How many of ``scaled`` (descending log-weights) vLLM's top-p keeps: token i goes once the
    probability of the tokens before it reaches p (vLLM masks where the ascending cumulative sum is
    ≤ 1 − p); at least one stays. ``normalized``: the weights are already log-probabilities over the
    whole vocabulary (else they are normalized over themselves)."""
    z = 0.0 if normalized else _logsumexp(scaled)
    before = 0.0
    for i, x in enumerate(scaled):
        if i and before >= p:
            return i
        before += math.exp(x - z)
    return len(scaled)


def _logsumexp(xs: Sequence[float]) -> float:
    m = max(xs)
    return m + math.log(sum(math.exp(x - m) for x in xs))
