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


def test_an_answer_sent_back_with_whitespace_at_its_edges_is_not_an_edit():
    """inspect-ai re-serializes a reasoning-only answer (content empty) with content "\\n"; other
    clients trim or pad. Under the default whitespace_policy (edges) the turn stays monotonic;
    strict keeps the exact rule."""
    from rollout_service.onpolicy import HistoryConflict, build_prompt

    r = Rollout(template("ours"), parsers=("qwen3", None))
    r.messages = [{"role": "user", "content": "Think only."}]
    first = r.call(encode("<think>\nhm\n</think>\n\n") + [IM_END])
    assert (first.assistant["content"] or "").strip() == ""
    reasoning = first.assistant["reasoning_content"]
    for content in ("\n", None, " \n\t"):
        msgs = [r.messages[0], {"role": "assistant", "content": content, "reasoning_content": reasoning},
                {"role": "user", "content": "Go on."}]
        plan = build_prompt(r.state, msgs, template=r.tmpl, history_policy="reject")
        assert plan.monotonic and not plan.new_segment
        assert plan.prompt_ids[: len(r.state.segments[0].token_ids)] == r.state.segments[0].token_ids
    msgs = [r.messages[0], {"role": "assistant", "content": "\n", "reasoning_content": reasoning},
            {"role": "user", "content": "Go on."}]
    with pytest.raises(HistoryConflict) as err:
        build_prompt(r.state, msgs, template=r.tmpl, history_policy="reject", whitespace_policy="strict")
    assert (err.value.index, err.value.field) == (1, "content")


def test_whitespace_inside_an_answer_or_in_a_user_message_is_still_an_edit():
    from rollout_service.onpolicy import HistoryConflict, build_prompt

    r = Rollout(template("ours"))
    r.messages = [{"role": "user", "content": "Count."}]
    first = r.call(encode("One and two.") + [IM_END])
    content = first.assistant["content"]
    assert content.strip() == "One and two."
    padded = [r.messages[0], {"role": "assistant", "content": f"\n{content} "}, {"role": "user", "content": "More."}]
    assert build_prompt(r.state, padded, template=r.tmpl, history_policy="reject").monotonic
    inner = [r.messages[0], {"role": "assistant", "content": content.replace("and", " and")},
             {"role": "user", "content": "More."}]
    with pytest.raises(HistoryConflict) as err:
        build_prompt(r.state, inner, template=r.tmpl, history_policy="reject")
    assert (err.value.index, err.value.field) == (1, "content")
    user = [{"role": "user", "content": "Count. "}, {"role": "assistant", "content": content},
            {"role": "user", "content": "More."}]
    with pytest.raises(HistoryConflict) as err:
        build_prompt(r.state, user, template=r.tmpl, history_policy="reject")
    assert (err.value.index, err.value.field) == (0, "content")
