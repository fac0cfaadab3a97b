"""A required token prefix (NeMo Gym's ``required_prefix_token_ids``): the prompt is the prefix, kept
bit-exact, + the template's tail for the messages after the last assistant message — the same prompt
a stored rollout builds from its own ids."""

import pytest

from onpolicy_fixtures import IM_END, TOOLS, Rollout, decode, encode, naive_prompt_ids, template, tokenizer
from rollout_service.onpolicy import (
    InvalidPrefix,
    PrefixNotContinuable,
    RolloutState,
    UnsupportedConversation,
    checked_prefix,
    finish_turn,
    plan_on_prefix,
)

VOCAB = 151_936


def _skinny():
    """Two ids whose text re-tokenizes to one id (the real Qwen merge "Skinny")."""
    merged = encode(" Skinny")
    a, b = encode(" Skin"), encode("ny")
    assert len(merged) == 1 and len(a) == 1 and len(b) == 1
    return a + b, merged


@pytest.mark.parametrize("name", ["ours", "hermes-tools", "qwen2.5-instruct", "qwen3-all-assistant", "qwen3-reasoning-drop"])
@pytest.mark.parametrize("eot", [True, False], ids=["ended", "cut"])
def test_prefix_prompt_is_the_stored_rollouts_prompt(name, eot):
    """The prefix is the previous call's prompt + generation: the plan equals the stored turn's."""
    split, _ = _skinny()
    gen = encode("Hello") + split + encode(" jeans") + ([IM_END] if eot else [])
    r = Rollout(template(name))
    r.messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    first = r.call(gen, finish_reason="stop" if eot else "length")
    r.messages.append({"role": "user", "content": "And then?"})
    prefix = first.plan.prompt_ids + gen
    plan = plan_on_prefix(prefix, r.messages, template=r.tmpl)
    stored = r.call(encode("ok") + [IM_END]).plan
    assert plan.prompt_ids == stored.prompt_ids
    assert plan.prompt_ids[: len(prefix)] == prefix
    assert plan.new_segment and plan.added_prompt_ids == plan.prompt_ids and plan.monotonic


def test_merge_sensitive_ids_are_kept_where_a_re_render_merges_them():
    split, merged = _skinny()
    tmpl = template("ours")
    messages = [{"role": "user", "content": "Describe the jeans."}]
    prompt = tmpl.prompt_ids(messages, tools=None, chat_template_kwargs=None)
    gen = split + encode(" jeans.") + [IM_END]
    assistant = {"role": "assistant", "content": decode(split + encode(" jeans."))}
    messages += [assistant, {"role": "user", "content": "More."}]
    plan = plan_on_prefix(prompt + gen, messages, template=tmpl)
    assert plan.prompt_ids[: len(prompt) + len(gen)] == prompt + gen
    naive = naive_prompt_ids(tmpl, messages)
    assert merged[0] in naive and split[0] not in naive  # what re-tokenizing the text would have sent
    assert decode(plan.prompt_ids[len(prompt) + len(gen):]) == "\n<|im_start|>user\nMore.<|im_end|>\n<|im_start|>assistant\n"


def test_prefix_cut_before_end_of_turn_is_closed_like_the_template():
    tmpl = template("ours")
    messages = [{"role": "user", "content": "Go."}]
    prefix = tmpl.prompt_ids(messages, tools=None, chat_template_kwargs=None) + encode("Half a sente")
    messages += [{"role": "assistant", "content": "Half a sente"}, {"role": "user", "content": "Continue."}]
    plan = plan_on_prefix(prefix, messages, template=tmpl)
    assert decode(plan.prompt_ids[len(prefix):]) == "<|im_end|>\n<|im_start|>user\nContinue.<|im_end|>\n<|im_start|>assistant\n"


def test_tool_turn_continues_the_prefix_with_the_tool_result():
    r = Rollout(template("ours"), tools=TOOLS, parsers=("qwen3", "hermes"))
    r.messages = [{"role": "user", "content": "Weather in Paris?"}]
    gen = encode('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>') + [IM_END]
    first = r.call(gen)
    call_id = r.messages[-1]["tool_calls"][0]["id"]
    r.messages.append({"role": "tool", "tool_call_id": call_id, "content": "sunny"})
    plan = plan_on_prefix(first.plan.prompt_ids + gen, r.messages, template=r.tmpl, tools=TOOLS)
    assert plan.prompt_ids == r.call(encode("Sunny.") + [IM_END]).plan.prompt_ids


