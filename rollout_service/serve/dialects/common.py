"""What the dialects share: rollout headers, the one ``tool_choice`` path, SSE framing."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import Header, Path, Request
from openai.types.completion_usage import CompletionUsage
from pydantic import BaseModel

from rollout_service.serve.errors import http_error
from rollout_service.serve.protocol.envelope import ServiceError, bad_request
from rollout_service.serve.token_texts import LOGPROB_FLOOR
from rollout_service.serve.turn_types import ToolChoice
from rollout_service.store.base import ROLLOUT_ID_MAX_LEN, ROLLOUT_ID_PATTERN, InvalidRolloutId, validate_rollout_id

HISTORY_POLICIES = ("fork", "reject")
IDEMPOTENCY_KEY_MAX_LEN = 255


@dataclass
class RolloutHeaders:
    """The rollout headers of a request, validated (a FastAPI dependency, so OpenAPI lists them)."""

    rollout_id: str | None
    history_policy: str | None
    idempotency_key: str | None
    rollout_group: str | None = None
    max_staleness: int | None = None

    def with_body_rollout_id(self, metadata: dict[str, Any] | None) -> "RolloutHeaders":
        """The rollout id from ``metadata.rollout_id`` when no header named one (headers win)."""
        if self.rollout_id is not None or not metadata or "rollout_id" not in metadata:
            return self
        return RolloutHeaders(valid_rollout_id(metadata["rollout_id"], "metadata.rollout_id"), self.history_policy,
                              self.idempotency_key, self.rollout_group, self.max_staleness)


# The documented rules of rollout ids and these headers as JSON Schema, for the OpenAPI schema only:
# the checks themselves are valid_rollout_id and rollout_headers, so a violation is the 400 naming
# the parameter, not pydantic's message.
_ROLLOUT_ID_SCHEMA = {"pattern": ROLLOUT_ID_PATTERN, "minLength": 1, "maxLength": ROLLOUT_ID_MAX_LEN}
RolloutIdPath = Annotated[str, Path(json_schema_extra=_ROLLOUT_ID_SCHEMA)]  # /v1/rollouts/{rollout_id}


def rollout_headers(
    x_rollout_id: Annotated[str | None, Header(description="The rollout this call belongs to (same id for every call "
                                                           "of an episode). Routes the call to the replica that owns it. "
                                                           "X-Session-ID is accepted as its alias (the SkyRL / prime-rl / "
                                                           "vllm-router convention); sent with X-Rollout-Id, it must "
                                                           "name the same rollout (400 otherwise).",
                                               json_schema_extra=_ROLLOUT_ID_SCHEMA)] = None,
    # The alias is left out of the OpenAPI schema: one header per parameter there, so a client built
    # from the schema (or a fuzzer) never sends two that disagree; X-Rollout-Id's description names it.
    x_session_id: Annotated[str | None, Header(include_in_schema=False)] = None,
    x_history_policy: Annotated[str | None, Header(description="fork (default) or reject: what an edited history does.",
                                                   json_schema_extra={"enum": list(HISTORY_POLICIES)})] = None,
    idempotency_key: Annotated[str | None, Header(description="A retry with the same key returns the stored answer of "
                                                              "the first call instead of running again.",
                                                  json_schema_extra={"minLength": 1,
                                                                     "maxLength": IDEMPOTENCY_KEY_MAX_LEN})] = None,
    x_rollout_group: Annotated[str | None, Header(description="The group a rollout belongs to (GRPO: the rollouts of "
                                                              "one prompt), readable at GET /v1/groups/{id} (each call "
                                                              "under it records the member's state). With n > 1: the "
                                                              "group the call's members form (default: the rollout id). "
                                                              "Under routing.group_placement together, a group's "
                                                              "rollouts start on the same engine (its prompt prefix "
                                                              "cached once). Same rules as a rollout id.",
                                                  json_schema_extra=_ROLLOUT_ID_SCHEMA)] = None,
    x_max_staleness: Annotated[str | None, Header(description="This call's staleness bound (overrides "
                                                              "rollouts.max_staleness): the call is admitted only while "
                                                              "the rollout's oldest generated token is at most this many "
                                                              "refits behind the version served now; beyond it, 409 "
                                                              "rollout_stale and nothing is generated or stored.",
                                                  json_schema_extra={"type": "integer", "minimum": 0})] = None,
) -> RolloutHeaders:
    rid = valid_rollout_id(x_rollout_id, "X-Rollout-Id") if x_rollout_id is not None else None
    sid = valid_rollout_id(x_session_id, "X-Session-ID") if x_session_id is not None else None
    if rid is not None and sid is not None and rid != sid:
        raise bad_request("X-Rollout-Id and X-Session-ID name different rollouts; send one", param="X-Session-ID")
    policy = x_history_policy.strip().lower() if x_history_policy is not None else None
    if policy is not None and policy not in HISTORY_POLICIES:
        raise bad_request(f"X-History-Policy must be one of {', '.join(HISTORY_POLICIES)}, got {x_history_policy!r}",
                          param="X-History-Policy", code="invalid_history_policy")
    if idempotency_key is not None and not (0 < len(idempotency_key) <= IDEMPOTENCY_KEY_MAX_LEN):
        raise bad_request(f"Idempotency-Key must be 1 to {IDEMPOTENCY_KEY_MAX_LEN} characters", param="Idempotency-Key")
    group = valid_rollout_id(x_rollout_group, "X-Rollout-Group") if x_rollout_group is not None else None
    staleness = None
    if x_max_staleness is not None:
        text = x_max_staleness.strip()
        if not text.isdigit() or not text.isascii():
            raise bad_request(f"X-Max-Staleness must be a whole number of versions (0 or more), got {x_max_staleness!r}",
                              param="X-Max-Staleness")
        staleness = int(text)
    return RolloutHeaders(rid if rid is not None else sid, policy, idempotency_key, group, staleness)


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


async def unicode_body(request: Request) -> None:
    """A JSON string can spell a lone UTF-16 surrogate (``"\\ud800"``): valid JSON, but no text —
    it cannot be tokenized, stored, hashed or even quoted back in an error. 400 before anything
    uses it. Only a body that spells a surrogate at all (an emoji from an ``ensure_ascii`` client
    spells a pair) pays for the full check. An app-wide dependency (FastAPI caches the body)."""
    body = await request.body()
    if not _SURROGATE_ESCAPE.search(body):
        return
    try:
        json.dumps(json.loads(body), ensure_ascii=False).encode()
    except UnicodeEncodeError:
        raise bad_request("the request body contains a lone UTF-16 surrogate (\\ud800-\\udfff without its pair), "
                          "which is not text", code="invalid_unicode") from None
    except (ValueError, RecursionError):  # not JSON (or too deep to re-check): the body's own validation decides
        pass


def valid_rollout_id(value: Any, param: str) -> str:
    try:
        return validate_rollout_id(value)
    except InvalidRolloutId as exc:
        raise http_error(exc, param=param) from None


def optional_rollout_id(value: str | None, param: str = "X-Rollout-Id") -> str | None:
    """A call's rollout id, checked (``None``: a stateless call)."""
    return valid_rollout_id(value, param) if value is not None else None


