"""Token in, token out: ``POST /inference/v1/generate``, vLLM 0.32's token-in-token-out dialect.

The client renders its prompt to ids itself (prime-rl's stack: verifiers' train client through
``renderers``) and sends ``{"model", "token_ids", "sampling_params": {...}, "stream"}``. The request is
validated with vLLM's own model (``GenerateRequest``) and answered with vLLM's response models
(``GenerateTokensResponse``, ``GenerateTokensStreamResponse``), so a client of vLLM's route is a client
of this one. What the service adds: with a rollout id (``X-Rollout-Id`` or ``X-Session-ID``) the call
is a recorded turn, continued or forked on its ids (:mod:`rollout_service.onpolicy.tokens`), with
idempotency, processed logprobs and weight-version spans as for every turn.

``sampling_params`` keys the service does not honour are refused by name (vLLM's model would
accept an unknown key and drop it). Request fields for multimodal input, disaggregated serving,
text output and prompt logprobs are refused when set.
"""

from __future__ import annotations

import math
import time
from typing import Any, AsyncIterator

from rollout_service.serve.dialects.common import RolloutHeaders, error_event

error_frame = error_event  # what serve/http.py sends when formatting a stream fails
from rollout_service.serve.protocol.envelope import ServiceError, bad_request
from rollout_service.serve.turn_types import TokenDelta, TurnRequest, TurnResult

ROUTE = "/inference/v1/generate"

# sampling_params keys honoured as vLLM defines them; logprobs and max_tokens are read apart.
PASSED = ("temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "presence_penalty",
          "frequency_penalty", "repetition_penalty", "ignore_eos", "skip_special_tokens", "include_stop_str_in_output")
# Keys whose value changes nothing here (the ids are decoded for the stored message either way, the
# output kind follows ``stream``) when left at what this service does. ``n`` is read apart (the app
# fans it out: serve/fanout.py).
NEUTRAL = {"detokenize": (True, False), "output_kind": None, "routed_experts_prompt_start": None}
# Request fields this service does not serve, with the value that means "not used".
UNSERVED = {"features": None, "content_parts": None, "kv_transfer_params": None, "ec_transfer_params": None,
            "token_offsets": None, "reasoning_ended": None, "reasoning_parser_kwargs": None, "cache_salt": None,
            "priority": 0, "output_mode": "tokens"}


# The request as this service serves it, for the OpenAPI schema (the check is vLLM's model + turn_request).
_SAMPLING_SCHEMA = {
    "type": "object", "additionalProperties": False,
    "properties": {
        "max_tokens": {"type": "integer", "minimum": 1}, "logprobs": {"type": ["integer", "null"], "minimum": 0},
        "temperature": {"type": "number", "minimum": 0}, "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
        "top_k": {"type": "integer", "minimum": -1}, "min_p": {"type": "number", "minimum": 0, "maximum": 1},
        "seed": {"type": ["integer", "null"]}, "stop": {"type": ["array", "null"], "items": {"type": "string"}},
        "stop_token_ids": {"type": ["array", "null"], "items": {"type": "integer", "minimum": 0}},
        "presence_penalty": {"type": "number", "minimum": -2, "maximum": 2},
        "frequency_penalty": {"type": "number", "minimum": -2, "maximum": 2},
        "repetition_penalty": {"type": "number", "exclusiveMinimum": 0},
        "ignore_eos": {"type": "boolean"}, "skip_special_tokens": {"type": "boolean"},
        "include_stop_str_in_output": {"type": "boolean"}, "detokenize": {"type": "boolean"}, "n": {"type": "integer", "minimum": 1},
    },
}
REQUEST_SCHEMA = {
    "type": "object", "required": ["token_ids", "sampling_params"],
    "properties": {
        "token_ids": {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0},
                      "description": "The prompt, as token ids the client rendered."},
        "sampling_params": _SAMPLING_SCHEMA, "model": {"type": ["string", "null"]},
        "request_id": {"type": "string"}, "stream": {"type": ["boolean", "null"]},
        "stream_options": {"type": ["object", "null"], "properties": {
            "include_usage": {"type": ["boolean", "null"]}, "continuous_usage_stats": {"type": ["boolean", "null"]}}},
        "return_token_ids": {"type": ["boolean", "null"]},
    },
}
# Answers are vLLM's models dumped whole, as vLLM's server dumps them (subclassed entries included).
DUMP_OPTIONS: dict[str, Any] = {"serialize_as_any": True}


async def json_body(request) -> Any:
    """The request body as JSON, or the 400 saying why not."""
    import json

    try:
        return json.loads(await request.body())
    except (ValueError, RecursionError) as exc:
        raise bad_request(f"the request body is not JSON: {exc}"[:300]) from None


