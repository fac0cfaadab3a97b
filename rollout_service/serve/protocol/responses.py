"""Responses API dialect: input items -> chat messages, one call's result -> output items.

The on-policy core speaks chat messages; this plug-in maps the Responses item types onto them
(message, reasoning, function_call, function_call_output) so both dialects share one turn algorithm.
NeMo Gym's echo fields ride on the final output item of each call and are carried back onto the
assistant message they belong to.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import ValidationError

from rollout_service.serve.protocol.envelope import bad_request
from rollout_service.serve.protocol.messages import FunctionDef

ECHO_FIELDS = ("prompt_token_ids", "generation_token_ids", "generation_log_probs")


def _text_of(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, p in enumerate(content):
            if not isinstance(p, dict) or p.get("type") not in ("input_text", "output_text", "text") or not isinstance(p.get("text"), str):
                raise bad_request(f"{where}.content[{j}]: only text parts are supported", param=f"{where}.content")
            parts.append(p["text"])
        return "".join(parts)
    raise bad_request(f"{where}.content must be a string or a list of text parts", param=f"{where}.content")


def input_to_messages(inp: str | list[dict[str, Any]], instructions: str | None = None) -> list[dict[str, Any]]:
    """Map Responses input items to chat messages; consecutive model items form one assistant turn."""
    messages: list[dict[str, Any]] = []
    if instructions:
        messages.append({"role": "system", "content": instructions})
    if isinstance(inp, str):
        messages.append({"role": "user", "content": inp})
        return messages

    def assistant() -> dict[str, Any]:
        if messages and messages[-1]["role"] == "assistant" and not messages[-1].get("_closed"):
            return messages[-1]
        msg: dict[str, Any] = {"role": "assistant", "content": ""}
        messages.append(msg)
        return msg

    for i, item in enumerate(inp):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad_request(f"{where} must be an object", param=where)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise bad_request(f"{where}.role must be user, system, developer or assistant", param=f"{where}.role")
            text = _text_of(item.get("content"), where)
            if role == "assistant":
                msg = assistant()
                msg["content"] = (msg.get("content") or "") + text
            else:
                if messages and messages[-1]["role"] == "assistant":
                    messages[-1]["_closed"] = True
                messages.append({"role": "system" if role == "developer" else role, "content": text})
        elif kind == "reasoning":
            summary = item.get("content") or item.get("summary") or []
            if isinstance(summary, list) and any(isinstance(p, dict) and not isinstance(p.get("text", ""), str) for p in summary):
                raise bad_request(f"{where}: reasoning text parts must be strings", param=f"{where}.summary")
            text = "".join(p.get("text", "") for p in summary if isinstance(p, dict)) if isinstance(summary, list) else str(summary)
            msg = assistant()
            msg["reasoning_content"] = (msg.get("reasoning_content") or "") + text
        elif kind == "function_call":
            for key in ("name", "arguments", "call_id"):
                if not isinstance(item.get(key), str):
                    raise bad_request(f"{where}.{key} must be a string", param=f"{where}.{key}")
            msg = assistant()
            msg.setdefault("tool_calls", []).append(
                {"id": item["call_id"], "type": "function", "function": {"name": item["name"], "arguments": item["arguments"]}}
            )
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise bad_request(f"{where}.call_id must be a string", param=f"{where}.call_id")
            if messages and messages[-1]["role"] == "assistant":
                messages[-1]["_closed"] = True
            out = item.get("output")
            messages.append({"role": "tool", "tool_call_id": item["call_id"],
                             "content": out if isinstance(out, str) else json.dumps(out)})
        else:
            raise bad_request(f"{where}.type {kind!r} is not supported", param=f"{where}.type")
        # Echo fields on a model item belong to the assistant turn it is part of (and nowhere else).
        model_item = kind in ("message", "reasoning", "function_call") and messages[-1]["role"] == "assistant"
        echoed = [k for k in ECHO_FIELDS if item.get(k) is not None]
        if echoed and not model_item:
            raise bad_request(f"{where}: echoed token data belongs on the model's output items (assistant message, "
                              "reasoning, function_call)", param=f"{where}.{echoed[0]}", code="invalid_echo")
        if model_item and any(k in item for k in ECHO_FIELDS):
            for k in ECHO_FIELDS:
                if k in item:
                    messages[-1][k] = item[k]
    for m in messages:
        m.pop("_closed", None)
    if not messages or all(m["role"] == "system" for m in messages):
        raise bad_request("input has no message", param="input")
    return messages


def tools_to_chat(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Responses function tools are flat ({type, name, parameters}); chat nests them under `function`."""
    if not tools:
        return None
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") != "function":
            raise bad_request(f"tools[{i}]: only function tools are supported", param=f"tools[{i}]")
        fn = t.get("function") or {k: t[k] for k in ("name", "description", "parameters", "strict") if k in t}
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise bad_request(f"tools[{i}].name is required", param=f"tools[{i}].name")
        try:  # the chat shape's rules: the template and the output parsers take these as typed
            FunctionDef.model_validate(fn)
        except ValidationError as exc:
            err = exc.errors()[0]
            where = ".".join(str(p) for p in err["loc"])
            raise bad_request(f"tools[{i}].{where}: {err['msg']}", param=f"tools[{i}].{where}") from None
        out.append({"type": "function", "function": fn})
    return out


__all__ = ["input_to_messages", "tools_to_chat", "ECHO_FIELDS"]
