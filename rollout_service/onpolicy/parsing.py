"""Generated ids -> assistant message, with vLLM's own reasoning and tool-call parsers.

Using vLLM's parser classes (looked up by name through its parser managers, exactly as
``vllm serve --reasoning-parser ... --tool-call-parser ...`` does) keeps our answers identical to
a vLLM server's for the same ids. The parse only produces the *message*; the ids themselves are
stored untouched, so parsing can never change what the trainer sees.

Qwen3 note: vLLM's ``qwen3`` reasoning parser starts in the reasoning state when thinking is
enabled, so text before ``</think>`` is reasoning even when ``<think>`` is not in the output (the
generation prompt may already contain it), and an output with no ``</think>`` at all is returned
entirely as reasoning. With ``enable_thinking=False`` nothing is treated as reasoning.
"""

from __future__ import annotations

import functools
import uuid
from dataclasses import dataclass, field
from typing import Any


@dataclass
class AssistantOutput:
    content: str | None
    reasoning_content: str | None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    text: str = ""  # the decoded generation the parsers saw
    reasoning_tokens: int | None = None  # the reasoning parser's count of reasoning ids (None: no reasoning parser)

    def to_message(self) -> dict[str, Any]:
        """The OpenAI assistant message (``reasoning_content`` as vLLM names it)."""
        msg: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.reasoning_content is not None:
            msg["reasoning_content"] = self.reasoning_content
        if self.tool_calls:
            msg["tool_calls"] = self.tool_calls
        return msg


@functools.lru_cache(maxsize=32)
def parser_class(reasoning_parser: str | None, tool_parser: str | None, key: "TokenizerKey", strict_level: str = "auto"):
    from vllm.parser.parser_manager import ParserManager

    return ParserManager.get_parser(
        tool_parser_name=tool_parser,
        reasoning_parser_name=reasoning_parser,
        enable_auto_tools=tool_parser is not None,
        tool_strict_level=strict_level,
        tokenizer=key.tok,
    )


def count_reasoning_tokens(gen_ids: list[int], *, tokenizer: Any, reasoning_parser: str,
                           chat_template_kwargs: dict[str, Any] | None = None) -> int:
    """How many generated ids are reasoning, as vLLM's server counts them for
    ``usage.completion_tokens_details.reasoning_tokens``: the call's reasoning parser (built with
    the call's template arguments: thinking on or off) counts them on the ids alone."""
    tok = vllm_tokenizer(tokenizer)
    parser = parser_class(reasoning_parser, None, TokenizerKey(tok))(tok, None, chat_template_kwargs=dict(chat_template_kwargs or {}))
    return int(parser.count_reasoning_tokens(list(gen_ids)))


CACHED_TOKENIZERS: dict[int, Any] = {}


def vllm_tokenizer(tok):
    """vLLM's cached-tokenizer view (memoized per tokenizer object).

    vLLM's parsers read ``tokenizer.get_vocab()`` when they are constructed: ~75 ms for the Qwen
    vocabulary on a plain HF tokenizer, per call. vLLM's server hands them a cached tokenizer; so
    do we, which makes a parse ~1 ms.
    """
    cached = CACHED_TOKENIZERS.get(id(tok))
    if cached is None or cached[0] is not tok:
        from vllm.tokenizers.hf import get_cached_tokenizer

        cached = (tok, get_cached_tokenizer(tok))
        CACHED_TOKENIZERS[id(tok)] = cached
    return cached[1]


class TokenizerKey:
    """Hashable by identity so the lru_cache does not try to hash a tokenizer."""

    def __init__(self, tok):
        self.tok = tok

    def __hash__(self):
        return id(self.tok)

    def __eq__(self, other):
        return isinstance(other, TokenizerKey) and other.tok is self.tok