def _vllm():
    from vllm.entrypoints.scale_out.token_in_token_out import protocol

    return protocol


def _sampling_defaults():
    from vllm.sampling_params import SamplingParams

    return SamplingParams()


def turn_request(raw: Any, headers: RolloutHeaders, request_id_header: str | None = None) -> tuple[TurnRequest, Any]:
    """The turn a request body asks for, and vLLM's parsed request (for the answer's shape)."""
    if not isinstance(raw, dict):
        raise bad_request("the request body must be a JSON object")
    sampling = raw.get("sampling_params")
    if not isinstance(sampling, dict):
        raise bad_request("sampling_params must be an object", param="sampling_params")
    req = _validated(raw)
    for name, unused in UNSERVED.items():
        value = getattr(req, name, None)
        if value is not None and value != unused:
            raise bad_request(f"{name} is not supported by this service (token ids in, token ids out, text only)",
                              param=name, code="unsupported_parameter")
    sp, defaults = req.sampling_params, _sampling_defaults()
    for key in sampling:  # the keys the client sent; their values as vLLM's model validated them
        if key in PASSED or key in ("logprobs", "max_tokens", "n"):
            continue
        value = getattr(sp, key, None)
        if key in NEUTRAL and (NEUTRAL[key] is None or value in NEUTRAL[key]):
            continue
        if hasattr(defaults, key) and value == getattr(defaults, key):
            continue  # sent at vLLM's default (a client dumping a whole SamplingParams): changes nothing
        raise bad_request(f"sampling_params.{key} is not supported by this service", param=f"sampling_params.{key}",
                          code="unsupported_parameter")
    top = sp.logprobs if "logprobs" in sampling else None
    if top is not None and top < 0:
        raise bad_request("sampling_params.logprobs must be a non-negative integer (-1, all, is not supported)",
                          param="sampling_params.logprobs")
    turn = TurnRequest(
        messages=[], sampling={k: getattr(sp, k) for k in PASSED if k in sampling},
        max_tokens=sp.max_tokens if "max_tokens" in sampling else None,
        top_logprobs=top or 0, stream=bool(req.stream), rollout_id=headers.rollout_id,
        history_policy=headers.history_policy, idempotency_key=headers.idempotency_key,
        rollout_group=headers.rollout_group, max_staleness=headers.max_staleness,
        prompt_token_ids=list(req.token_ids),
    )
    if request_id_header:
        req.request_id = request_id_header  # vLLM's route prefers the X-Request-Id header too
    return turn, req


def _validated(raw: dict):
    from pydantic import ValidationError
    from vllm.exceptions import VLLMClientError

    try:
        return _vllm().GenerateRequest.model_validate(raw)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = ".".join(str(p) for p in err.get("loc", ()) if not str(p).startswith("is-instance"))
        raise bad_request(f"{loc or 'body'}: {err.get('msg')}", param=loc or None) from None
    except (VLLMClientError, ValueError, TypeError) as exc:  # vLLM's SamplingParams checks (VLLMValidationError names the parameter)
        param = getattr(exc, "parameter", None)
        raise bad_request(" ".join(str(exc).split())[:500],
                          param=f"sampling_params.{param}" if param else "sampling_params") from None


_MODELS: dict[str, Any] = {}


def _entry_models():
    """vLLM's logprob entries plus ``token: "token_id:<id>"``, the string form earlier releases of the
    route answered (OpenAI's shape with ids as tokens) and prime-rl's client (renderers 0.1.12) still
    checks. Answers are dumped with ``serialize_as_any`` so the field goes out."""
    if not _MODELS:
        p = _vllm()

        class LogProb(p.GenerateLogProb):
            token: str

        class LogProbsContent(p.GenerateLogProbsContent):
            token: str

        _MODELS.update(entry=LogProb, content=LogProbsContent)
    return _MODELS["entry"], _MODELS["content"]


def _clamp(logprob: float) -> float:
    """vLLM's floor for a logprob on the wire: -inf and NaN become -9999.0."""
    return -9999.0 if math.isnan(logprob) else max(logprob, -9999.0)


def _content(ids: list[int], lps: list[float], tops: list[dict[int, float]] | None, k: int):
    """vLLM's per-token logprob entries: the sampled id first in the alternatives, as vLLM lists them."""
    entry, content = _entry_models()
    out = []
    for i, (tid, lp) in enumerate(zip(ids, lps)):
        alts = list((tops[i] or {}).items()) if tops else []
        ranks = {t: r for r, (t, _) in enumerate(alts, start=1)}
        entries = [(tid, lp, ranks.get(tid))] + [(t, v, ranks[t]) for t, v in alts if t != tid]
        out.append(content(
            token_id=tid, token=f"token_id:{tid}", logprob=_clamp(lp), rank=ranks.get(tid),
            top_logprobs=[entry(token_id=t, token=f"token_id:{t}", logprob=_clamp(v), rank=r)
                          for t, v, r in entries[: max(k, 1)]]))
    return out


