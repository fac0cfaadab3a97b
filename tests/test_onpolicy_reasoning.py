"""Templates that drop past reasoning: the next prompt still holds the generated reasoning ids."""

import pytest

from onpolicy_fixtures import IM_END, THINK, Rollout, encode, naive_prompt_ids, template

CASES = [("ours", {"drop_past_reasoning": True}), ("qwen3-reasoning-drop", {}), ("ours", {})]


@pytest.mark.parametrize("tmpl_name,kwargs", CASES)
def test_reasoning_ids_stay_in_the_next_prompt(tmpl_name, kwargs):
    gen = encode("<think>\nThe user wants a number. Seven.\n</think>\n\nSeven.") + [IM_END]
    r = Rollout(template(tmpl_name), kwargs=kwargs, parsers=("qwen3", None))
    r.messages = [{"role": "user", "content": "Pick a number."}]
    first = r.call(gen)
    assert first.assistant["reasoning_content"].strip() == "The user wants a number. Seven."
    # A harness sends the assistant message back without its reasoning.
    r.messages[-1] = {"role": "assistant", "content": first.assistant["content"]}
    r.messages.append({"role": "user", "content": "Another."})
    second = r.call(encode("<think>\nok\n</think>\n\nNine.") + [IM_END])

    assert second.plan.monotonic and not second.plan.new_segment
    p1 = first.plan.prompt_ids
    assert second.plan.prompt_ids[: len(p1) + len(gen)] == p1 + gen
    assert THINK in second.plan.prompt_ids[len(p1):]
    seg = r.state.segments[0]
    assert [t for t, m in zip(seg.token_ids, seg.loss_mask) if m] == gen + second.gen_ids
    if kwargs.get("drop_past_reasoning") or tmpl_name == "qwen3-reasoning-drop":
        r.messages.append({"role": "user", "content": "x"})
        naive = naive_prompt_ids(r.tmpl, r.messages, kwargs=kwargs)
        assert encode("The user wants a number. Seven.")[1:3] not in [naive[i:i + 2] for i in range(len(naive))]


def test_strict_reasoning_policy_counts_dropped_reasoning_as_an_edit():
    from rollout_service.onpolicy import HistoryConflict, build_prompt

    r = Rollout(template("ours"), parsers=("qwen3", None))
    r.messages = [{"role": "user", "content": "Pick."}]
    first = r.call(encode("<think>\nhm\n</think>\n\nSeven.") + [IM_END])
    msgs = r.messages[:-1] + [{"role": "assistant", "content": first.assistant["content"]}, {"role": "user", "content": "Again"}]
    with pytest.raises(HistoryConflict) as err:
        build_prompt(r.state, msgs, template=r.tmpl, history_policy="reject", reasoning_policy="strict")
    assert (err.value.index, err.value.field) == (1, "reasoning_content")
    plan = build_prompt(r.state, msgs, template=r.tmpl, history_policy="reject", reasoning_policy="keep")
    assert plan.monotonic