def parse_output(
    gen_ids: list[int],
    *,
    tokenizer: Any,
    reasoning_parser: str | None = "qwen3",
    tool_parser: str | None = "hermes",
    tools: list[dict] | None = None,
    tool_choice: Any = "auto",
    chat_template_kwargs: dict[str, Any] | None = None,
    enable_thinking: bool | None = None,
    prompt_ids: list[int] | None = None,
    stop_token_ids: frozenset[int] | set[int] | None = None,
    parallel_tool_calls: bool | None = None,
    strict_level: str = "auto",
    stop_string: tuple[str, bool] | None = None,
) -> AssistantOutput:
    """Split generated ids into content, reasoning and OpenAI-shaped tool calls.

    ``enable_thinking`` (or ``chat_template_kwargs["enable_thinking"]``) must match what the
    prompt was rendered with: vLLM's qwen3 parser decides from it whether output starts inside
    reasoning. ``prompt_ids`` lets parsers that inspect the prompt (an open ``<think>`` at its
    end) see it, as vLLM's server does. Like vLLM's detokenizer, a final stop token (by default
    any special token, e.g. ``<|im_end|>``) is not part of the parsed text; it stays in the ids.
    ``stop_string`` (the stop string that ended the generation, whether it stays in the text): the
    text is cut where vLLM's detokenizer cuts it (:func:`stop_string_end`) before it is parsed; the
    ids stay whole.
    """
    gen_ids = [int(t) for t in gen_ids]
    tokenizer = vllm_tokenizer(tokenizer)
    if stop_token_ids is None:
        stop_token_ids = set(getattr(tokenizer, "all_special_ids", []) or [])
    text_ids = gen_ids[:-1] if gen_ids and gen_ids[-1] in stop_token_ids else gen_ids
    kwargs = dict(chat_template_kwargs or {})
    if enable_thinking is not None:
        kwargs["enable_thinking"] = enable_thinking
    parser_cls = None
    if reasoning_parser or tool_parser:
        parser_cls = parser_class(reasoning_parser, tool_parser, TokenizerKey(tokenizer), strict_level)
    request = _call_request(tools, tool_choice, parallel_tool_calls, chat_template_kwargs=kwargs or None)
    if parser_cls is None:
        text = generation_text(tokenizer, text_ids, True, stop_string)
        return AssistantOutput(content=text, reasoning_content=None, tool_calls=[], text=text)
    parser = parser_cls(tokenizer, request.tools, chat_template_kwargs=kwargs)
    request = parser.adjust_request(request)
    text = generation_text(tokenizer, text_ids, request.skip_special_tokens, stop_string)
    if prompt_ids is not None:
        parser.set_prompt_token_ids(prompt_ids)
    reasoning, content, calls = parser.parse(
        text, request, enable_auto_tools=tool_parser is not None, model_output_token_ids=gen_ids
    )
    tool_calls = [
        {
            "id": c.id or f"chatcmpl-tool-{uuid.uuid4().hex[:16]}",
            "type": "function",
            "function": {"name": c.name, "arguments": c.arguments},
        }
        for c in (calls or [])
    ]
    counted = parser.count_reasoning_tokens(gen_ids) if reasoning_parser else None
    return AssistantOutput(content=content, reasoning_content=reasoning, tool_calls=tool_calls, text=text,
                           reasoning_tokens=counted)


def stop_string_end(text: str, before: int, stop: str, include: bool) -> int:
    """Where vLLM's detokenizer ends the text of a generation that a stop string ended: at the start
    of the stop string (at its end with ``include_stop_str_in_output``). The match is the one the
    last step completed, searched from ``before`` (the length of the text before that step) less
    all but one of the stop string's characters; the characters of the last token after the match
    are cut too (the ids keep the token)."""
    at = text.find(stop, max(0, before + 1 - len(stop)))
    if at < 0:  # not in this text (a stop string matched across a migration seam): nothing to cut
        return len(text)
    return at + len(stop) if include else at


def generation_text(tokenizer: Any, ids: list[int], skip_special_tokens: bool,
                    stop_string: tuple[str, bool] | None = None) -> str:
    """The text of generated ``ids`` as vLLM returns it: cut at the stop string that ended them."""
    text = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    if stop_string is None or not ids:
        return text
    # The text before the last token, less a trailing half character (the detokenizer holds those
    # bytes back, so the last token's text starts with the whole character).
    before = len(tokenizer.decode(ids[:-1], skip_special_tokens=skip_special_tokens).rstrip("\ufffd"))
    return text[:stop_string_end(text, before, *stop_string)]


def structured_outputs_for(
    *,
    tokenizer: Any,
    reasoning_parser: str | None,
    tool_parser: str | None,
    tools: list[dict] | None,
    tool_choice: Any = "auto",
    parallel_tool_calls: bool | None = None,
    response_format: dict[str, Any] | None = None,
    strict_level: str = "auto",
    max_json_whitespace: int | None = None,
    structured_outputs: dict[str, Any] | None = None,
) -> dict[str, Any] | None:
    """The grammar vLLM's own server would sample this call under, as ``StructuredOutputsParams``
    fields (``None``: unconstrained).

    The same decision as ``vllm serve``: the tool parser's native tool-call format as an xgrammar
    structural tag when the parser has one (Hermes / Qwen: ``<tool_call>{...}</tool_call>``) for a
    forced ``tool_choice``, for ``parallel_tool_calls: false``, for strict tools or a raised
    ``strict_level``; vLLM's JSON-schema form for parsers without one; ``response_format``
    otherwise (or combined with the tool calls' tag for ``tool_choice: auto``); the request's own
    ``structured_outputs`` (vLLM's field) as vLLM merges it with ``response_format``.
    ``max_json_whitespace`` bounds the whitespace between JSON tokens inside a structural tag (the
    engine's ``disable_any_whitespace`` does not reach into tags; a weak policy fills an unbounded
    one with newlines). Raises
    ``pydantic.ValidationError`` / ``ValueError`` for a ``response_format`` vLLM refuses.
    """
    if not tools and response_format is None and structured_outputs is None:
        return None
    if tools and tool_choice not in (None, "auto", "none"):
        # A forced call's arguments follow the tool's parameters schema (as in the JSON form), unless
        # the tool says ``strict: false``: vLLM pins a schema only for strict tools.
        tools = [_strict_unless_said(t) for t in tools]
    tokenizer = vllm_tokenizer(tokenizer)
    extra = {} if structured_outputs is None else {"structured_outputs": structured_outputs}
    request = _call_request(tools, tool_choice, parallel_tool_calls, response_format=response_format, **extra)
    if tool_parser and tools:
        parser = parser_class(reasoning_parser, tool_parser, TokenizerKey(tokenizer), strict_level)(tokenizer, request.tools)
        request = parser.adjust_request(request)
    out = _params_dict(request.extract_structured_outputs())
    if out is None:
        return None
    if max_json_whitespace is not None and out.get("structural_tag"):
        out["structural_tag"] = _bound_json_whitespace(out["structural_tag"], max_json_whitespace)
    return out