def tool_choice_of(raw: Any, tools: list[dict[str, Any]] | None, *, param: str = "tool_choice") -> ToolChoice:
    """Any dialect's ``tool_choice`` (already shape-checked by its request model) as one ToolChoice.

    Chat: "auto" | "none" | "required" | {"type": "function", "function": {"name"}} |
    {"type": "allowed_tools", "allowed_tools": {"mode", "tools": [...]}}. Responses: the same
    strings | {"type": "function", "name"} | {"type": "allowed_tools", "mode", "tools"}.
    Hosted tools (file_search, web_search, ...) are not served here: 400.
    """
    if isinstance(raw, BaseModel):
        raw = raw.model_dump(exclude_none=True)
    names = [t["function"]["name"] for t in tools or []]
    if raw is None or raw == "auto":
        return ToolChoice("auto")
    if raw == "none":
        return ToolChoice("none")
    if raw == "required":
        if not names:
            raise bad_request("tool_choice 'required' needs tools", param=param)
        return ToolChoice("required")
    if isinstance(raw, dict):
        kind = raw.get("type")
        if kind == "function":
            name = (raw.get("function") or {}).get("name") if isinstance(raw.get("function"), dict) else raw.get("name")
            if not isinstance(name, str) or name not in names:
                raise bad_request(f"tool_choice names function {name!r}, which is not in tools", param=param)
            return ToolChoice("named", name=name)
        if kind == "allowed_tools":
            spec = raw.get("allowed_tools") if isinstance(raw.get("allowed_tools"), dict) else raw
            mode, listed = spec.get("mode", "auto"), spec.get("tools")
            if mode not in ("auto", "required") or not isinstance(listed, list) or not listed:
                raise bad_request("allowed_tools needs mode 'auto' or 'required' and a non-empty list of tools", param=param)
            allowed = []
            for i, t in enumerate(listed):
                fn = t.get("function") if isinstance(t, dict) else None
                name = (t.get("name") or (fn.get("name") if isinstance(fn, dict) else None)) if isinstance(t, dict) else None
                if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(name, str) or name not in names:
                    raise bad_request(f"allowed_tools.tools[{i}] must be a function tool named in tools", param=param)
                allowed.append(name)
            return ToolChoice("required" if mode == "required" else "auto", allowed=tuple(dict.fromkeys(allowed)))
        raise bad_request(f"tool_choice of type {kind!r} is not supported: only function tools are served here",
                          param=param, code="unsupported_tool_choice")
    raise bad_request(f"unsupported tool_choice {raw!r}", param=param)


