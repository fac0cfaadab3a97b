"""Any HF template: exact continuity on every shared real-world template, or a clear error.

Every ChatTemplate here is built with check_window=True: each tail is also derived from a full
render of the history and must be identical to the bounded-window tail.
"""

import pytest

from onpolicy_fixtures import IM_END, TOOLS, Rollout, all_template_names, assert_spliced, encode, template
from rollout_service.onpolicy import UnsupportedConversation, build_prompt, render_message

# Conversations with tools that these templates cannot express, and why (docs/onpolicy.md).
NO_TOOLS = {
    "chatml": "does not render tools",
    "gemma-it": "does not render tools",
    "llama-3-instruct": "does not render tools",
    "mistral-instruct": "does not render tools",
    "phi-3": "does not render tools",
    "zephyr": "does not render tools",
    "granite-3.0-instruct": "drops message",  # renders `tools` but silently skips role 'tool'
}


def _chat(r):
    r.messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    calls = [r.call(encode("Hello!") + [IM_END])]
    r.messages.append({"role": "user", "content": "More"})
    calls.append(r.call(encode("Sure, cut sho")))  # no end-of-turn (max_tokens)
    r.messages.append({"role": "user", "content": "Again"})
    calls.append(r.call(encode("Ok") + [IM_END]))
    r.messages.append({"role": "user", "content": "Last"})
    calls.append(r.call(encode("Bye") + [IM_END]))
    return calls


def _tools(r):
    r.messages = [{"role": "user", "content": "Weather in Paris?"}]
    calls = [r.call(encode('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>') + [IM_END])]
    r.messages.append({"role": "tool", "tool_call_id": "c1", "name": "get_weather", "content": "sunny"})
    r.messages.append({"role": "tool", "tool_call_id": "c2", "name": "search", "content": "21C"})
    calls.append(r.call(encode("It is sunny and 21")))  # no end-of-turn
    r.messages.append({"role": "user", "content": "Thanks"})
    calls.append(r.call(encode("Bye") + [IM_END]))
    return calls


@pytest.mark.parametrize("name", all_template_names())
@pytest.mark.parametrize("kind", ["chat", "tools"])
def test_monotonic_turns_are_exact_or_clearly_refused(name, kind):
    tools = TOOLS if kind == "tools" else None
    r = Rollout(template(name), tools=tools, parsers=(None, "hermes") if tools else (None, None))
    if kind == "tools" and name in NO_TOOLS:
        with pytest.raises(UnsupportedConversation, match=NO_TOOLS[name]) as err:
            _tools(r)
        assert err.value.status == 400
        return
    calls = _chat(r) if kind == "chat" else _tools(r)
    for prev, cur in zip(calls, calls[1:]):
        assert_spliced(r, prev, cur)
        assert cur.plan.added_prompt_ids, "every tail holds at least the new message"
    seg = r.state.segments[0]
    assert len(r.state.segments) == 1
    assert [t for t, m in zip(seg.token_ids, seg.loss_mask) if m] == [t for c in calls for t in c.gen_ids]
    assert seg.token_ids[: len(calls[0].plan.prompt_ids)] == r.tmpl.prompt_ids(
        [render_message(m) for m in r.messages[: len(calls[0].plan.messages)]], tools=tools, chat_template_kwargs=None
    )


@pytest.mark.parametrize("name", ["chatml", "gemma-it", "llama-3-instruct", "mistral-instruct", "phi-3", "zephyr"])
def test_alternation_templates_refuse_two_user_messages_in_a_row(name):
    msgs = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(UnsupportedConversation, match="alternate"):
        build_prompt(None, msgs, template=template(name))


@pytest.mark.parametrize("name", ["chatml", "llama-3-instruct", "phi-3", "zephyr"])
def test_alternation_templates_refuse_a_tool_message_in_the_tail(name):
    r = Rollout(template(name))
    r.messages = [{"role": "user", "content": "a"}]
    r.call(encode("b") + [IM_END])
    r.messages.append({"role": "tool", "tool_call_id": "x", "content": "r"})
    with pytest.raises(UnsupportedConversation, match="alternate"):
        r.call(encode("c") + [IM_END])


def test_hermes_tool_message_without_name_is_refused():
    r = Rollout(template("hermes-tools"), tools=TOOLS, parsers=(None, "hermes"))
    r.messages = [{"role": "user", "content": "w?"}]
    r.call(encode('<tool_call>\n{"name": "search", "arguments": {"q": "w"}}\n</tool_call>') + [IM_END])
    r.messages.append({"role": "tool", "tool_call_id": "c1", "content": "sunny"})
    with pytest.raises(UnsupportedConversation, match="name"):
        r.call(encode("ok") + [IM_END])


def test_template_dropping_past_tool_calls_is_refused_on_a_fresh_render():
    msgs = [
        {"role": "user", "content": "w?"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]},
        {"role": "tool_response", "content": "sunny"},
        {"role": "user", "content": "so?"},
    ]
    with pytest.raises(UnsupportedConversation, match="tool calls of message 1"):
        build_prompt(None, msgs, tools=TOOLS, template=template("granite-3.0-instruct"))


def test_prefix_instability_is_real_for_some_templates():
    """Why tails are rendered, not diffed: for these templates render(M[:k]) is not a prefix of render(M)."""
    msgs = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "a", "reasoning_content": "r"},
        {"role": "user", "content": "q2"},
        {"role": "assistant", "content": "a2", "reasoning_content": "r2"},
        {"role": "user", "content": "q3"},
    ]
    unstable = []
    for name in ["qwen3-reasoning-drop", "qwen3-all-assistant", "ours"]:
        t = template(name)
        kw = {"drop_past_reasoning": True} if name == "ours" else None
        short = t.render(msgs[:2], tools=None, add_generation_prompt=False, chat_template_kwargs=kw)
        full = t.render(msgs, tools=None, add_generation_prompt=True, chat_template_kwargs=kw)
        if not full.startswith(short):
            unstable.append(name)
    assert sorted(unstable) == sorted(["qwen3-reasoning-drop", "qwen3-all-assistant", "ours"])


@pytest.mark.parametrize("name", all_template_names())
@pytest.mark.parametrize("final", ["The answer is", "  spaced  ", ""])
def test_an_open_prompt_is_cut_where_transformers_cuts_it(name, final):
    """``add_generation_prompt: false`` / ``continue_final_message`` (stateless chat, as vLLM's
    server): the text is transformers' own ``apply_chat_template`` text for the same messages, on
    every shared template (those that keep the final message's spacing and those that strip it), or
    the same refusal."""
    from onpolicy_fixtures import tokenizer
    from rollout_service.onpolicy.turn import build_open_prompt

    t = template(name, check_window=False)
    messages = [{"role": "user", "content": "What is it?"}, {"role": "assistant", "content": final}]
    hf = tokenizer()
    extra = {"bos_token": "<|endoftext|>"} if name == "mistral-instruct" else {}  # as template() gives it
    for cont in (False, True):
        try:
            want = hf.apply_chat_template(messages, chat_template=t.source, tokenize=False,
                                          add_generation_prompt=False, continue_final_message=cont, **extra)
        except Exception as exc:  # transformers refuses (the final message's text does not show): so do we
            with pytest.raises(UnsupportedConversation):
                build_open_prompt(messages, template=t, continue_final_message=cont)
            print(name, cont, "refused:", exc)
            continue
        plan = build_open_prompt(messages, template=t, continue_final_message=cont)
        assert plan.prompt_text == want
        assert plan.prompt_ids == encode(want)
