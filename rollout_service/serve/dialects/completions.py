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

from rollout_service.serve.protocol.openai import COMPLETION_UNHONOURED, CompletionRequest, ServiceError, refuse_unhonoured
from rollout_service.serve.dialects.common import error_event

error_frame = error_event
from rollout_service.serve.turn_types import CompletionCall, TokenDelta, TurnResult


class RolloutCompletionChoice(cc.CompletionChoice):
    finish_reason: str | None = None  # vLLM's reasons include "abort"; None while streaming
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None
    generation_log_probs: list[float] | None = None
    weight_versions: list[dict[str, Any]] | None = None


class RolloutCompletion(co.Completion):
    choices: list[RolloutCompletionChoice]


def call(req: CompletionRequest) -> CompletionCall:
    refuse_unhonoured(req, COMPLETION_UNHONOURED)
    return CompletionCall(prompt=req.prompt, sampling=req.sampling_kwargs(),
                          max_tokens=req.max_tokens if req.max_tokens is not None else 16,
                          top_logprobs=req.logprobs or 0, stream=req.stream, want_token_strs=req.logprobs is not None)


def _logprobs(ids, lps, tops, strs) -> cc.Logprobs:
    strs = strs or {}
    return cc.Logprobs(tokens=[strs.get(t, "") for t in ids], token_logprobs=lps,
                       top_logprobs=[{strs.get(t, str(t)): v for t, v in (top or {}).items()} for top in tops] if tops else None)


def response(result: TurnResult, req: CompletionRequest, model: str) -> RolloutCompletion:
    choice = RolloutCompletionChoice(
        index=0, text=result.text, finish_reason=result.finish_reason,
        logprobs=_logprobs(result.generation_token_ids, result.generation_log_probs, result.top_logprobs,
                           result.token_strs) if req.logprobs is not None else None,
        token_ids=result.generation_token_ids, prompt_token_ids=result.prompt_token_ids,
        generation_log_probs=result.generation_log_probs, weight_versions=result.weight_versions,
    )
    return RolloutCompletion(id=f"cmpl-{uuid.uuid4().hex}", object="text_completion", created=int(time.time()),
                             model=model, choices=[choice], usage=CompletionUsage(**result.usage))


async def stream(first, events: AsyncIterator, req: CompletionRequest, model: str) -> AsyncIterator[bytes]:
    cid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())

    def frame(choice: RolloutCompletionChoice) -> bytes:
        body = RolloutCompletion(id=cid, object="text_completion", created=created, model=model, choices=[choice])
        return b"data: " + body.model_dump_json(exclude_unset=True).encode() + b"\n\n"

    event = first
    try:
        while True:
            if isinstance(event, TokenDelta):
                yield frame(RolloutCompletionChoice(
                    index=0, text=event.content, finish_reason=None, token_ids=event.token_ids,
                    logprobs=_logprobs(event.token_ids, event.logprobs, event.top_logprobs, event.token_strs)
                    if req.logprobs is not None else None))
            else:
                result: TurnResult = event
                yield frame(RolloutCompletionChoice(
                    index=0, text="", finish_reason=result.finish_reason, prompt_token_ids=result.prompt_token_ids,
                    generation_log_probs=result.generation_log_probs, weight_versions=result.weight_versions))
                break
            event = await events.__anext__()
    except StopAsyncIteration:
        pass
    except ServiceError as exc:
        yield error_event(exc)
    yield b"data: [DONE]\n\n"