def allowed_tools(tools: list[dict[str, Any]] | None, choice: ToolChoice) -> list[dict[str, Any]] | None:
    """The tools the prompt lists: all of them, or the ``allowed_tools`` subset."""
    if not tools or choice.allowed is None:
        return tools
    return [t for t in tools if t["function"]["name"] in choice.allowed]


def sse(data: dict[str, Any] | str) -> bytes:
    return f"data: {data if isinstance(data, str) else json.dumps(data, separators=(',', ':'))}\n\n".encode()


def sse_json(payload: str) -> bytes:
    return b"data: " + payload.encode() + b"\n\n"


def error_event(exc: ServiceError) -> bytes:
    return sse(exc.envelope())




def clamped(logprob: float | None) -> float | None:
    return logprob if logprob is None else max(logprob, LOGPROB_FLOOR)


def usage_of(result: Any, *, stream: bool = False) -> CompletionUsage:
    """vLLM's usage: with every detail key (null unless known) in an answer, the counts alone in a
    stream's usage chunk; ``completion_tokens_details.reasoning_tokens`` when a reasoning parser counted."""
    details = ({"reasoning_tokens": result.reasoning_tokens}
               if getattr(result, "reasoning_tokens", None) is not None else None)
    if stream:
        return CompletionUsage(**result.usage, **({"completion_tokens_details": details} if details else {}))
    return CompletionUsage(**result.usage, prompt_tokens_details=None, completion_tokens_details=details)


def continuous_usage(req: Any) -> bool:
    """``stream_options.continuous_usage_stats`` (with ``include_usage``, as vLLM reads it) on a stream."""
    options = req.stream_options or {}
    return bool(req.stream and options.get("include_usage") and options.get("continuous_usage_stats"))


class RunningUsage:
    """vLLM's usage on every streamed chunk (``continuous_usage_stats``): the prompt's ids, the ids
    generated so far and, on chat with a reasoning parser, its count of reasoning ids so far."""

    def __init__(self, first: Any):
        self.prompt = len(getattr(first, "prompt_token_ids", None) or [])
        self.completion = 0
        self.reasoning = 0 if getattr(first, "reasoning_tokens", None) is not None else None

    def add(self, delta: Any) -> None:
        self.completion += len(delta.token_ids)
        if getattr(delta, "reasoning_tokens", None) is not None:
            self.reasoning = delta.reasoning_tokens

    def usage(self, chat: bool) -> CompletionUsage:
        details = {"reasoning_tokens": self.reasoning} if chat and self.reasoning is not None else None
        return CompletionUsage(prompt_tokens=self.prompt, completion_tokens=self.completion,
                               total_tokens=self.prompt + self.completion,
                               **({"completion_tokens_details": details} if details else {}))

    def final(self, result: Any, chat: bool) -> CompletionUsage:
        """The last chunk's: the call's own counts."""
        self.prompt, self.completion = result.usage["prompt_tokens"], result.usage["completion_tokens"]
        if getattr(result, "reasoning_tokens", None) is not None:
            self.reasoning = result.reasoning_tokens
        return self.usage(chat)


def token_str(strs: dict[int, str] | None, tid: int, as_ids: bool) -> str:
    return f"token_id:{tid}" if as_ids or strs is None else strs.get(tid, "")


def token_logprobs(ids, lps, tops, strs: list[dict[int, str]] | None, as_ids: bool = False,
                   k: int | None = None) -> list[dict[str, Any]]:
    """OpenAI's per-token logprob entries (token, logprob, UTF-8 bytes, alternatives), the shape of
    chat's ``logprobs.content`` and of Responses' ``output_text.logprobs``. The alternatives are
    vLLM's: the sampled token first, then the others by rank, ``k`` in all (all there are if None)."""
    out = []
    positions = strs if strs is not None else [None] * len(ids)
    for tid, lp, top, pos in zip(ids, lps, tops or [None] * len(ids), positions):
        tok = token_str(pos, tid, as_ids)
        ranked = [(tid, lp), *((t, v) for t, v in (top or {}).items() if t != tid)] if top else []
        alts = [{"token": (s := token_str(pos, t, as_ids)), "logprob": clamped(v), "bytes": list(s.encode("utf-8", "replace"))}
                for t, v in ranked[:k if k is not None else len(ranked)]]
        out.append({"token": tok, "logprob": clamped(lp), "bytes": list(tok.encode("utf-8", "replace")), "top_logprobs": alts})
    return out