def completion_structured_outputs(structured_outputs: dict[str, Any] | None) -> dict[str, Any] | None:
    """A completions request's ``structured_outputs`` as vLLM's server reads it (its request model's
    rules: one kind of constraint, a valid structural tag), as ``StructuredOutputsParams`` fields.
    Raises ``pydantic.ValidationError`` / ``ValueError`` where vLLM answers 400."""
    if structured_outputs is None:
        return None
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    request = CompletionRequest(model="rollout-service", prompt="-", structured_outputs=structured_outputs)
    return _params_dict(request.extract_structured_outputs())


def vllm_error_param(exc: Exception) -> str | None:
    """The ``param`` vLLM's server names for a request its models refused with ``exc``: the
    parameter a ``VLLMValidationError`` names (raised as is through pydantic: none, if it names
    none), else the first error's location under ``body``."""
    from vllm.exceptions import VLLMValidationError

    if isinstance(exc, VLLMValidationError):
        return exc.parameter
    from vllm.entrypoints.serve.exception_handling.handlers.validation import clean_loc_for_param

    errors = exc.errors() if callable(getattr(exc, "errors", None)) else []
    if not errors:
        return None  # vLLM's error response for any other refusal names no parameter
    for err in errors:
        inner = (err.get("ctx") or {}).get("error")
        if isinstance(inner, VLLMValidationError) and inner.parameter:
            return inner.parameter
    return clean_loc_for_param(("body", *(err_loc for err_loc in errors[0].get("loc") or ())))


_PARAMS_FIELDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag", "whitespace_pattern")
_PARAMS_FLAGS = ("disable_any_whitespace", "disable_additional_properties")


def _params_dict(params) -> dict[str, Any] | None:
    """vLLM's ``StructuredOutputsParams`` as the fields the engine takes back (what is set)."""
    if params is None:
        return None
    out = {f: getattr(params, f) for f in _PARAMS_FIELDS if getattr(params, f) is not None}
    out.update({f: True for f in _PARAMS_FLAGS if getattr(params, f)})
    return out


def _bound_json_whitespace(tag: str, limit: int) -> str:
    import json

    def visit(node: Any) -> None:
        if isinstance(node, dict):
            if node.get("type") == "json_schema" and node.get("max_whitespace_cnt") is None:
                node["max_whitespace_cnt"] = limit
            for v in node.values():
                visit(v)
        elif isinstance(node, list):
            for v in node:
                visit(v)

    spec = json.loads(tag)
    visit(spec)
    return json.dumps(spec)


@functools.lru_cache(maxsize=16)
def tool_parser_raises_strictness(tool_parser: str | None) -> bool:
    """Whether vLLM's tool parser of this name constrains calls beyond the request's own asks (its
    ``default_tool_strict_level``); if not, a free call (tool_choice auto, no strict tool) has no
    grammar and ``structured_outputs_for`` need not be asked."""
    if not tool_parser:
        return False
    from vllm.tool_parsers import ToolParserManager

    return getattr(ToolParserManager.get_tool_parser(tool_parser), "default_tool_strict_level", None) is not None


def _call_request(tools, tool_choice, parallel_tool_calls, **fields):
    """vLLM's request model for one call, as its parsers see it: the tool fields and ``fields``
    (messages are irrelevant to parsing and to the grammar decision)."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    return ChatCompletionRequest(
        model="rollout-service",
        messages=[{"role": "user", "content": ""}],
        tools=tools or None,
        tool_choice=(tool_choice if tools else "none") if tool_choice is not None else None,
        parallel_tool_calls=parallel_tool_calls,
        **fields,
    )


def _strict_unless_said(tool: dict) -> dict:
    fn = tool.get("function")
    if not isinstance(fn, dict) or fn.get("strict") is not None:
        return tool
    return {**tool, "function": {**fn, "strict": True}}
