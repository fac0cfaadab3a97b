"""Edited histories (problem 3): fork a new exact segment, or reject naming the first difference."""

import pytest

from onpolicy_fixtures import IM_END, TOOLS, Rollout, encode, template
from rollout_service.onpolicy import HistoryConflict, build_prompt


def _three_turns(tools=None):
    r = Rollout(template("ours"), tools=tools)
    r.messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "One?"}]
    r.call(encode("One.") + [IM_END])
    if tools:
        r.messages[-1] = {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "search", "arguments": '{"q": "two"}'}}]}
        r.state.segments[0].messages[-1] = {"role": "assistant", "content": "", "tool_calls": [{"name": "search", "arguments": {"q": "two"}}]}
        r.messages.append({"role": "tool", "tool_call_id": "c1", "content": "two is 2"})
    else:
        r.messages.append({"role": "user", "content": "Two?"})
    r.call(encode("Two.") + [IM_END])
    return r


@pytest.mark.parametrize(
    "edit,index,field",
    [
        ("summarize", 1, "content"),
        ("truncate", 1, "content"),  # first exchange dropped: message 1 is now "Two?"
        ("system", 0, "content"),
        ("tool_result", 3, "content"),
        ("drop_tail", 4, "missing"),
        ("retry", 3, "missing"),
    ],
)
def test_edit_forks_or_rejects(edit, index, field):
    r = _three_turns(tools=TOOLS if edit == "tool_result" else None)
    msgs = [dict(m) for m in r.messages]
    if edit == "summarize":
        msgs = [msgs[0], {"role": "user", "content": "Summary: asked one and two."}] + [{"role": "user", "content": "Three?"}]
    elif edit == "truncate":
        msgs = [msgs[0]] + msgs[3:] + [{"role": "user", "content": "Three?"}]
    elif edit == "system":
        msgs[0]["content"] = "Be verbose."
        msgs.append({"role": "user", "content": "Three?"})
    elif edit == "tool_result":
        msgs[3]["content"] = "two is II"
        msgs.append({"role": "user", "content": "Three?"})
    elif edit == "drop_tail":
        msgs = msgs[:4]
    elif edit == "retry":
        msgs = msgs[:3]  # the same request again, without the assistant answer
    with pytest.raises(HistoryConflict) as err:
        build_prompt(r.state, msgs, tools=r.tools, template=r.tmpl, history_policy="reject")
    assert (err.value.index, err.value.field) == (index, field)
    assert err.value.status == 409 and str(index) in err.value.message

    before = [list(s.token_ids) for s in r.state.segments]
    call = r.call(encode("Three.") + [IM_END], messages=msgs)
    assert call.plan.new_segment and not call.plan.monotonic
    assert call.plan.segment_index == 1 and call.plan.conflict.field == field
    assert call.plan.prompt_ids == r.tmpl.prompt_ids(
        [__import__("rollout_service.onpolicy", fromlist=["render_message"]).render_message(m) for m in msgs],
        tools=r.tools, chat_template_kwargs=None)
    assert [list(s.token_ids) for s in r.state.segments[:1]] == before
    seg = r.state.segments[1]
    assert seg.token_ids == call.plan.prompt_ids + call.gen_ids
    assert [t for t, m in zip(seg.token_ids, seg.loss_mask) if m] == call.gen_ids
    assert seg.turns[0].turn == 3 and not seg.turns[0].monotonic

    # The fork is now the current segment: the next call is monotonic on it.
    r.messages.append({"role": "user", "content": "Four?"})
    nxt = r.call(encode("Four.") + [IM_END])
    assert nxt.plan.monotonic and nxt.plan.segment_index == 1


def test_changed_tools_count_as_an_edit():
    r = _three_turns()
    msgs = r.messages + [{"role": "user", "content": "Three?"}]
    with pytest.raises(HistoryConflict) as err:
        build_prompt(r.state, msgs, tools=TOOLS, template=r.tmpl, history_policy="reject")
    assert (err.value.index, err.value.field) == (None, "tools")


def test_extra_fields_and_content_parts_are_not_edits():
    r = _three_turns()
    msgs = [dict(m) for m in r.messages]
    msgs[1] = {"role": "user", "content": [{"type": "text", "text": "One?"}], "name": "alice"}
    msgs[2] = {**msgs[2], "refusal": None, "annotations": []}
    msgs.append({"role": "user", "content": "Three?"})
    plan = build_prompt(r.state, msgs, template=r.tmpl, history_policy="reject")
    assert plan.monotonic


def test_finish_turn_refuses_a_plan_built_on_a_stale_state():
    from rollout_service.onpolicy import finish_turn

    r = _three_turns()
    msgs = r.messages + [{"role": "user", "content": "Three?"}]
    plan = build_prompt(r.state, msgs, template=r.tmpl)
    r.call(encode("x") + [IM_END], messages=msgs)
    with pytest.raises(HistoryConflict):
        finish_turn(r.state, plan, gen_ids=[1], logprobs=[0.0], finish_reason="stop", assistant_message={"role": "assistant", "content": "x"})
