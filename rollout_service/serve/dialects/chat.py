"""Chat completions: ``POST /v1/chat/completions`` over the turn runner.

Answers are the ``openai`` package's own types, subclassed for our fields: the exact
``prompt_token_ids`` / ``generation_token_ids`` / ``generation_log_probs`` (NeMo Gym's names),
``weight_versions`` and ``rollout`` on the message (and on the last stream chunk's delta).
"""

from __future__ import annotations

import time
import uuid
from typing import Any, AsyncIterator, Literal

from openai.types.chat import chat_completion as cc
from openai.types.chat import chat_completion_chunk as ch
from openai.types.chat.chat_completion_message import ChatCompletionMessage
from openai.types.chat.chat_completion_token_logprob import ChatCompletionTokenLogprob

from rollout_service.serve.protocol.envelope import ServiceError
from rollout_service.serve.protocol.messages import response_format_dict
from rollout_service.serve.protocol.openai import ChatCompletionRequest, template_kwargs
from rollout_service.serve.protocol.unhonoured import CHAT_UNHONOURED, refuse_unhonoured
from rollout_service.serve.dialects.common import (
    RolloutHeaders,
    RunningUsage,
    continuous_usage,
    allowed_tools,
    error_event,
    sse,
    token_logprobs,
    tool_choice_of,
    usage_of,
)

error_frame = error_event
from rollout_service.serve.turn_types import TokenDelta, TurnRequest, TurnResult


class RolloutMessage(ChatCompletionMessage):
    role: Literal["assistant", "user", "system", "developer", "tool"] = "assistant"  # vLLM's rule: _role
    reasoning: str | None = None  # vLLM 0.32's name
    reasoning_content: str | None = None  # the earlier name, kept for clients that read it
    prompt_token_ids: list[int]
    generation_token_ids: list[int]
    generation_log_probs: list[float]
    weight_versions: list[dict[str, Any]]
    rollout: dict[str, Any] | None = None


class RolloutChoice(cc.Choice):
    finish_reason: str  # vLLM's reasons include "abort"
    message: RolloutMessage
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None
    routed_experts: Any = None


class RolloutChatCompletion(cc.ChatCompletion):
    choices: list[RolloutChoice]
    prompt_logprobs: list | None = None
    prompt_token_ids: list[int] | None = None
    prompt_text: str | None = None
    kv_transfer_params: dict[str, Any] | None = None
    ec_transfer_params: dict[str, Any] | None = None
    metrics: dict[str, Any] | None = None


class RolloutDelta(ch.ChoiceDelta):
    reasoning: str | None = None
    reasoning_content: str | None = None


class RolloutChunkChoice(ch.Choice):
    finish_reason: str | None = None
    delta: RolloutDelta
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class RolloutChunk(ch.ChatCompletionChunk):
    choices: list[RolloutChunkChoice]
    prompt_token_ids: list[int] | None = None  # return_token_ids: on the first chunk, as vLLM sends it


def turn_request(req: ChatCompletionRequest, headers: RolloutHeaders) -> TurnRequest:
    refuse_unhonoured(req, CHAT_UNHONOURED)
    headers = headers.with_body_rollout_id(req.metadata)
    if req.truncate_prompt_tokens is not None and req.required_prefix_token_ids is not None:
        raise ServiceError(400, "truncate_prompt_tokens cannot be combined with required_prefix_token_ids (the cut "
                           "prompt would not start with the prefix)", param="truncate_prompt_tokens",
                           code="unsupported_parameter")
    if req.truncate_prompt_tokens is not None and headers.rollout_id is not None:
        raise ServiceError(400, "truncate_prompt_tokens is not supported under a rollout id: a truncated prompt is not "
                           "the rollout's history (send the call without a rollout id to truncate)",
                           param="truncate_prompt_tokens", code="unsupported_parameter")
    for name, live in (("continue_final_message", req.continue_final_message),
                       ("add_generation_prompt", not req.add_generation_prompt), ("echo", req.echo)):
        if live and (headers.rollout_id is not None or req.required_prefix_token_ids is not None):
            raise ServiceError(400, f"{name} is not supported under a rollout id or a required prefix: a prompt "
                               "without the generation prompt, or an answer that repeats the history, is not a history "
                               "the rollout's next call extends (send the call without them to use it)",
                               param=name, code="unsupported_parameter")
    tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
    choice = tool_choice_of(req.tool_choice, tools)
    return TurnRequest(
        messages=[m.to_plain() for m in req.messages],
        tools=allowed_tools(tools, choice),
        tool_choice=choice,
        chat_template_kwargs=template_kwargs(req.chat_template_kwargs, req.reasoning_effort),
        sampling=_sampling(req),
        max_tokens=req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens,
        top_logprobs=(req.top_logprobs or 0) if req.logprobs else 0,
        stream=req.stream,
        rollout_id=headers.rollout_id,
        history_policy=headers.history_policy,
        idempotency_key=headers.idempotency_key,
        rollout_group=headers.rollout_group,
        max_staleness=headers.max_staleness,
        want_token_strs=bool(req.logprobs) and not req.return_tokens_as_token_ids,
        required_prefix_token_ids=req.required_prefix_token_ids,
        response_format=response_format_dict(req.response_format),
        structured_outputs=req.structured_outputs,
        continuous_usage=continuous_usage(req),
        truncate_prompt_tokens=req.truncate_prompt_tokens,
        truncation_side=req.truncation_side,
        parallel_tool_calls=req.parallel_tool_calls,
        add_generation_prompt=req.add_generation_prompt,
        continue_final_message=req.continue_final_message,
    )


