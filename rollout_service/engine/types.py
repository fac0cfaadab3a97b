"""What crosses the engine's boundary: a generation request, its streamed chunks, the channel's
address, and the errors by which a call learns its engine is gone or refused it.

The engine actor, its data channel and the fleet's client all import these; none of them imports
another for its types.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field, replace

from rollout_service.engine.sampling import SamplingOptions


@dataclass
class GenerateRequest:
    prompt_ids: list[int]
    sampling: SamplingOptions
    max_tokens: int
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    # A streamed call's batch window for this request (None: the engine's stream_batch_window_s): a
    # call whose client wants one answer streams at a long window, so progress exists if its engine dies.
    batch_window_s: float | None = None
    # The rollout the call belongs to (None: a stateless call): the engine aborts a rollout's
    # requests by it (``abort_rollout``: the trainer aborted the rollout).
    rollout_id: str | None = None


@dataclass
class GenerationChunk:
    """A streamed piece of one generation. ``weight_versions``: the spans over every id generated
    so far, this chunk's included — on the final chunk always, on the others where the engine
    tracks it (a call that must continue on another engine carries them over exactly).
    ``migrations``: how many times the call moved to another engine mid-generation (set by the
    fleet's client)."""

    token_ids: list[int]
    logprobs: list[float]  # processed logprob of each sampled id
    top_logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    weight_version: str | None = None  # engine's version when this chunk was produced
    weight_versions: list[tuple[str, int, int]] | None = None  # (version, start, end) over generated ids
    num_prompt_tokens: int = 0
    engine_index: int = 0
    num_cached_tokens: int | None = None  # prompt tokens served from the prefix cache (final chunk)
    migrations: int = 0
    # Positions (generated-id offsets, over every id so far, with ``weight_versions``) from which the
    # request's whole KV cache had been recomputed: at a refit that cleared the cache
    # (``refit.clear_cache``) and at a migration's seam. Position 0 is implied. None: no such record.
    kv_resets: list[int] | None = None
    # The version whose weights computed the prompt's KV (the engine's version when the request
    # started; None: the first id's version).
    kv_base: str | None = None
    # vLLM's prompt logprobs when asked (on the first chunk): per prompt position None (the first) or
    # [(token id, raw logprob, rank), ...], the prompt's own token first, then the top ones by rank.
    prompt_logprobs: list[list[tuple[int, float, int]] | None] | None = None

    @staticmethod
    def concat(chunks: list["GenerationChunk"]) -> "GenerationChunk":
        """Consecutive chunks of one generation as one: tokens in order, the rest from the last."""
        last = chunks[-1]
        return replace(
            last,
            token_ids=[t for c in chunks for t in c.token_ids],
            logprobs=[lp for c in chunks for lp in c.logprobs],
            top_logprobs=None if last.top_logprobs is None else [d for c in chunks for d in c.top_logprobs or ()],
            prompt_logprobs=next((c.prompt_logprobs for c in chunks if c.prompt_logprobs is not None), None),
        )


@dataclass(frozen=True)
class Processing:
    """A sampler's processing of the logits (vLLM's order: temperature, min-p, top-k, top-p), for a
    score computed over the whole vocabulary. ``tolerance``: a top-p decision closer than this to p
    is left undecided (None)."""

    temperature: float
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    tolerance: float = 0.0


@dataclass
class ScoreRequest:
    """Teacher forcing: the logprob of each of ``token_ids[start:]`` given the ids before it, from one
    prefill (no sampling; the prefix cache is not read). ``num_top``: also the ``num_top`` highest
    logprobs at each of those positions (descending). All raw (the model's log-softmax, before
    temperature, top-k or top-p): the caller derives the processed value it needs. ``processing``:
    also each token's logprob after that processing, computed by the engine's worker over the whole
    vocabulary (what a few top logprobs cannot give: a temperature's normaliser, a top-p or min-p
    over every token)."""

    token_ids: list[int]
    start: int
    num_top: int = 0
    processing: Processing | None = None
    request_id: str = field(default_factory=lambda: "score-" + uuid.uuid4().hex)


@dataclass
class ScoreResult:
    """What :class:`ScoreRequest` asked for. ``weight_version``: the engine's label when the prefill was
    queued and when it ended, or ``None`` when a relabel (a refit) came between them. ``logprobs[i]``
    and ``ranks[i]`` (1 = the most likely) are those of ``token_ids[start + i]``; fewer than asked
    when the context had no room (``max_model_len``) for all of them. ``supported``: False when the
    engine cannot score (the simulated engine), everything else empty."""

    weight_version: str | None
    logprobs: list[float] = field(default_factory=list)
    ranks: list[int] = field(default_factory=list)
    top_logprobs: list[list[float]] | None = None
    processed: list[float | None] | None = None  # with ScoreRequest.processing: one per scored token
    whole_vocabulary: bool = True  # False: this engine cannot compute ScoreRequest.processing (nothing else set)
    engine_index: int = 0
    supported: bool = True


ABORT_MEMORY_S = 600.0  # how long an engine remembers an aborted rollout (abort_rollout)


def spans_up_to(spans, n: int) -> list[tuple[str, int, int]]:
    """``(version, start, end)`` spans cut to the first ``n`` generated ids."""
    return [(v, s, min(e, n)) for v, s, e in spans if s < n]


def kv_spans(spans, resets, base: str | None = None) -> list[tuple[str, int, int, str]]:
    """``(version, start, end, kv_version)``: each span of sampling versions with the oldest version
    whose KV its ids attended to. The prompt's KV is ``base``'s (``GenerationChunk.kv_base``; None:
    the first id's version); at every reset position (``GenerationChunk.kv_resets``) the whole KV was
    recomputed, by the weights of the id sampled there; in between, a refit that kept the KV adds
    newer weights over the older KV, so the KV version stays the one of the last reset (or the
    base). Spans are split at resets inside them."""
    cuts = {int(r) for r in resets or ()}
    out: list[tuple[str, int, int, str]] = []
    kv: str | None = base
    for v, s, e in spans:
        points = [s, *sorted(c for c in cuts if s < c < e), e]
        for a, b in zip(points, points[1:]):
            if kv is None or a in cuts:
                kv = v
            if out and out[-1][0] == v and out[-1][3] == kv and out[-1][2] == a:
                out[-1] = (v, out[-1][1], b, kv)
            elif b > a:
                out.append((v, a, b, kv))
    return out


class EngineUnavailable(RuntimeError):
    """The engine is not started, shutting down, or dead."""


@dataclass(frozen=True)
class ChannelAddress:
    host: str
    port: int
    token: str

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


class EngineLost(ConnectionError):
    """The engine's channel could not be opened or was lost: the engine is gone or unreachable."""


class EngineCallError(RuntimeError):
    """The engine raised while serving the call; ``cause`` is the error as the data plane handles it."""

    def __init__(self, message: str, cause: BaseException):
        super().__init__(message)
        self.cause = cause