def _logprobs(req, ids, lps, tops):
    k = req.sampling_params.logprobs
    return None if k is None else _vllm().GenerateLogProbs(content=_content(ids, lps, tops, k))


def _spans(weight_versions: list[dict[str, Any]] | None):
    from vllm.outputs import WeightVersionSpan

    return [WeightVersionSpan(w["version"], w["start"], w["end"]) for w in weight_versions or []] or None


def _usage(result: TurnResult):
    from vllm.entrypoints.serve.engine.protocol import UsageInfo

    n_in, n_out = len(result.prompt_token_ids), len(result.generation_token_ids)
    return UsageInfo(prompt_tokens=n_in, completion_tokens=n_out, total_tokens=n_in + n_out)


def request_id(req) -> str:
    return f"generate-tokens-{req.request_id}"


def response(result: TurnResult, req, model: str):
    p = _vllm()
    choice = p.GenerateTokensChoice(
        index=0, finish_reason=result.finish_reason or "stop", stop_reason=result.stop_reason,
        token_ids=result.generation_token_ids, weight_versions=_spans(result.weight_versions),
        logprobs=_logprobs(req, result.generation_token_ids, result.generation_log_probs, result.top_logprobs))
    return p.GenerateTokensResponse(
        request_id=request_id(req), created=int(time.time()), model=model, usage=_usage(result), choices=[choice],
        prompt_token_ids=result.prompt_token_ids if req.return_token_ids else None)


async def stream(first, events: AsyncIterator, req, model: str) -> AsyncIterator[bytes]:
    """vLLM's stream: one chunk per engine step's ids, the finish reason on the last one (with the
    weight-version spans over the whole generation), usage on every chunk with
    ``stream_options.continuous_usage_stats`` and last with ``include_usage``, then ``[DONE]``."""
    from vllm.entrypoints.serve.engine.protocol import UsageInfo

    p = _vllm()
    rid = request_id(req)
    options = req.stream_options
    include_usage = bool(options is not None and options.include_usage)
    continuous = include_usage and bool(options.continuous_usage_stats)
    n_prompt, n_out = len(req.token_ids), 0

    def frame(chunk, **dump) -> bytes:
        exclude = {name for name in ("prompt_token_ids", "mm_placeholders", "metrics") if getattr(chunk, name) is None}
        return b"data: " + chunk.model_dump_json(exclude=exclude, **dump, **DUMP_OPTIONS).encode() + b"\n\n"

    def with_usage(chunk):
        if continuous:
            chunk.usage = UsageInfo(prompt_tokens=n_prompt, completion_tokens=n_out, total_tokens=n_prompt + n_out)
        return chunk

    pending: TokenDelta | None = None  # held back one event: the last ids go out with the finish reason
    prompt_sent = False
    event = first
    try:
        while True:
            if isinstance(event, TokenDelta):
                if pending is not None:
                    n_out += len(pending.token_ids)
                    yield frame(with_usage(_chunk(p, rid, pending, req, None, None, prompt_sent)))
                    prompt_sent = True
                pending = event
            else:
                result: TurnResult = event
                last = pending or TokenDelta(token_ids=[], logprobs=[])
                n_out += len(last.token_ids)
                yield frame(with_usage(_chunk(p, rid, last, req, result, result.finish_reason or "stop", prompt_sent)))
                if include_usage:
                    yield frame(p.GenerateTokensStreamResponse(request_id=rid, choices=[], usage=_usage(result)),
                                exclude_none=True)
                break
            event = await events.__anext__()
    except StopAsyncIteration:
        pass
    except ServiceError as exc:
        yield error_event(exc)
    yield b"data: [DONE]\n\n"


def _chunk(p, rid: str, delta: TokenDelta, req, result: TurnResult | None, finish: str | None, prompt_sent: bool):
    chunk = p.GenerateTokensStreamResponse(request_id=rid, choices=[p.GenerateTokensStreamChoice(
        index=0, finish_reason=finish, stop_reason=result.stop_reason if result is not None else None,
        token_ids=delta.token_ids, weight_versions=_spans(result.weight_versions) if result is not None else None,
        logprobs=_logprobs(req, delta.token_ids, delta.logprobs, delta.top_logprobs))])
    if req.return_token_ids and not prompt_sent:
        chunk.prompt_token_ids = delta.prompt_token_ids or (result.prompt_token_ids if result is not None else None)
    return chunk
