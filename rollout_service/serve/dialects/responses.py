"""Responses API: ``POST /v1/responses`` over the turn runner.

Input items become chat messages (``protocol.responses``); one call's result becomes output items
(reasoning, message, function calls) built from the ``openai`` package's Responses types. NeMo Gym's
echo fields (``prompt_token_ids``, ``generation_token_ids``, ``generation_log_probs``), the
``weight_versions`` and ``rollout`` ride on the last output item.

The stream follows OpenAI's event sequence: ``response.created``, ``response.in_progress``, then
per output item ``output_item.added`` → (``content_part.added`` → text / reasoning deltas →
``output_text.done`` / ``reasoning_text.done`` → ``content_part.done``) or (function call
``arguments.delta`` → ``arguments.done``) → ``output_item.done``, and finally
``response.completed``, or ``response.incomplete`` with ``incomplete_details`` when the answer was
cut by ``max_output_tokens``. Item ids in the events are the ids of the final response's items.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, AsyncIterator

from openai.types import responses as rt

from rollout_service.serve.protocol.envelope import ServiceError, bad_request
from rollout_service.serve.protocol.openai import ResponsesRequest, template_kwargs
from rollout_service.serve.protocol.unhonoured import (
    OUTPUT_LOGPROBS,
    RESPONSES_INCLUDE_HONOURED,
    RESPONSES_UNHONOURED,
    refuse_unhonoured,
)
from rollout_service.serve.protocol.responses import ECHO_FIELDS, input_to_messages, tools_to_chat
from rollout_service.serve.dialects.common import RolloutHeaders, allowed_tools, token_logprobs, tool_choice_of
from rollout_service.serve.turn_types import TokenDelta, TurnRequest, TurnResult


def turn_request(req: ResponsesRequest, headers: RolloutHeaders) -> TurnRequest:
    if req.previous_response_id:
        raise bad_request("previous_response_id is not supported: send the full input (the service keeps token history "
                          "per rollout id)", param="previous_response_id")
    refuse_unhonoured(req, RESPONSES_UNHONOURED)
    include = (req.model_extra or {}).get("include")
    if include is not None:
        if not isinstance(include, list) or not all(isinstance(i, str) for i in include):
            raise bad_request("include must be a list of strings", param="include")
        for item in include:
            if item not in RESPONSES_INCLUDE_HONOURED:
                raise bad_request(f"include {item!r} is not supported (the service returns reasoning, text, function "
                                  f"calls and, with {OUTPUT_LOGPROBS!r}, logprobs; hosted tools are not served)",
                                  param="include", code="unsupported_parameter")
    wants_logprobs = req.wants_logprobs()
    if req.top_logprobs and not wants_logprobs:
        raise bad_request(f"top_logprobs needs include: [{OUTPUT_LOGPROBS!r}] (the logprobs it adds alternatives to)",
                          param="top_logprobs")
    headers = headers.with_body_rollout_id(req.metadata)
    tools = tools_to_chat(req.tools)
    choice = tool_choice_of(req.tool_choice, tools)
    return TurnRequest(
        messages=input_to_messages(req.input, req.instructions),
        tools=allowed_tools(tools, choice),
        tool_choice=choice,
        chat_template_kwargs=template_kwargs(req.chat_template_kwargs, req.reasoning.effort if req.reasoning else None),
        sampling=req.sampling_kwargs(),
        max_tokens=req.max_output_tokens if req.max_output_tokens is not None else req.max_tokens,
        stream=req.stream,
        rollout_id=headers.rollout_id,
        history_policy=headers.history_policy,
        idempotency_key=headers.idempotency_key,
        rollout_group=headers.rollout_group,
        max_staleness=headers.max_staleness,
        required_prefix_token_ids=req.required_prefix_token_ids,
        response_format=req.text.response_format() if req.text is not None else None,
        parallel_tool_calls=req.parallel_tool_calls,
        top_logprobs=(req.top_logprobs or 0) if wants_logprobs else 0,
        want_token_strs=wants_logprobs,
    )


class _Ids:
    """Item ids of one response, shared by its stream events and its final object."""

    def __init__(self):
        self.response = f"resp_{uuid.uuid4().hex}"
        self.reasoning = f"rs_{uuid.uuid4().hex}"
        self.message = f"msg_{uuid.uuid4().hex}"
        self.calls: list[str] = []

    def call(self, i: int) -> str:
        while len(self.calls) <= i:
            self.calls.append(f"fc_{uuid.uuid4().hex}")
        return self.calls[i]


def _result_logprobs(result: TurnResult, req: ResponsesRequest) -> list[dict[str, Any]]:
    """include message.output_text.logprobs: every generated token's, on the message's output_text
    (vLLM's server does the same: the reasoning's tokens too, the generation is one sequence)."""
    if not req.wants_logprobs():
        return []
    return token_logprobs(result.generation_token_ids, result.generation_log_probs, result.top_logprobs,
                          result.token_strs, k=req.top_logprobs or 0)


def output_items(result: TurnResult, ids: _Ids, logprobs: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    msg = result.message
    items: list[dict[str, Any]] = []
    status = "incomplete" if result.finish_reason == "length" else "completed"
    if msg.get("reasoning_content"):
        items.append({"type": "reasoning", "id": ids.reasoning, "summary": [], "status": status,
                      "content": [{"type": "reasoning_text", "text": msg["reasoning_content"]}]})
    if msg.get("content") or not msg.get("tool_calls"):
        items.append({"type": "message", "id": ids.message, "role": "assistant", "status": status,
                      "content": [{"type": "output_text", "text": msg.get("content") or "", "annotations": [],
                                   "logprobs": logprobs or []}]})
    for i, tc in enumerate(msg.get("tool_calls") or []):
        items.append({"type": "function_call", "id": ids.call(i), "call_id": tc["id"], "name": tc["function"]["name"],
                      "arguments": tc["function"]["arguments"], "status": "completed"})
    last = items[-1]
    for k in ECHO_FIELDS:
        last[k] = getattr(result, k)
    last["weight_versions"] = result.weight_versions
    if result.rollout:
        last["rollout"] = result.rollout
    return items


def _response(req: ResponsesRequest, model: str, ids: _Ids, *, status: str, output: list[dict[str, Any]],
              result: TurnResult | None = None, created: int | None = None) -> rt.Response:
    body: dict[str, Any] = {
        "id": ids.response, "object": "response", "created_at": created or int(time.time()), "model": model,
        "status": status, "output": output, "parallel_tool_calls": req.parallel_tool_calls is not False,
        "tool_choice": _echo_tool_choice(req.tool_choice), "tools": _echo_tools(req.tools),
        "incomplete_details": None, "max_output_tokens": req.max_output_tokens, "temperature": req.temperature,
        "top_p": req.top_p, "metadata": _str_metadata(req.metadata), "instructions": req.instructions,
    }
    if req.text is not None:
        body["text"] = req.text.model_dump(by_alias=True, exclude_none=True)
    if result is not None:
        if status == "incomplete":
            body["incomplete_details"] = {"reason": "max_output_tokens"}
        u = result.usage
        body["usage"] = {"input_tokens": u["prompt_tokens"], "output_tokens": u["completion_tokens"],
                         "total_tokens": u["total_tokens"], "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
                         "output_tokens_details": {"reasoning_tokens": result.reasoning_tokens or 0}}
    return rt.Response.model_validate(body)


def _status(result: TurnResult) -> str:
    return "incomplete" if result.finish_reason == "length" else "completed"


def response(result: TurnResult, req: ResponsesRequest, model: str) -> rt.Response:
    ids = _Ids()
    return _response(req, model, ids, status=_status(result), output=output_items(result, ids, _result_logprobs(result, req)),
                     result=result)


async def stream(first, events: AsyncIterator, req: ResponsesRequest, model: str) -> AsyncIterator[bytes]:
    ids = _Ids()
    created = int(time.time())
    seq = -1

    def ev(kind: str, **fields) -> bytes:
        nonlocal seq
        seq += 1
        body = {"type": kind, "sequence_number": seq, **fields}
        return f"event: {kind}\ndata: {json.dumps(body, separators=(',', ':'), default=_dump)}\n\n".encode()

    start = _response(req, model, ids, status="in_progress", output=[], created=created)
    yield ev("response.created", response=start)
    yield ev("response.in_progress", response=start)

    texts = {"reasoning": "", "message": ""}
    wants_logprobs = req.wants_logprobs()
    streamed_logprobs: list[dict[str, Any]] = []  # every token's so far (a message closed early carries them)
    pending: list[dict[str, Any]] = []  # tokens not on a text delta yet (they completed no text, e.g. half a character)
    index: dict[str, int] = {}  # text items opened while streaming -> output index
    closed: set[str] = set()
    event = first
    try:
        while isinstance(event, TokenDelta):
            delta_logprobs = token_logprobs(event.token_ids, event.logprobs, event.top_logprobs,
                                            event.token_strs, k=req.top_logprobs or 0) if wants_logprobs else []
            streamed_logprobs += delta_logprobs
            pending += delta_logprobs
            for kind, text in (("reasoning", event.reasoning), ("message", event.content)):
                if not text or kind in closed:
                    continue
                if kind not in index:
                    for other in [k for k in index if k not in closed]:  # one text item streams at a time
                        item = _text_item(other, ids, texts[other], "completed", streamed_logprobs)
                        for frame in _close_text(ev, other, index[other], ids, texts[other], item, streamed_logprobs):
                            yield frame
                        closed.add(other)
                    index[kind] = len(index)
                    for frame in _open_text(ev, kind, index[kind], ids):
                        yield frame
                texts[kind] += text
                yield _text_delta(ev, kind, index[kind], ids, text, pending if kind == "message" else ())
                if kind == "message":
                    pending = []
            if event.reasoning and not event.content:
                pending = []  # the reasoning's tokens: not the message's text
            event = await events.__anext__()
    except StopAsyncIteration:
        return
    except ServiceError as exc:
        yield ev("error", code=exc.code or exc.type, message=exc.message, param=exc.param)
        return

    result: TurnResult = event
    status = _status(result)
    final_logprobs = _result_logprobs(result, req)
    final = _response(req, model, ids, status=status, output=output_items(result, ids, final_logprobs),
                      result=result, created=created)
    for i, item in enumerate(final.output):
        kind = item.type
        if kind in ("reasoning", "message"):
            if kind in closed:
                continue
            text = item.content[0].text if item.content else ""
            if kind not in index:  # never streamed (e.g. a replayed or non-text answer): open it now
                for frame in _open_text(ev, kind, i, ids):
                    yield frame
                if text:
                    yield _text_delta(ev, kind, i, ids, text, final_logprobs)
            for frame in _close_text(ev, kind, index.get(kind, i), ids, text, item, final_logprobs):
                yield frame
        else:  # function_call: arguments as one delta, parsed by the same parser as a non-streamed call
            yield ev("response.output_item.added", output_index=i,
                     item=item.model_copy(update={"arguments": "", "status": "in_progress"}))
            yield ev("response.function_call_arguments.delta", item_id=item.id, output_index=i, delta=item.arguments)
            yield ev("response.function_call_arguments.done", item_id=item.id, output_index=i, arguments=item.arguments,
                     name=item.name)
            yield ev("response.output_item.done", output_index=i, item=item)
    yield ev("response.completed" if status == "completed" else "response.incomplete", response=final)


def error_frame(exc: ServiceError) -> bytes:
    body = {"type": "error", "code": exc.code or exc.type, "message": exc.message, "param": exc.param}
    return f"event: error\ndata: {json.dumps(body)}\n\n".encode()


def _text_item(kind: str, ids: _Ids, text: str, status: str, logprobs: list | None = None) -> dict[str, Any]:
    if kind == "reasoning":
        return {"type": "reasoning", "id": ids.reasoning, "summary": [], "status": status,
                "content": [{"type": "reasoning_text", "text": text}]}
    return {"type": "message", "id": ids.message, "role": "assistant", "status": status,
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": list(logprobs or [])}]}


def _text_delta(ev, kind: str, index: int, ids: _Ids, text: str, logprobs=()) -> bytes:
    if kind == "reasoning":
        return ev("response.reasoning_text.delta", item_id=ids.reasoning, output_index=index, content_index=0, delta=text)
    return ev("response.output_text.delta", item_id=ids.message, output_index=index, content_index=0, delta=text,
              logprobs=list(logprobs or []))


def _open_text(ev, kind: str, index: int, ids: _Ids):
    item = _text_item(kind, ids, "", "in_progress")
    item["content"] = []
    yield ev("response.output_item.added", output_index=index, item=item)
    part = {"type": "reasoning_text", "text": ""} if kind == "reasoning" else {
        "type": "output_text", "text": "", "annotations": [], "logprobs": []}
    yield ev("response.content_part.added", item_id=item["id"], output_index=index, content_index=0, part=part)


def _close_text(ev, kind: str, index: int, ids: _Ids, text: str, item, logprobs=()):
    if kind == "reasoning":
        yield ev("response.reasoning_text.done", item_id=ids.reasoning, output_index=index, content_index=0, text=text)
        yield ev("response.content_part.done", item_id=ids.reasoning, output_index=index, content_index=0,
                 part={"type": "reasoning_text", "text": text})
    else:
        logprobs = list(logprobs)
        yield ev("response.output_text.done", item_id=ids.message, output_index=index, content_index=0, text=text,
                 logprobs=logprobs)
        yield ev("response.content_part.done", item_id=ids.message, output_index=index, content_index=0,
                 part={"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs})
    yield ev("response.output_item.done", output_index=index, item=item)


def _dump(obj: Any) -> Any:
    if hasattr(obj, "model_dump"):
        return obj.model_dump(mode="json", exclude_unset=True)
    raise TypeError(f"not serializable: {type(obj).__name__}")


def _echo_tool_choice(tc: Any) -> Any:
    if tc is None or tc in ("auto", "none", "required"):
        return tc or "auto"
    if isinstance(tc, dict) and tc.get("type") == "function" and isinstance(tc.get("name"), str):
        return {"type": "function", "name": tc["name"]}
    if isinstance(tc, dict) and tc.get("type") == "allowed_tools":
        return {"type": "allowed_tools", "mode": tc.get("mode", "auto"),
                "tools": [{"type": "function", "name": t.get("name")} for t in tc.get("tools") or [] if isinstance(t, dict)]}
    return "auto"


def _echo_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    out = []
    for t in tools_to_chat(tools) or []:
        fn = t["function"]
        out.append({"type": "function", "name": fn["name"], "description": fn.get("description"),
                    "parameters": fn.get("parameters"), "strict": fn.get("strict")})
    return out


def _str_metadata(metadata: dict[str, Any] | None) -> dict[str, str] | None:
    if not metadata:
        return None
    return {str(k): v if isinstance(v, str) else json.dumps(v) for k, v in metadata.items()}
