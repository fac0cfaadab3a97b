"""FastAPI ingress: validates OpenAI requests, routes them by rollout id, formats the answers.

Holds no rollout state. Every client mistake becomes an OpenAI error envelope with a 4xx here or
in the affinity replica, before anything is stored.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from rollout_service.config import RolloutServiceConfig
from rollout_service.protocol.openai import (
    ChatCompletionRequest,
    CompletionRequest,
    NamedToolChoice,
    ResponsesRequest,
    ServiceError,
    TokenizeRequest,
    bad_request,
)
from rollout_service.protocol.responses import input_to_messages, output_items, response_object, tools_to_chat

ROLLOUT_HEADER = "x-rollout-id"


def error_response(exc: ServiceError) -> JSONResponse:
    return JSONResponse(exc.envelope(), status_code=exc.status)


def _validation_error(exc: ValidationError) -> ServiceError:
    err = exc.errors()[0]
    loc = ".".join(str(p) for p in err.get("loc", ()) if p not in ("body",))
    return bad_request(f"{loc}: {err.get('msg')}" if loc else str(err.get("msg")), param=loc or None)


def create_app() -> FastAPI:
    """The FastAPI app; error envelopes for FastAPI's own errors (unknown route, wrong method)."""
    app = FastAPI(title="rollout-service", version="0.1.0")

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse({"error": {"message": str(exc.detail), "type": kind, "param": None, "code": None}},
                            status_code=exc.status_code)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        return JSONResponse(bad_request(str(exc.errors()[:1])).envelope(), status_code=400)

    return app


async def read_model(request: Request, model_cls: type[BaseModel], max_bytes: int) -> BaseModel:
    body = await request.body()
    if len(body) > max_bytes:
        raise ServiceError(413, f"request body larger than {max_bytes} bytes", code="request_too_large")
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise bad_request(f"request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise bad_request("request body must be a JSON object")
    try:
        return model_cls.model_validate(data)
    except ValidationError as exc:
        raise _validation_error(exc) from None


def rollout_id_of(request: Request, metadata: dict | None) -> str | None:
    rid = request.headers.get(ROLLOUT_HEADER)
    if rid is None and metadata:
        rid = metadata.get("rollout_id")
    if rid is not None and not isinstance(rid, str):
        raise bad_request("metadata.rollout_id must be a string", param="metadata.rollout_id")
    return rid


def tool_choice_payload(tools: list[dict] | None, tool_choice: Any) -> dict[str, Any]:
    """vLLM's meaning of tool_choice: none -> no parsing; required / named -> structured outputs."""
    if tool_choice is None or tool_choice == "auto":
        return {}
    if tool_choice == "none":
        return {"parse_tools": False}
    if isinstance(tool_choice, NamedToolChoice) or isinstance(tool_choice, dict):
        name = tool_choice.function["name"] if isinstance(tool_choice, NamedToolChoice) else (
            (tool_choice.get("function") or {}).get("name") or tool_choice.get("name"))
        fn = next(t["function"] for t in tools or [] if t["function"]["name"] == name)
        schema = fn.get("parameters") or {"type": "object"}
        return {"structured_outputs": {"json": schema}, "forced_tool": {"name": name}}
    if tool_choice == "required":
        variants = [
            {"type": "object", "properties": {"name": {"type": "string", "enum": [t["function"]["name"]]},
                                              "parameters": t["function"].get("parameters") or {"type": "object"}},
             "required": ["name", "parameters"]}
            for t in tools or []
        ]
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": variants}}
        return {"structured_outputs": {"json": schema}, "forced_tool": {"name": None}}
    raise bad_request(f"unsupported tool_choice {tool_choice!r}", param="tool_choice")


def chat_payload(req: ChatCompletionRequest, rollout_id: str | None, policy: str | None) -> dict[str, Any]:
    tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
    payload: dict[str, Any] = {
        "rollout_id": rollout_id,
        "messages": [m.to_plain() for m in req.messages],
        "tools": tools,
        "chat_template_kwargs": req.chat_template_kwargs,
        "sampling": req.sampling_kwargs(),
        "max_tokens": req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens,
        "top_logprobs": req.top_logprobs if req.logprobs else 0,
        "stream": req.stream,
    }
    if policy:
        payload["history_policy"] = policy
    payload.update(tool_choice_payload(tools, req.tool_choice))
    return payload


def _token_str(tokenizer_strs: dict[int, str] | None, tid: int, as_ids: bool) -> str:
    return f"token_id:{tid}" if as_ids or tokenizer_strs is None else tokenizer_strs.get(tid, "")


def chat_logprobs(final_or_delta: dict[str, Any], token_strs: dict[int, str], as_ids: bool) -> dict[str, Any]:
    tops = final_or_delta.get("top_logprobs") or [None] * len(final_or_delta["token_ids"])
    content = []
    for tid, lp, top in zip(final_or_delta["token_ids"], final_or_delta["logprobs"], tops):
        tok = _token_str(token_strs, tid, as_ids)
        content.append({
            "token": tok, "logprob": lp, "bytes": list(tok.encode()),
            "top_logprobs": [{"token": _token_str(token_strs, t, as_ids), "logprob": v, "bytes": list(_token_str(token_strs, t, as_ids).encode())}
                             for t, v in (top or {}).items()],
        })
    return {"content": content}


def chat_completion_body(final: dict[str, Any], req: ChatCompletionRequest, model: str, token_strs: dict[int, str]) -> dict[str, Any]:
    msg = final["message"]
    message: dict[str, Any] = {"role": "assistant", "content": msg.get("content") or None}
    if msg.get("reasoning_content"):
        message["reasoning_content"] = msg["reasoning_content"]
    if msg.get("tool_calls"):
        message["tool_calls"] = msg["tool_calls"]
    message.update({
        "prompt_token_ids": final["prompt_token_ids"],
        "generation_token_ids": final["generation_token_ids"],
        "generation_log_probs": final["generation_log_probs"],
        "weight_versions": final["weight_versions"],
        "rollout": final["rollout"],
    })
    choice: dict[str, Any] = {"index": 0, "message": message, "finish_reason": final["finish_reason"],
                              "stop_reason": final.get("stop_reason"), "logprobs": None}
    if req.logprobs:
        choice["logprobs"] = chat_logprobs(
            {"token_ids": final["generation_token_ids"], "logprobs": final["generation_log_probs"],
             "top_logprobs": final.get("top_logprobs")}, token_strs, bool(req.return_tokens_as_token_ids))
    body: dict[str, Any] = {
        "id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
        "model": model, "choices": [choice], "usage": final["usage"],
    }
    if req.return_token_ids:
        body["prompt_token_ids"] = final["prompt_token_ids"]
        choice["token_ids"] = final["generation_token_ids"]
    return body


def sse(data: dict[str, Any] | str) -> bytes:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n".encode()