def _sampling(req: ChatCompletionRequest) -> dict[str, Any]:
    sampling = req.sampling_kwargs()
    if req.echo and req.prompt_logprobs is None:  # vLLM's: an echo returns the prompt's logprobs too
        sampling["prompt_logprobs"] = req.top_logprobs or 0
    return sampling


def _role(req: ChatCompletionRequest) -> str:
    """The answer's role as vLLM names it: the assistant's, or without the generation prompt the last message's."""
    return "assistant" if req.add_generation_prompt else req.messages[-1].role


def _echoed(req: ChatCompletionRequest) -> str:
    """``echo``: the last message's text, when its role is the answer's (vLLM's rule), else ""."""
    if not req.echo or req.messages[-1].role != _role(req):
        return ""
    return req.messages[-1].to_plain()["content"]  # text parts joined one per line, as vLLM's conversation has it


def _logprobs(ids, lps, tops, strs, as_ids: bool, k: int, model=cc.ChoiceLogprobs):
    """``model``: the answer's ChoiceLogprobs, or a stream chunk's (``ch.ChoiceLogprobs``, another class)."""
    return model(content=[ChatCompletionTokenLogprob.model_validate(entry)
                          for entry in token_logprobs(ids, lps, tops, strs, as_ids, k)])


def response(result: TurnResult, req: ChatCompletionRequest, model: str) -> RolloutChatCompletion:
    msg = result.message
    # vLLM answers a forced call (required / named) with content "" rather than null.
    forced = bool(req.tools) and req.tool_choice not in (None, "auto", "none") and tool_choice_of(
        req.tool_choice, [t.model_dump(exclude_none=True) for t in req.tools]).mode in ("required", "named")
    # include_reasoning: false hides the reasoning and, as vLLM does (with a reasoning parser), the
    # per-token metadata that would show it (logprobs, token_ids); our exact-id fields stay.
    hidden = _reasoning_hidden(req)
    reasoning = None if hidden else msg.get("reasoning_content") or None
    content = msg.get("content") or ("" if forced else None)
    if req.echo:  # vLLM's: the echoed text first, "" at least
        content = _echoed(req) + (content or "")
    message = RolloutMessage(
        role=_role(req), content=content, reasoning=reasoning,
        reasoning_content=reasoning, tool_calls=msg.get("tool_calls") or None, refusal=None, annotations=None,
        audio=None, function_call=None,
        prompt_token_ids=result.prompt_token_ids, generation_token_ids=result.generation_token_ids,
        generation_log_probs=result.generation_log_probs, weight_versions=result.weight_versions, rollout=result.rollout,
    )
    choice = RolloutChoice(
        index=0, message=message, finish_reason=result.finish_reason, stop_reason=result.stop_reason,
        logprobs=_logprobs(result.generation_token_ids, result.generation_log_probs, result.top_logprobs,
                           result.token_strs, bool(req.return_tokens_as_token_ids), _alternatives(req))
        if req.logprobs and not hidden else None,
        token_ids=result.generation_token_ids if req.return_token_ids and not hidden else None, routed_experts=None,
    )
    return RolloutChatCompletion(
        id=f"chatcmpl-{uuid.uuid4().hex}", object="chat.completion", created=int(time.time()), model=model,
        choices=[choice], usage=usage_of(result), service_tier=None, system_fingerprint=None,
        prompt_logprobs=result.prompt_logprobs,
        prompt_token_ids=result.prompt_token_ids if req.return_token_ids else None, prompt_text=None,
        kv_transfer_params=None, ec_transfer_params=None, metrics=None,
    )


