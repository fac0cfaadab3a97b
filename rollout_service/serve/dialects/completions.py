"""Completions: ``POST /v1/completions`` on token ids (or text), no chat template, no rollout state.

Answers are the ``openai`` package's Completion types with vLLM's extras (``token_ids``,
``prompt_token_ids``) and ours (``generation_log_probs``, ``weight_versions``).
"""

from __future__ import annotations

import time
import uuid
from typing import Any, AsyncIterator

from openai.types import completion as co
from openai.types import completion_choice as cc
from openai.types.completion_usage import CompletionUsage

from rollout_service.onpolicy.parsing import completion_structured_outputs, vllm_error_param
from rollout_service.serve.protocol.envelope import ServiceError
from rollout_service.serve.protocol.openai import CompletionRequest
from rollout_service.serve.protocol.unhonoured import COMPLETION_UNHONOURED, refuse_unhonoured
from rollout_service.serve.dialects.common import RunningUsage, clamped, continuous_usage, error_event, usage_of

error_frame = error_event
from rollout_service.serve.turn_types import CompletionCall, TokenDelta, TurnResult


class CompletionLogprobs(cc.Logprobs):
    """vLLM's completions logprobs: an echoed prompt's first position has no logprob and no alternatives."""

    token_logprobs: list[float | None] | None = None
    top_logprobs: list[dict[str, float] | None] | None = None


class RolloutCompletionChoice(cc.CompletionChoice):
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None  # vLLM's reasons include "abort"; None while streaming
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None
    prompt_logprobs: list | None = None
    routed_experts: Any = None
    generation_log_probs: list[float] | None = None
    weight_versions: list[dict[str, Any]] | None = None


class RolloutCompletion(co.Completion):
    choices: list[RolloutCompletionChoice]
    service_tier: str | None = None
    kv_transfer_params: dict[str, Any] | None = None
    ec_transfer_params: dict[str, Any] | None = None
    metrics: dict[str, Any] | None = None


def call(req: CompletionRequest) -> CompletionCall:
    refuse_unhonoured(req, COMPLETION_UNHONOURED)
    sampling = req.sampling_kwargs()
    max_tokens = req.max_tokens if req.max_tokens is not None else 16
    discard = bool(req.echo) and max_tokens == 0  # vLLM: generate one token, return only the prompt
    if req.echo and req.logprobs is not None and req.prompt_logprobs is None:
        sampling["prompt_logprobs"] = req.logprobs  # vLLM: echoed logprobs cover the prompt too
    from vllm.exceptions import VLLMClientError

    try:
        structured = completion_structured_outputs(req.structured_outputs)
    except (ValueError, TypeError, VLLMClientError) as exc:  # vLLM's request model refused it: 400, as vLLM names it
        raise ServiceError(400, f"structured_outputs: {' '.join(str(exc).split())[:300]}",
                           param=vllm_error_param(exc)) from None
    return CompletionCall(prompt=req.prompt, sampling=sampling, max_tokens=1 if discard else max_tokens,
                          top_logprobs=req.logprobs or 0, stream=req.stream, want_token_strs=req.logprobs is not None,
                          echo=bool(req.echo), echo_text=not req.return_token_ids, discard_output=discard,
                          structured_outputs=structured, truncate_prompt_tokens=req.truncate_prompt_tokens,
                          truncation_side=req.truncation_side,
                          max_tokens_given=bool(req.max_tokens if "max_tokens" in req.model_fields_set else 16))


def _logprobs(ids, lps, tops, strs, k: int | None, offset: int = 0) -> CompletionLogprobs:
    """vLLM's completions logprobs: per position the sampled token first, then the top ``k`` by rank
    (the sampled one once; ``k`` None: every entry, as for ``logprob_token_ids``), keyed by their text;
    ``text_offset`` counts the tokens' text from ``offset``."""
    strs = strs or [{}] * len(ids)
    tokens = [s.get(t, "") for t, s in zip(ids, strs)]
    offsets = []
    for tok in tokens:
        offsets.append(offset)
        offset += len(tok)
    top_logprobs = []
    for tid, lp, top, s in zip(ids, lps, tops or [None] * len(ids), strs):
        ranked = {tid: lp, **{t: v for t, v in (top or {}).items() if t != tid}}
        top_logprobs.append({s.get(t, ""): clamped(v) for t, v in list(ranked.items())[:None if k is None else k + 1]})
    return CompletionLogprobs(text_offset=offsets, tokens=tokens, token_logprobs=[clamped(v) for v in lps],
                       top_logprobs=top_logprobs)


