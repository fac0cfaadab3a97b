"""Message normalization: one canonical form to compare histories, one form to feed templates.

Canonical form is what decides monotonicity: role, text, reasoning, tool calls by name and
*parsed* JSON arguments (so ``{"a":1}`` and ``{"a": 1}`` are the same call), and
``tool_call_id``. Everything else a client may attach (``name``, ids of tool calls, echo fields,
vendor extras) is ignored, because it does not change what the model saw on earlier turns — those
tokens are stored, never re-rendered.
"""

from __future__ import annotations

import json
from typing import Any

ECHO_FIELDS = ("prompt_token_ids", "generation_token_ids", "generation_log_probs")
_REASONING_KEYS = ("reasoning_content", "reasoning")


def message_text(content: Any) -> str:
    """OpenAI content (str, None, or a list of parts) as plain text: the parts' texts one per line,
    as vLLM renders them for a template that takes a message's content as a string."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, str):
                parts.append(part)
            elif isinstance(part, dict) and part.get("type") in ("text", "input_text", "output_text"):
                parts.append(part.get("text") or "")
            else:
                raise ValueError(f"unsupported content part: {part!r:.80}")
        return "\n".join(parts)  # as vLLM joins a message's text parts for the template
    raise ValueError(f"unsupported content type: {type(content).__name__}")


def _get(msg: Any, key: str, default: Any = None) -> Any:
    if isinstance(msg, dict):
        return msg.get(key, default)
    return getattr(msg, key, default)


def _reasoning(msg: Any) -> str | None:
    for key in _REASONING_KEYS:
        value = _get(msg, key)
        if value is not None:
            return value
    return None


def _parse_arguments(arguments: Any) -> Any:
    if arguments is None:
        return {}
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except json.JSONDecodeError:
            return arguments  # compared as raw text; still deterministic
    return arguments


def _tool_call_fields(tc: Any) -> tuple[str, Any]:
    fn = _get(tc, "function", tc)
    return _get(fn, "name") or "", _get(fn, "arguments")


def canonical_message(msg: Any) -> dict[str, Any]:
    """The comparison form of an OpenAI chat message (dict or pydantic model)."""
    role = _get(msg, "role")
    out: dict[str, Any] = {"role": role, "content": message_text(_get(msg, "content"))}
    reasoning = _reasoning(msg)
    if reasoning is not None:
        out["reasoning_content"] = reasoning
    tool_calls = _get(msg, "tool_calls") or []
    if tool_calls:
        out["tool_calls"] = [
            {"name": name, "arguments": _parse_arguments(args)}
            for name, args in (_tool_call_fields(tc) for tc in tool_calls)
        ]
    tool_call_id = _get(msg, "tool_call_id")
    if tool_call_id is not None:
        out["tool_call_id"] = tool_call_id
    return out


def render_message(msg: Any) -> dict[str, Any]:
    """The form handed to a chat template, as vLLM hands it.

    Content parts are joined to a string (one per line, as vLLM joins them) and ``None`` becomes ``""`` (templates concatenate
    content), tool-call arguments are parsed to objects (templates apply ``tojson``), the
    ``reasoning`` alias becomes ``reasoning_content``, and the echo fields are dropped.
    """
    if not isinstance(msg, dict):
        msg = msg.model_dump(exclude_none=True) if hasattr(msg, "model_dump") else dict(msg)
    out = {k: v for k, v in msg.items() if k not in ECHO_FIELDS and v is not None}
    out["content"] = message_text(msg.get("content"))
    reasoning = _reasoning(msg)
    out.pop("reasoning", None)
    if reasoning is not None:
        out["reasoning_content"] = reasoning
    if msg.get("tool_calls"):
        calls = []
        for tc in msg["tool_calls"]:
            tc = dict(tc)
            fn = dict(tc.get("function") or {})
            fn["arguments"] = _parse_arguments(fn.get("arguments"))
            tc["function"] = fn
            calls.append(tc)
        out["tool_calls"] = calls
    else:
        out.pop("tool_calls", None)
    return out


def strip_echo(msg: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in msg.items() if k not in ECHO_FIELDS}


_FIELDS = ("role", "content", "tool_calls", "tool_call_id")


def _edge_trimmed(content: Any) -> Any:
    """Text content without whitespace at its ends (``None`` as empty); other content as it is."""
    if content is None:
        return ""
    return content.strip() if isinstance(content, str) else content


WHITESPACE_POLICIES = ("edges", "strict")


def first_difference(
    stored: list[dict[str, Any]], request: list[dict[str, Any]], *, reasoning_policy: str = "keep",
    whitespace_policy: str = "edges",
) -> tuple[int, str] | None:
    """First (index, field) where ``request`` does not extend ``stored``; ``None`` if it does.

    Under ``keep``, reasoning is compared only where the client sent it back: a client that drops
    past reasoning (as most harnesses and Qwen3's own template do) has not edited anything the
    model saw — the stored tokens keep it, exactly as the trainer sees it. ``strict`` compares
    reasoning like any other field (absent counts as empty).

    Under ``whitespace_policy="edges"`` a stored assistant message's content and the request's are
    the same when they differ only by whitespace at their start or end (``null`` and whitespace-only
    included): the stored ids are what the model saw, and a client that re-serializes an answer
    (inspect-ai prefixes a newline to the content of a reasoning-only answer) has edited nothing
    the next prompt is built from. Whitespace inside the content, and every other message, compare
    exactly. ``strict``: exact everywhere.
    """
    if reasoning_policy not in ("keep", "strict"):
        raise ValueError(f"reasoning_policy must be 'keep' or 'strict', not {reasoning_policy!r}")
    if whitespace_policy not in WHITESPACE_POLICIES:
        raise ValueError(f"whitespace_policy must be one of {WHITESPACE_POLICIES}, not {whitespace_policy!r}")
    for i, old in enumerate(stored):
        if i >= len(request):
            return i, "missing"
        new = request[i]
        for key in _FIELDS:
            if old.get(key) != new.get(key):
                if (key == "content" and whitespace_policy == "edges" and old.get("role") == "assistant"
                        and _edge_trimmed(old.get(key)) == _edge_trimmed(new.get(key))):
                    continue
                return i, key
        if old.get("role") == "assistant":
            sent = new.get("reasoning_content")
            if reasoning_policy == "strict":
                if (old.get("reasoning_content") or "") != (sent or ""):
                    return i, "reasoning_content"
            elif sent and sent != (old.get("reasoning_content") or ""):
                return i, "reasoning_content"
    if len(request) == len(stored):
        return len(stored), "new_messages"
    return None