async def stream(first, events: AsyncIterator, req: ChatCompletionRequest, model: str) -> AsyncIterator[bytes]:
    """SSE chunks as vLLM's: the role, then content / reasoning deltas, the last of them with the finish
    and stop reasons (and the tool calls and our fields), usage if asked, ``[DONE]``. An error after
    the first byte is an error event (the status line is already sent)."""
    cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    as_ids = bool(req.return_tokens_as_token_ids)

    def chunk(delta: dict[str, Any], finish: str | None = None, logprobs=None, prompt=None, usage=None, **extra) -> bytes:
        choice = RolloutChunkChoice(index=0, delta=RolloutDelta(**delta), finish_reason=finish, logprobs=logprobs, **extra)
        top = {"prompt_token_ids": prompt} if prompt is not None else {}
        if usage is not None:  # stream_options.continuous_usage_stats
            top["usage"] = usage
        body = RolloutChunk(id=cid, object="chat.completion.chunk", created=created, model=model, choices=[choice], **top)
        return _frame(body)

    hidden = _reasoning_hidden(req)
    ids_shown = bool(req.return_token_ids) and not hidden

    def delta_of(event: TokenDelta | None) -> tuple[dict[str, Any], Any, dict[str, Any]]:
        if event is None:
            return {}, None, ({"token_ids": []} if ids_shown else {})
        delta: dict[str, Any] = {}
        if event.reasoning and not hidden:
            delta["reasoning"] = delta["reasoning_content"] = event.reasoning
        if event.content:
            delta["content"] = event.content
        lp = (_logprobs(event.token_ids, event.logprobs, event.top_logprobs, event.token_strs, as_ids,
                        _alternatives(req), ch.ChoiceLogprobs) if req.logprobs and not hidden else None)
        return delta, lp, ({"token_ids": event.token_ids} if ids_shown else {})

    running = RunningUsage(first) if continuous_usage(req) else None
    yield chunk({"role": _role(req), "content": ""},
                prompt=getattr(first, "prompt_token_ids", None) if req.return_token_ids else None,
                usage=running.usage(chat=True) if running else None)
    if echoed := _echoed(req):  # vLLM's: the echoed text in a chunk of its own, before the generation's
        yield chunk({"content": echoed}, usage=running.usage(chat=True) if running else None)
    pending: TokenDelta | None = None  # held one event: the last step's text goes out with the finish reason
    event = first
    try:
        while True:
            if isinstance(event, TokenDelta):
                if pending is not None:
                    delta, lp, extra = delta_of(pending)
                    if running:
                        running.add(pending)
                    if delta or lp or extra:  # as vLLM: a step that completed no text and asks for no metadata sends nothing
                        yield chunk(delta, logprobs=lp, usage=running.usage(chat=True) if running else None, **extra)
                pending = event
            else:
                result: TurnResult = event
                delta, lp, extra = delta_of(pending)
                pending = None
                if result.message.get("tool_calls"):
                    delta["tool_calls"] = [{"index": i, **tc} for i, tc in enumerate(result.message["tool_calls"])]
                for k in ("prompt_token_ids", "generation_token_ids", "generation_log_probs", "weight_versions", "rollout"):
                    delta[k] = getattr(result, k)
                yield chunk(delta, finish=result.finish_reason, logprobs=lp, stop_reason=result.stop_reason,
                            usage=running.final(result, chat=True) if running else None, **extra)
                if (req.stream_options or {}).get("include_usage"):
                    body = RolloutChunk(id=cid, object="chat.completion.chunk", created=created, model=model, choices=[],
                                        usage=usage_of(result, stream=True))
                    yield _frame(body)
                break
            event = await events.__anext__()
    except StopAsyncIteration:
        pass
    except ServiceError as exc:
        if pending is not None:
            delta, lp, extra = delta_of(pending)
            if running:
                running.add(pending)
            yield chunk(delta, logprobs=lp, usage=running.usage(chat=True) if running else None, **extra)
        yield error_event(exc)
    yield b"data: [DONE]\n\n"


def _alternatives(req: ChatCompletionRequest) -> int | None:
    """How many entries each position's ``top_logprobs`` lists: every one vLLM returned for
    ``logprob_token_ids`` (the sampled token first), else ``top_logprobs``."""
    return None if req.logprob_token_ids else req.top_logprobs or 0


def _reasoning_hidden(req: ChatCompletionRequest) -> bool:
    return not req.include_reasoning


def _frame(model) -> bytes:
    return b"data: " + model.model_dump_json(exclude_unset=True).encode() + b"\n\n"


__all__ = ["turn_request", "response", "stream", "sse"]
