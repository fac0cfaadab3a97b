"""Property: for random conversations, every monotonic turn is prompt_{k-1} + gen_{k-1} + tail_k,
and each segment's loss-masked ids are exactly the generated ids, in order — on every template."""

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from onpolicy_fixtures import IM_END, TOOLS, Rollout, all_template_names, assert_spliced, encode, template
from test_onpolicy_templates import NO_TOOLS

WORDS = ["Skinny", " Skinny", " understatement", " weather", "man", " the", " 42", "\n", "  ", "ok", "é", " 東京", "!"]


@st.composite
def non_canonical_ids(draw):
    """Ids of random text, tokenized in random pieces (rarely the canonical tokenization)."""
    words = draw(st.lists(st.sampled_from(WORDS), min_size=1, max_size=6))
    text = "".join(words)
    ids, i = [], 0
    while i < len(text):
        j = draw(st.integers(i + 1, len(text)))
        ids += encode(text[i:j])
        i = j
    return ids


@st.composite
def turns(draw, with_tools):
    n = draw(st.integers(1, 20))
    out = []
    for k in range(n):
        gen = draw(non_canonical_ids())
        call = None
        if with_tools and draw(st.booleans()):
            args = {"city": draw(st.sampled_from(["Paris", "Oslo", "東京"]))}
            sep = draw(st.sampled_from(["", "\n", " "]))
            call = ("get_weather", args)
            gen = gen + encode(f"<tool_call>{sep}" + json.dumps({"name": "get_weather", "arguments": args}, separators=draw(st.sampled_from([(",", ":"), (", ", ": ")]))) + f"{sep}</tool_call>")
        eot = draw(st.booleans()) or k == n - 1
        out.append((gen + ([IM_END] if eot else []), call, draw(st.sampled_from(["user", "tool"])) if call else "user"))
    return out


def _play(name, script, with_tools):
    r = Rollout(template(name), tools=TOOLS if with_tools else None)
    r.messages = [{"role": "user", "content": "Start."}]
    calls = []
    for k, (gen, call, _) in enumerate(script):
        assistant = {"role": "assistant", "content": r.parse(gen)["content"]}
        if call:
            assistant = {"role": "assistant", "content": "", "tool_calls": [
                {"id": f"c{k}", "type": "function", "function": {"name": call[0], "arguments": json.dumps(call[1])}}]}
        calls.append(r.call(gen, assistant=assistant))
        if call:
            r.messages.append({"role": "tool", "tool_call_id": f"c{k}", "name": call[0], "content": f"result {k}"})
        else:
            r.messages.append({"role": "user", "content": f"Next {k}."})
    return r, calls


PROPERTY_SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)


@pytest.mark.parametrize("name", all_template_names())
@PROPERTY_SETTINGS
@given(data=st.data())
def test_monotonic_splice_and_loss_mask(name, data):
    with_tools = name not in NO_TOOLS and data.draw(st.booleans())
    script = data.draw(turns(with_tools))
    r, calls = _play(name, script, with_tools)
    for prev, cur in zip(calls, calls[1:]):
        assert_spliced(r, prev, cur)
    (seg,) = r.state.segments
    assert [t for t, m in zip(seg.token_ids, seg.loss_mask) if m] == [t for c in calls for t in c.gen_ids]
    assert len(seg.token_ids) == len(seg.loss_mask) == len(seg.logprobs)
    for rec, c in zip(seg.turns, calls):
        assert seg.token_ids[rec.gen_start:rec.gen_end] == c.gen_ids
        assert seg.token_ids[: rec.gen_start] == c.plan.prompt_ids
