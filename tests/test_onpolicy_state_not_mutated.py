"""The pure core never mutates a RolloutState it is given, nor returns an object aliasing one.

Why it matters: the store cache (``store/cache.py``) hands every caller the cached state object
itself, without copying (a copy would cost O(history) per turn). That is only sound if nothing the
data plane runs on that object writes into it — directly, or later through a plan, delta, export or
replay that shares one of its lists or dicts. Every core entry point is wrapped here: the state is
deep-compared before and after, and no list, dict or dataclass reachable from the output may be one
reachable from the state.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest

import onpolicy_fixtures
from onpolicy_fixtures import IM_END, TOOLS, Rollout, all_template_names, encode, template
from rollout_service.onpolicy import HistoryConflict, build_prompt, finish_turn, state_from_echo
from rollout_service.onpolicy.replay import replay_turn, stored_answer
from rollout_service.onpolicy.trajectory import trajectory_export
from test_onpolicy_stateless import _echoed, _stateful
from test_onpolicy_templates import NO_TOOLS, _chat, _tools


def containers(obj, seen: dict[int, object] | None = None) -> dict[int, object]:
    """Every mutable container reachable from ``obj`` (lists, dicts, sets, dataclass instances)."""
    seen = {} if seen is None else seen
    if isinstance(obj, (list, dict, set)) or dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        if id(obj) in seen:
            return seen
        seen[id(obj)] = obj
    if isinstance(obj, dict):
        for k, v in obj.items():
            containers(k, seen)
            containers(v, seen)
    elif isinstance(obj, (list, tuple, set, frozenset)):
        for v in obj:
            containers(v, seen)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            containers(getattr(obj, f.name), seen)
    return seen


class Checked:
    """Wraps a core function taking the state first; records every call it checked."""

    def __init__(self, fn):
        self.fn = fn
        self.calls = 0

    def __call__(self, state, *args, **kwargs):
        if state is None:
            return self.fn(state, *args, **kwargs)
        # Run on a copy that shares nothing with the request, as a state loaded from a store does
        # (the fixtures' driver applies deltas without a store, so its state holds request objects).
        state = copy.deepcopy(state)
        before = copy.deepcopy(state)
        inside = containers(state)
        self.calls += 1
        try:
            out = self.fn(state, *args, **kwargs)
        finally:
            assert state == before, f"{self.fn.__name__} mutated the state"
            assert state.pending_conflict == before.pending_conflict and state.incarnation == before.incarnation
        shared = set(inside) & set(containers(out))
        assert not shared, f"{self.fn.__name__} returned objects of the state: {[inside[i] for i in shared][:3]}"
        return out


@pytest.fixture
def checked(monkeypatch):
    """The fixtures' rollout driver calls the core through these wrappers."""
    wrapped = {"build_prompt": Checked(build_prompt), "finish_turn": Checked(finish_turn)}
    for name, fn in wrapped.items():
        monkeypatch.setattr(onpolicy_fixtures, name, fn)
    return wrapped


def _export_and_replay_leave_it_alone(state):
    Checked(trajectory_export)(state)
    for seg in state.segments:
        for rec in seg.turns:
            rec.answer = stored_answer({"role": "assistant", "content": "x", "tool_calls": [{"id": "c", "function": {}}]})
    for t in range(1, state.turn + 1):
        Checked(replay_turn)(state, t)


@pytest.mark.parametrize(
    "name,kind", [(n, "chat") for n in all_template_names()] + [(n, "tools") for n in all_template_names() if n not in NO_TOOLS]
)
def test_monotonic_turns_leave_the_state_alone(checked, name, kind):
    tools = TOOLS if kind == "tools" else None
    r = Rollout(template(name), tools=tools, parsers=(None, "hermes") if tools else (None, None))
    calls = _chat(r) if kind == "chat" else _tools(r)
    assert checked["build_prompt"].calls == checked["finish_turn"].calls == len(calls)
    _export_and_replay_leave_it_alone(r.state)


@pytest.mark.parametrize("tmpl_name,kwargs", [("ours", {"drop_past_reasoning": True}), ("qwen3-reasoning-drop", {})])
def test_reasoning_turns_leave_the_state_alone(checked, tmpl_name, kwargs):
    r = Rollout(template(tmpl_name), kwargs=kwargs, parsers=("qwen3", None))
    r.messages = [{"role": "user", "content": "Pick a number."}]
    first = r.call(encode("<think>\nSeven.\n</think>\n\nSeven.") + [IM_END])
    r.messages[-1] = {"role": "assistant", "content": first.assistant["content"]}  # reasoning dropped
    r.messages.append({"role": "user", "content": "Another."})
    r.call(encode("<think>\nok\n</think>\n\nNine.") + [IM_END])
    assert checked["build_prompt"].calls == 2
    _export_and_replay_leave_it_alone(r.state)


def test_fork_and_reject_leave_the_state_alone(checked):
    r = Rollout(template("ours"))
    r.messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "One?"}]
    r.call(encode("One.") + [IM_END])
    r.messages.append({"role": "user", "content": "Two?"})
    r.call(encode("Two.") + [IM_END])
    edited = [dict(m) for m in r.messages]
    edited[1]["content"] = "Uno?"
    edited.append({"role": "user", "content": "Three?"})
    with pytest.raises(HistoryConflict):
        checked["build_prompt"](r.state, edited, template=r.tmpl, history_policy="reject")
    call = r.call(encode("Three.") + [IM_END], messages=edited)
    assert call.plan.new_segment
    r.messages.append({"role": "user", "content": "Four?"})
    r.call(encode("Four.") + [IM_END])
    assert len(r.state.segments) == 2 and checked["build_prompt"].calls == 5
    _export_and_replay_leave_it_alone(r.state)


def test_a_turn_on_an_echoed_state_leaves_it_alone():
    r = _stateful("ours")
    state, clean = state_from_echo(_echoed(r), template=r.tmpl)
    plan = Checked(build_prompt)(state, clean, template=r.tmpl)
    gen = encode("Four.") + [IM_END]
    Checked(finish_turn)(state, plan, gen_ids=gen, logprobs=[-0.1] * len(gen),
                         finish_reason="stop", assistant_message={"role": "assistant", "content": "Four."})
    edited = copy.deepcopy(_echoed(r))
    edited[1]["content"] = "Edited?"
    state, clean = state_from_echo(edited, template=r.tmpl)
    assert state.pending_conflict is not None
    plan = Checked(build_prompt)(state, clean, template=r.tmpl)
    assert plan.new_segment
