"""The processed logprob of a sampled token, recomputed from an engine's raw teacher-forced scores.

The engine returns, for a turn, the *processed* logprob of each token it sampled: the log-softmax
of the logits after temperature, top-k and top-p (vLLM's ``processed_logprobs``, the parity
default). A teacher-forced prefill gives *raw* logprobs r (the log-softmax of the logits, before
any sampling processor). Since softmax ignores a constant shift, r / T stands for logits / T, and
vLLM's processing can be replayed from r wherever the set of tokens it keeps is known:

- greedy (T < vLLM's 1e-5) or T = 1 without top-k / top-p: processed = raw, one value per position;
- top-k = k (any T, any top-p, no min-p): the k highest raw logprobs are the kept set; scaled by
  1 / T, then top-p applied on their softmax as vLLM does (a token is dropped once the probability
  of the tokens above it reaches p; the first is always kept); processed = r_x / T − logsumexp(kept);
- everything else the sampler does without looking at the history (a temperature ≠ 1 without top-k,
  top-p or min-p over the vocabulary, a top-k above the engine's ``max_logprobs``) needs every logit
  at every position: the engine's worker computes it where the logits are
  (:data:`WHOLE_VOCABULARY`, ``ScoreRequest.processing``).

What cannot be replayed from the logits alone is skipped with a reason (:data:`SKIP_REASONS`):
repetition / presence / frequency penalties (they change logits by the history), structured outputs
(a grammar masks the logits), a temperature in (0, 1e-5).

Pure Python: no vLLM, no torch.
"""

from __future__ import annotations

import math
from typing import Sequence

GREEDY_EPS = 1e-5  # vLLM's _SAMPLING_EPS: a temperature below it samples greedily
# A top-p decision closer than this (in probability) to p is left out of the comparison: vLLM decides it
# in float32 over the decode step's logits (on a GPU in a Triton pivot search), the recompute in
# float64 over the prefill's, and the two may fall on different sides.
NUCLEUS_TOLERANCE = 1e-4
# The same over the whole vocabulary: the worker decides in float32 as vLLM does, with vLLM's own function,
# so only the prefill's logits differ from the decode step's (~1e-6 here).
WHOLE_TOLERANCE = 1e-6

# Why a drawn generation was not compared (GET /v1/status canary.skipped, the skipped metric's label).
SKIP_REASONS = (
    "queue_full", "structured_output", "penalties", "tiny_temperature", "logits_mode", "too_long",
    "version_moved", "migrated", "no_engine", "engine_cannot_score", "score_failed", "score_timeout", "empty",
    # only where the scoring engines cannot process the whole vocabulary (plan(whole_vocabulary=False)):
    "whole_vocabulary_unavailable", "min_p", "temperature_without_top_k", "top_k_above_limit", "nucleus_beyond_top_k",
)
WHOLE_VOCABULARY = -1  # plan(): the engine computes the processed logprobs over the whole vocabulary
LOGPROB_MODES = ("processed_logprobs", "raw_logprobs")  # engine.logprobs_mode values that return logprobs


