"""What constrains a call's sampling, and how a constrained output is read back.

The grammar vLLM's server would use (:meth:`Constraints.grammar`: the tool parser's own tool-call
format for a forced ``tool_choice``, ``response_format``, strict tools), or — for a forced call
sampled as bare JSON (``chat.forced_tool_call_format: json``, or no tool parser) — a JSON schema
over the tools' parameters (:func:`forced_json_schema`) whose output :func:`parse_forced` reads.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from rollout_service.config import RolloutServiceConfig
from rollout_service.onpolicy.parsing import structured_outputs_for, tool_parser_raises_strictness, vllm_error_param
from rollout_service.serve.protocol.envelope import ServiceError, bad_request
from rollout_service.serve.turn_types import TurnRequest


class Constraints:
    """The replica's grammar policy, from the ``chat`` section of the config and the tokenizer."""

    def __init__(self, config: RolloutServiceConfig, tokenizer):
        self.config = config
        self.tokenizer = tokenizer

    def json_forced(self, req: TurnRequest) -> bool:
        """A forced tool call sampled as bare JSON (``chat.forced_tool_call_format: json``, or no
        tool parser to give the model's own format), parsed as JSON rather than by the tool parser."""
        ec = self.config.chat
        return req.tool_choice.forced and (ec.forced_tool_call_format == "json" or not ec.tool_parser)

    def grammar(self, req: TurnRequest) -> dict[str, Any] | None:
        """The grammar vLLM's server would use for this call: the tool parser's own tool-call format
        (structural tag) for a forced ``tool_choice``, ``response_format``, strict tools."""
        if not req.tools and req.response_format is None and req.structured_outputs is None:
            return None
        ec = self.config.chat
        if (req.response_format is None and req.structured_outputs is None and req.tool_choice.mode in ("auto", "none") and ec.tool_strict_level == "auto"
                and req.parallel_tool_calls is not False
                and not any((t.get("function") or {}).get("strict") is True for t in req.tools or [])
                and not tool_parser_raises_strictness(ec.tool_parser)):
            return None  # vLLM's rule, without building its request: nothing constrains a free call
        from vllm.exceptions import VLLMClientError

        try:
            return structured_outputs_for(
                tokenizer=self.tokenizer, reasoning_parser=ec.reasoning_parser,
                tool_parser=ec.tool_parser if req.tool_choice.mode != "none" else None,
                tools=req.tools, tool_choice=vllm_tool_choice(req), parallel_tool_calls=req.parallel_tool_calls,
                response_format=req.response_format, strict_level=ec.tool_strict_level,
                max_json_whitespace=1 if self.config.engine.compact_structured_json else None,
                structured_outputs=req.structured_outputs)
        except (ValueError, TypeError, VLLMClientError) as exc:  # pydantic's ValidationError is a ValueError;
            # vLLM's own (a json_schema format without a schema: "none are specified")
            if req.structured_outputs is not None:  # named as vLLM's server names it
                raise bad_request(f"structured_outputs: {_first_error(exc)}", param=vllm_error_param(exc)) from None
            raise bad_request(f"response_format: {_first_error(exc)}", param="response_format",
                              code="invalid_response_format") from None


async def name_the_grammar(chunks, req: TurnRequest):
    """The engine refusing a constrained call is its grammar (a schema it cannot compile): name it."""
    try:
        async for chunk in chunks:
            yield chunk
    except ServiceError as exc:
        if exc.code == "engine_rejected_request" and exc.param is None:
            exc.param = ("response_format" if req.response_format is not None else
                         "structured_outputs" if req.structured_outputs is not None else "tools")
        raise
    finally:
        await chunks.aclose()  # an abandoned call cancels its engine request at once


def grammar_from_start(req: TurnRequest, structured: dict[str, Any] | None) -> bool:
    """Whether the grammar constrains the first generated token. Only ``tool_choice: auto`` under
    a triggered tag (strict tools, parallel_tool_calls false) leaves the text before a call free."""
    if not structured:
        return False
    tag = structured.get("structural_tag")
    if req.tool_choice.mode == "auto" and tag:
        try:
            return json.loads(tag).get("format", {}).get("type") not in ("triggered_tags", "token_triggered_tags")
        except (ValueError, AttributeError):
            return True
    return True


def vllm_tool_choice(req: TurnRequest) -> Any:
    tc = req.tool_choice
    if tc.mode == "named":
        return {"type": "function", "function": {"name": tc.name}}
    return tc.mode


def _first_error(exc: Exception) -> str:
    errors = getattr(exc, "errors", None)
    if callable(errors):
        try:
            err = errors()[0]
            where = ".".join(str(p) for p in err.get("loc") or ())
            return f"{where}: {err['msg']}" if where else str(err["msg"])
        except Exception:  # noqa: BLE001 - fall back to the message
            pass
    return " ".join(str(exc).split())[:300]


def forced_json_schema(req: TurnRequest) -> dict[str, Any] | None:
    """The JSON form of a forced tool_choice: structured outputs over the tool's parameters."""
    tc = req.tool_choice
    if not tc.forced:
        return None
    tools = req.tools or []
    if tc.mode == "named":
        fn = next(t["function"] for t in tools if t["function"]["name"] == tc.name)
        return {"json": fn.get("parameters") or {"type": "object"}}
    variants = [
        {"type": "object", "properties": {"name": {"type": "string", "enum": [t["function"]["name"]]},
                                          "parameters": t["function"].get("parameters") or {"type": "object"}},
         "required": ["name", "parameters"]}
        for t in tools
    ]
    return {"json": {"type": "array", "minItems": 1, "items": {"anyOf": variants}}}


def parse_forced(text: str, tc) -> dict[str, Any]:
    """Output of a structured-output forced tool call: arguments (named) or a list of calls (required)."""
    def call(name: str, args: Any) -> dict[str, Any]:
        return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                "function": {"name": name, "arguments": args if isinstance(args, str) else json.dumps(args)}}

    base = {"role": "assistant", "content": "", "reasoning_content": None}
    try:
        if tc.mode == "named":
            json.loads(text)
            return {**base, "tool_calls": [call(tc.name, text.strip())]}
        items = json.loads(text)
        calls = [call(it["name"], it.get("parameters", it.get("arguments", {}))) for it in items]
    except (ValueError, KeyError, TypeError, AttributeError):  # cut off by max_tokens: the text, no call
        return {**base, "content": text}
    return {**base, "tool_calls": calls} if calls else {**base, "content": text}
