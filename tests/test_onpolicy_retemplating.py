"""Problem 2 (re-chat-templating): a tool call formatted unlike the template survives bit-exact and
still parses to the right name and arguments."""

import json

import pytest

from onpolicy_fixtures import IM_END, TOOLS, Rollout, encode, naive_prompt_ids, template

ODD_TOOL_CALLS = {
    "key_order_no_spaces": '<tool_call>\n{"arguments":{"days":3,"city":"Paris"},"name":"get_weather"}\n</tool_call>',
    "no_newlines": '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}</tool_call>',
    "extra_whitespace": '<tool_call>\n  {  "name" :  "get_weather" ,\n "arguments" : { "city" : "Paris" , "days" : 3 } }\n</tool_call>',
    "content_then_call": 'Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"days": 3, "city": "Paris"}}\n</tool_call>',
}


@pytest.mark.parametrize("tmpl_name", ["ours", "qwen2.5-instruct", "qwen3-all-assistant", "hermes-tools"])
@pytest.mark.parametrize("style", sorted(ODD_TOOL_CALLS))
def test_odd_tool_call_format_survives_and_parses(tmpl_name, style):
    gen = encode(ODD_TOOL_CALLS[style]) + [IM_END]
    r = Rollout(template(tmpl_name), tools=TOOLS, parsers=(None, "hermes"))
    r.messages = [{"role": "user", "content": "Weather in Paris for 3 days?"}]
    first = r.call(gen)

    calls = first.assistant["tool_calls"]
    assert [c["function"]["name"] for c in calls] == ["get_weather"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris", "days": 3}
    assert calls[0]["type"] == "function" and calls[0]["id"]

    r.messages.append({"role": "tool", "tool_call_id": calls[0]["id"], "name": "get_weather", "content": "sunny, 21C"})
    second = r.call(encode("Sunny.") + [IM_END])
    p1 = first.plan.prompt_ids
    assert second.plan.monotonic
    assert second.plan.prompt_ids[: len(p1) + len(gen)] == p1 + gen
    naive = naive_prompt_ids(r.tmpl, r.messages[:-1], tools=TOOLS)
    assert naive[: len(p1) + len(gen)] != p1 + gen


def test_client_reserializing_arguments_is_not_an_edit():
    gen = encode(ODD_TOOL_CALLS["key_order_no_spaces"]) + [IM_END]
    r = Rollout(template("ours"), tools=TOOLS, parsers=(None, "hermes"))
    r.messages = [{"role": "user", "content": "Weather?"}]
    first = r.call(gen)
    echoed = dict(first.assistant)
    tc = echoed["tool_calls"][0]
    args = json.loads(tc["function"]["arguments"])
    echoed["tool_calls"] = [{**tc, "function": {"name": "get_weather", "arguments": json.dumps(dict(reversed(list(args.items()))), indent=2)}}]
    echoed["content"] = None
    r.messages[-1] = echoed
    r.messages.append({"role": "tool", "tool_call_id": tc["id"], "content": "sunny"})
    second = r.call(encode("ok") + [IM_END])
    assert second.plan.monotonic and not second.plan.new_segment