def plan(sampling, max_top: int, logprobs_mode: str = "processed_logprobs", whole_vocabulary: bool = True) -> int | str:
    """How many raw top logprobs per position the recompute of a generation sampled with ``sampling``
    (:class:`~rollout_service.engine.sampling.SamplingOptions`) needs, :data:`WHOLE_VOCABULARY` when
    the engine must process the whole vocabulary itself, or the reason it cannot be recomputed.
    ``max_top``: the most the engine returns (its ``max_logprobs``); top-k = k asks for k + 1 where it
    can, to see a tie at the cut. ``logprobs_mode``: the engine's (in a logits mode it returns logits,
    and its prompt scores are logits too: nothing to compare). ``whole_vocabulary``: False where the
    scoring engines cannot process the whole vocabulary (vLLM's Model Runner V2): then only what the
    top logprobs give is compared (T = 1 with top-p where the nucleus lies inside them)."""
    if logprobs_mode not in LOGPROB_MODES:
        return "logits_mode"
    if sampling.structured_outputs:
        return "structured_output"
    if sampling.presence_penalty or sampling.frequency_penalty or sampling.repetition_penalty != 1.0:
        return "penalties"
    if sampling.temperature < GREEDY_EPS:
        # vLLM turns top-k / top-p / min-p off for greedy sampling (SamplingParams.__post_init__), so its
        # processed logprob is the raw one; a temperature in (0, 1e-5) is divided by in Model Runner V2.
        return 0 if sampling.temperature == 0 else "tiny_temperature"
    top_k = sampling.top_k if sampling.top_k > 0 else 0
    if top_k and sampling.min_p == 0 and top_k <= max_top:
        return min(top_k + 1, max_top)
    if whole_vocabulary and (top_k or sampling.min_p > 0 or sampling.temperature != 1.0 or sampling.top_p < 1.0):
        return WHOLE_VOCABULARY
    if sampling.min_p > 0:
        return "min_p"
    if top_k:
        return "top_k_above_limit"
    if sampling.temperature != 1.0:
        return "temperature_without_top_k"
    if sampling.top_p < 1.0:
        return max_top if max_top > 0 else "nucleus_beyond_top_k"
    return 0


def processed(sampling, logprobs: Sequence[float], tops: Sequence[Sequence[float]] | None) -> list[float | None] | str:
    """The processed logprob of each scored token (``logprobs`` raw, ``tops`` the raw top logprobs per
    position, descending, as :func:`plan` asked), or the skip reason. A token the processing drops
    gets -inf (it could not have been sampled); a position whose kept set cannot be known for sure (a
    tie at the top-k cut, a top-p decision within :data:`NUCLEUS_TOLERANCE` of p) gets None."""
    top_k = sampling.top_k if sampling.top_k > 0 else 0
    t, p = sampling.temperature, sampling.top_p
    if t < GREEDY_EPS or (t == 1.0 and not top_k and p >= 1.0 and sampling.min_p == 0):
        return [float(x) for x in logprobs]
    if tops is None:
        raise ValueError("the recompute of this sampling needs the top logprobs per position")
    out: list[float | None] = []
    for lp, top in zip(logprobs, tops):
        if top_k:
            if len(top) > top_k and top[top_k] == top[top_k - 1]:
                out.append(None)  # a tie at the cut: vLLM's CPU path keeps both, its GPU path one of them
                continue
            scaled = [x / t for x in top[:top_k]]
            z = _logsumexp(scaled)
            kept = len(scaled) if p >= 1.0 else _nucleus([x - z for x in scaled], p)
            me = lp / t
        else:  # T = 1 (plan(whole_vocabulary=False)): the raw top logprobs are the probabilities themselves
            if sum(math.exp(x) for x in top) < p + NUCLEUS_TOLERANCE:
                return "nucleus_beyond_top_k"
            scaled, me = list(top), lp
            kept = _nucleus(scaled, p)
        if kept is None:
            out.append(None)
            continue
        if me < scaled[kept - 1]:  # below the last kept value: dropped
            out.append(-math.inf)
            continue
        out.append(me - _logsumexp(scaled[:kept]))
    return out


def _nucleus(logprobs: Sequence[float], p: float) -> int | None:
    """How many of ``logprobs`` (descending, normalized) vLLM's top-p keeps: token i goes once the
    probability of the tokens before it reaches p (vLLM masks where the ascending cumulative sum is
    ≤ 1 − p); at least one stays. None when that decision is within NUCLEUS_TOLERANCE of p."""
    before = 0.0
    for i, x in enumerate(logprobs):
        if i and abs(before - p) < NUCLEUS_TOLERANCE:
            return None
        if i and before >= p:
            return i
        before += math.exp(x)
    return len(logprobs)


def _logsumexp(xs: Sequence[float]) -> float:
    m = max(xs)
    return m + math.log(sum(math.exp(x - m) for x in xs))
