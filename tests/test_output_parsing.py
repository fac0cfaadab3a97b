"""Generated ids -> assistant message through vLLM's own qwen3 reasoning and hermes tool parsers."""

import json

import pytest

from onpolicy_fixtures import IM_END, TOOLS, encode, tokenizer
from rollout_service.onpolicy import parse_output


def _parse(text, **kw):
    kw.setdefault("tools", TOOLS)
    return parse_output(encode(text) + [IM_END], tokenizer=tokenizer(), **kw)


def test_reasoning_content_and_tool_call():
    out = _parse('<think>\nplan\n</think>\n\nChecking.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>')
    assert out.reasoning_content.strip() == "plan"
    assert out.content.strip() == "Checking."
    (tc,) = out.tool_calls
    assert tc["type"] == "function" and tc["id"].startswith("chatcmpl-tool-")
    assert tc["function"]["name"] == "get_weather"
    assert json.loads(tc["function"]["arguments"]) == {"city": "Oslo"}
    msg = out.to_message()
    assert msg["role"] == "assistant" and msg["tool_calls"] == out.tool_calls


def test_missing_open_think_is_still_reasoning():
    """The generation prompt may already hold <think>: text before </think> is reasoning."""
    out = _parse("plan only\n</think>\n\nAnswer.")
    assert out.reasoning_content.strip() == "plan only" and out.content.strip() == "Answer."


def test_no_think_end_means_all_reasoning_when_thinking_is_on():
    out = _parse("never closed", tools=None)
    assert out.reasoning_content == "never closed" and out.content is None


def test_thinking_disabled_gives_plain_content():
    out = _parse("Answer.", enable_thinking=False, tools=None)
    assert out.reasoning_content is None and out.content == "Answer."


def test_multiple_tool_calls_and_odd_formatting():
    out = _parse('<tool_call>{"arguments":{"q":"a"},"name":"search"}</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "B"}}\n</tool_call>', reasoning_parser=None)
    assert [t["function"]["name"] for t in out.tool_calls] == ["search", "get_weather"]
    assert [json.loads(t["function"]["arguments"]) for t in out.tool_calls] == [{"q": "a"}, {"city": "B"}]


def test_no_parsers_returns_text():
    out = parse_output(encode("plain") + [IM_END], tokenizer=tokenizer(), reasoning_parser=None, tool_parser=None)
    assert out.content == "plain" and out.tool_calls == []


def test_unknown_parser_name_is_an_error():
    with pytest.raises(TypeError):
        parse_output([1], tokenizer=tokenizer(), reasoning_parser="no-such-parser", tool_parser=None)