def _echoed_logprobs(result: TurnResult, k: int, generated_k: int | None) -> CompletionLogprobs:
    """Echo with logprobs, as vLLM: the prompt's positions first (the first without logprobs, named by
    its text alone), from the prompt logprobs, then the generation's (none with max_tokens 0), with
    ``generated_k`` alternatives (None: all, as for ``logprob_token_ids``)."""
    prompt_ids = result.prompt_token_ids
    tokens, token_lps, tops = [result.echo["first_token"]], [None], [None]
    for tid, entry in zip(prompt_ids[1:], (result.prompt_logprobs or [None])[1:]):
        entry = entry or {}
        own = entry.get(str(tid), {"logprob": None, "decoded_token": ""})
        tokens.append(own["decoded_token"])
        token_lps.append(own["logprob"])
        tops.append({e["decoded_token"]: e["logprob"] for e in list(entry.values())[:k + 1]})
    out = None if result.discard_output else _logprobs(
        result.generation_token_ids, result.generation_log_probs, result.top_logprobs, result.token_strs, generated_k,
        sum(len(t) for t in tokens))
    offsets, offset = [], 0
    for tok in tokens:
        offsets.append(offset)
        offset += len(tok)
    return CompletionLogprobs(text_offset=offsets + (out.text_offset if out else []), tokens=tokens + (out.tokens if out else []),
                       token_logprobs=token_lps + (out.token_logprobs if out else []),
                       top_logprobs=tops + (out.top_logprobs if out else []))


def _text(result: TurnResult, req: CompletionRequest) -> str:
    if result.echo is None:
        return result.text
    prompt_text = "" if req.return_token_ids else result.echo["text"]  # vLLM's rule
    return prompt_text if result.discard_output else prompt_text + result.text


def response(result: TurnResult, req: CompletionRequest, model: str) -> RolloutCompletion:
    ids_asked = bool(req.return_token_ids)
    if req.logprobs is None:
        logprobs = None
    elif result.echo is not None:
        logprobs = _echoed_logprobs(result, req.logprobs, None if req.logprob_token_ids else req.logprobs)
    else:
        logprobs = _logprobs(result.generation_token_ids, result.generation_log_probs, result.top_logprobs,
                             result.token_strs, None if req.logprob_token_ids else req.logprobs)
    choice = RolloutCompletionChoice(
        index=0, text=_text(result, req), finish_reason=result.finish_reason, stop_reason=result.stop_reason,
        logprobs=logprobs,
        token_ids=result.generation_token_ids if ids_asked else None,
        prompt_token_ids=result.prompt_token_ids if ids_asked else None,
        prompt_logprobs=result.prompt_logprobs, routed_experts=None,
        generation_log_probs=result.generation_log_probs, weight_versions=result.weight_versions,
    )
    return RolloutCompletion(id=f"cmpl-{uuid.uuid4().hex}", object="text_completion", created=int(time.time()),
                             model=model, choices=[choice], usage=usage_of(result), service_tier=None,
                             system_fingerprint=None, kv_transfer_params=None, ec_transfer_params=None, metrics=None)


async def stream(first, events: AsyncIterator, req: CompletionRequest, model: str) -> AsyncIterator[bytes]:
    """vLLM's chunks: one per engine step, the last one carrying the last step's text with the
    finish and stop reasons (and our fields), then the usage chunk if ``stream_options`` asks."""
    cid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
    ids_asked = bool(req.return_token_ids)
    offset = 0

    def frame(choice: RolloutCompletionChoice, usage=None) -> bytes:
        body = RolloutCompletion(id=cid, object="text_completion", created=created, model=model,
                                 choices=[choice] if choice is not None else [], **({"usage": usage} if usage else {}))
        return b"data: " + body.model_dump_json(exclude_unset=True).encode() + b"\n\n"

    def delta_choice(event: TokenDelta | None, **final) -> RolloutCompletionChoice:
        nonlocal offset
        lp = None
        if event is not None and req.logprobs is not None:
            lp = _logprobs(event.token_ids, event.logprobs, event.top_logprobs, event.token_strs,
                           None if req.logprob_token_ids else req.logprobs, offset)
            offset = lp.text_offset[-1] + len(lp.tokens[-1]) if lp.tokens else offset
        return RolloutCompletionChoice(
            index=0, text=event.content if event is not None else "", logprobs=lp,
            finish_reason=final.pop("finish_reason", None), stop_reason=final.pop("stop_reason", None),
            token_ids=(event.token_ids if event is not None else []) if ids_asked else None,
            prompt_token_ids=event.prompt_token_ids if (ids_asked or req.echo) and event is not None else None, **final)

    running = RunningUsage(first) if continuous_usage(req) else None
    pending: TokenDelta | None = None  # held one event: the last step's text goes out with the finish reason
    event = first
    try:
        while True:
            if isinstance(event, TokenDelta):
                if pending is not None:
                    if running:
                        running.add(pending)
                    yield frame(delta_choice(pending), usage=running.usage(chat=False) if running else None)
                pending = event
            else:
                result: TurnResult = event
                yield frame(delta_choice(pending, finish_reason=result.finish_reason, stop_reason=result.stop_reason,
                                         generation_log_probs=result.generation_log_probs,
                                         weight_versions=result.weight_versions),
                            usage=running.final(result, chat=False) if running else None)
                pending = None
                if (req.stream_options or {}).get("include_usage"):
                    yield frame(None, usage=usage_of(result, stream=True))
                break
            event = await events.__anext__()
    except StopAsyncIteration:
        pass
    except ServiceError as exc:
        if pending is not None:
            if running:
                running.add(pending)
            yield frame(delta_choice(pending), usage=running.usage(chat=False) if running else None)
        yield error_event(exc)
    yield b"data: [DONE]\n\n"
