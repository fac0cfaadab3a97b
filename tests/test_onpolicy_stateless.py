"""Stateless mode (NeMo Gym echo fields): same prompt ids as the stateful path; edits detected."""

import pytest

from onpolicy_fixtures import IM_END, TOOLS, Rollout, encode, template
from rollout_service.onpolicy import HistoryConflict, build_prompt, state_from_echo


def _stateful(tmpl_name="ours", tools=None):
    r = Rollout(template(tmpl_name), tools=tools, parsers=(None, "hermes") if tools else (None, None))
    r.messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "One?"}]
    r.call(encode(" Skinny") + [IM_END])
    r.messages.append({"role": "user", "content": "Two?"})
    r.call(encode("cut without end"))
    r.messages.append({"role": "user", "content": "Three?"})
    r.call(encode("Three.") + [IM_END])
    r.messages.append({"role": "user", "content": "Four?"})
    return r


def _echoed(r):
    """The client's view: each assistant message carries the ids of its call."""
    out, k = [], 0
    for m in r.messages:
        m = dict(m)
        if m["role"] == "assistant":
            c = r.calls[k]
            m.update(prompt_token_ids=c.plan.prompt_ids, generation_token_ids=c.gen_ids, generation_log_probs=[-0.5] * len(c.gen_ids))
            k += 1
        out.append(m)
    return out


@pytest.mark.parametrize("tmpl_name", ["ours", "qwen3-reasoning-drop", "hermes-tools", "chatml"])
def test_stateless_prompt_equals_stateful_prompt(tmpl_name):
    r = _stateful(tmpl_name)
    stateful = build_prompt(r.state, r.messages, template=r.tmpl)
    state, clean = state_from_echo(_echoed(r), template=r.tmpl)
    assert all("prompt_token_ids" not in m for m in clean)
    stateless = build_prompt(state, clean, template=r.tmpl, history_policy="reject")
    assert stateless.prompt_ids == stateful.prompt_ids
    assert stateless.monotonic and not stateless.new_segment
    assert state.segments[0].token_ids == r.state.segments[0].token_ids
    assert state.segments[0].loss_mask == r.state.segments[0].loss_mask


def test_no_echo_means_no_state():
    state, clean = state_from_echo([{"role": "user", "content": "hi"}], template=template("ours"))
    assert state is None and clean == [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("edit_index,field_index", [(1, 0), (3, 3), (0, 0)])
def test_edit_before_last_echo_is_detected(edit_index, field_index):
    r = _stateful()
    msgs = _echoed(r)
    msgs[edit_index] = {**msgs[edit_index], "content": "EDITED"}
    state, clean = state_from_echo(msgs, template=r.tmpl)
    with pytest.raises(HistoryConflict) as err:
        build_prompt(state, clean, template=r.tmpl, history_policy="reject")
    assert err.value.field == "echo" and err.value.index == field_index
    plan = build_prompt(state, clean, template=r.tmpl, history_policy="fork")
    assert plan.new_segment and not plan.monotonic
    assert plan.prompt_ids == r.tmpl.prompt_ids(clean, tools=None, chat_template_kwargs=None)


def test_edited_assistant_message_is_detected_with_a_parser():
    r = _stateful()
    msgs = _echoed(r)
    msgs[2] = {**msgs[2], "content": "I never said that"}
    parse = lambda ids: {"role": "assistant", "content": r.parse(ids)["content"]}  # noqa: E731
    state, clean = state_from_echo(msgs, template=r.tmpl, parse=parse)
    with pytest.raises(HistoryConflict) as err:
        build_prompt(state, clean, template=r.tmpl, history_policy="reject")
    assert (err.value.index, err.value.field) == (2, "content")


def test_truncated_history_with_echo_forks():
    r = _stateful()
    msgs = _echoed(r)
    truncated = [msgs[0]] + msgs[5:]  # drop the first two exchanges, keep the last echoed call
    state, clean = state_from_echo(truncated, template=r.tmpl)
    plan = build_prompt(state, clean, template=r.tmpl)
    assert plan.new_segment and plan.conflict.field == "echo"