def test_finish_turn_stores_the_prefix_as_prompt_of_a_new_segment():
    tmpl = template("ours")
    messages = [{"role": "user", "content": "Go."}]
    prefix = tmpl.prompt_ids(messages, tools=None, chat_template_kwargs=None) + encode("Done.") + [IM_END]
    messages += [{"role": "assistant", "content": "Done."}, {"role": "user", "content": "Next."}]
    plan = plan_on_prefix(prefix, messages, template=tmpl)
    gen = encode("ok") + [IM_END]
    delta = finish_turn(RolloutState("r"), plan, gen_ids=gen, logprobs=[-0.1] * len(gen), finish_reason="stop",
                        assistant_message={"role": "assistant", "content": "ok"})
    state = delta.apply(RolloutState("r"))
    seg = state.segments[0]
    assert seg.token_ids == plan.prompt_ids + gen
    assert seg.loss_mask == [0] * len(plan.prompt_ids) + [1] * len(gen)
    assert [m["role"] for m in seg.messages] == ["user", "assistant", "user", "assistant"]


@pytest.mark.parametrize("value, why", [
    ("1,2", "must be a list"),
    ([1, True], "entry 1 must be an integer token id, got bool"),
    ([1, 2.0], "entry 1 must be an integer token id, got float"),
    ([1, "2"], "entry 1 must be an integer token id, got str"),
    ([5, -1], "entry 1 is -1, outside the vocabulary"),
    ([VOCAB], "entry 0 is 151936, outside the vocabulary [0, 151936)"),
])
def test_malformed_prefix_is_refused_naming_the_entry(value, why):
    with pytest.raises(InvalidPrefix) as exc:
        checked_prefix(value, VOCAB)
    assert why in str(exc.value) and exc.value.code == "invalid_required_prefix" and exc.value.status == 400


def test_absent_or_empty_prefix_is_no_constraint():
    assert checked_prefix(None, VOCAB) is None and checked_prefix([], VOCAB) is None
    assert checked_prefix([0, VOCAB - 1], VOCAB) == [0, VOCAB - 1]


def test_messages_without_an_assistant_message_cannot_continue_a_prefix():
    with pytest.raises(PrefixNotContinuable, match="no assistant message"):
        plan_on_prefix([1, 2, 3], [{"role": "user", "content": "Hi"}], template=template("ours"))


def test_messages_ending_with_the_assistant_message_have_nothing_to_continue_with():
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]
    with pytest.raises(PrefixNotContinuable, match="no new message") as exc:
        plan_on_prefix([1, 2, 3], msgs, template=template("ours"))
    assert exc.value.index == 1


def test_echo_on_the_last_assistant_message_must_be_the_prefix():
    tmpl = template("ours")
    prompt = tmpl.prompt_ids([{"role": "user", "content": "Hi"}], tools=None, chat_template_kwargs=None)
    gen = encode("Yo") + [IM_END]
    msgs = [{"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Yo", "prompt_token_ids": prompt, "generation_token_ids": gen},
            {"role": "user", "content": "Again"}]
    assert plan_on_prefix(prompt + gen, msgs, template=tmpl).prompt_ids[: len(prompt + gen)] == prompt + gen
    with pytest.raises(PrefixNotContinuable, match=f"differ from required_prefix_token_ids .* at position {len(prompt)}") as exc:
        plan_on_prefix(prompt + encode("No") + [IM_END], msgs, template=tmpl)
    assert exc.value.index == 1


def test_template_that_cannot_express_the_new_messages_is_a_400_naming_it():
    tmpl = template("chatml")
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"},
            {"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(UnsupportedConversation, match="chatml"):
        plan_on_prefix(encode("Hi Yo"), msgs, template=tmpl)


def test_the_prefix_is_not_mutated():
    tmpl = template("ours")
    prefix = tmpl.prompt_ids([{"role": "user", "content": "Hi"}], tools=None, chat_template_kwargs=None) + [IM_END]
    before = list(prefix)
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": ""}, {"role": "user", "content": "x"}]
    plan = plan_on_prefix(prefix, msgs, template=tmpl)
    plan.prompt_ids.append(0)
    assert prefix == before and tokenizer() is tmpl.tokenizer
