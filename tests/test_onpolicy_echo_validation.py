"""Malformed echo fields (stateless mode) are refused as InvalidEcho naming the message and field.

Every case starts from a conversation the service really produced (three calls, echoed back the
way NeMo Gym does) and breaks one field of one message. The error must name that message index
and field (the HTTP layer's ``param`` is ``messages[i].field``), the request's messages must be
left as they were, and the unbroken conversation must still be accepted.
"""

from __future__ import annotations

import copy
import math

import pytest

from onpolicy_fixtures import IM_END, Rollout, encode, template, tokenizer
from rollout_service.onpolicy import OnPolicyError, build_prompt, state_from_echo
from rollout_service.onpolicy.errors import InvalidEcho

VOCAB = len(tokenizer())  # 151669: the tokenizer the template wraps
MODEL_VOCAB = 151936  # the tiny Qwen3 model's embedding rows (padded past the tokenizer)

# Message indexes of the echoed conversation: 0 system, 1 user, 2/4/6 assistant (echoed), 3/5/7 user.
MID = 4


def _echoed() -> list[dict]:
    r = Rollout(template("ours"))
    r.messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "One?"}]
    r.call(encode(" Skinny") + [IM_END])
    r.messages.append({"role": "user", "content": "Two?"})
    r.call(encode("cut without end"))
    r.messages.append({"role": "user", "content": "Three?"})
    r.call(encode("Three.") + [IM_END])
    r.messages.append({"role": "user", "content": "Four?"})
    out, k = [], 0
    for m in r.messages:
        m = dict(m)
        if m["role"] == "assistant":
            c = r.calls[k]
            m.update(
                prompt_token_ids=list(c.plan.prompt_ids),
                generation_token_ids=list(c.gen_ids),
                generation_log_probs=[-0.5] * len(c.gen_ids),
            )
            k += 1
        out.append(m)
    return out


def _set(**fields):
    def edit(m):
        m.update(fields)
    return edit


def _drop(*names):
    def edit(m):
        for n in names:
            m.pop(n)
    return edit


def _logprobs(fn):
    def edit(m):
        m["generation_log_probs"] = fn(m["generation_log_probs"])
    return edit


def _gen(fn):
    """Change the generated ids, keeping one logprob per id so only the ids are at fault."""
    def edit(m):
        m["generation_token_ids"] = fn(m["generation_token_ids"])
        if isinstance(m["generation_token_ids"], list):
            m["generation_log_probs"] = [-0.5] * len(m["generation_token_ids"])
    return edit


def _prompt(fn):
    def edit(m):
        m["prompt_token_ids"] = fn(m["prompt_token_ids"])
    return edit


BAD = [
    # generation_log_probs: length, type, finiteness
    ("fewer logprobs than generated ids", MID, _logprobs(lambda lp: lp[:-1]), "generation_log_probs"),
    ("more logprobs than generated ids", MID, _logprobs(lambda lp: lp + [-0.5]), "generation_log_probs"),
    ("empty logprobs for generated ids", MID, _logprobs(lambda lp: []), "generation_log_probs"),
    ("logprobs not a list", MID, _set(generation_log_probs="-0.5"), "generation_log_probs"),
    ("logprobs a dict", MID, _set(generation_log_probs={"0": -0.5}), "generation_log_probs"),
    ("logprob a string", MID, _logprobs(lambda lp: ["-0.5"] + lp[1:]), "generation_log_probs"),
    ("logprob null", MID, _logprobs(lambda lp: lp[:-1] + [None]), "generation_log_probs"),
    ("logprob a bool", MID, _logprobs(lambda lp: [True] + lp[1:]), "generation_log_probs"),
    ("logprob NaN", MID, _logprobs(lambda lp: [math.nan] + lp[1:]), "generation_log_probs"),
    ("logprob +inf", MID, _logprobs(lambda lp: [math.inf] + lp[1:]), "generation_log_probs"),
    ("logprob -inf", MID, _logprobs(lambda lp: [-math.inf] + lp[1:]), "generation_log_probs"),
    ("logprob an int too large for a float", MID, _logprobs(lambda lp: [-(10**400)] + lp[1:]), "generation_log_probs"),
    ("logprob a list", MID, _logprobs(lambda lp: [[-0.5]] + lp[1:]), "generation_log_probs"),
    # presence rules
    ("generation ids without prompt ids", MID, _drop("prompt_token_ids"), "prompt_token_ids"),
    ("prompt ids without generation ids", MID, _drop("generation_token_ids", "generation_log_probs"), "generation_token_ids"),
    ("logprobs without generation ids", MID, _drop("generation_token_ids"), "generation_token_ids"),
    ("logprobs alone", MID, _drop("prompt_token_ids", "generation_token_ids"), "prompt_token_ids"),
    ("prompt ids null, generation ids given", MID, _set(prompt_token_ids=None), "prompt_token_ids"),
    ("echo fields on a user message", 3, _set(prompt_token_ids=[1, 2], generation_token_ids=[3]), "prompt_token_ids"),
    ("logprobs on a user message", 3, _set(generation_log_probs=[-0.5]), "generation_log_probs"),
    ("echo fields on the system message", 0, _set(generation_token_ids=[3]), "generation_token_ids"),
    # generation_token_ids: type and range
    ("generated id = vocabulary size", MID, _gen(lambda g: g + [VOCAB]), "generation_token_ids"),
    ("generated id far out of range", MID, _gen(lambda g: g + [2**70]), "generation_token_ids"),
    ("generated id negative", MID, _gen(lambda g: [-1] + g), "generation_token_ids"),
    ("generated id a bool", MID, _gen(lambda g: g + [True]), "generation_token_ids"),
    ("generated id a float", MID, _gen(lambda g: g + [5.0]), "generation_token_ids"),
    ("generated id a string", MID, _gen(lambda g: g + ["5"]), "generation_token_ids"),
    ("generated id null", MID, _gen(lambda g: g + [None]), "generation_token_ids"),
    ("generated ids a string", MID, _set(generation_token_ids="1 2 3"), "generation_token_ids"),
    ("generated ids an int", MID, _set(generation_token_ids=5), "generation_token_ids"),
    ("generated ids a dict", MID, _set(generation_token_ids={"0": 5}), "generation_token_ids"),
    # prompt_token_ids: type, range, non-empty
    ("prompt empty", MID, _prompt(lambda p: []), "prompt_token_ids"),
    ("prompt id = vocabulary size", MID, _prompt(lambda p: p[:-1] + [VOCAB]), "prompt_token_ids"),
    ("prompt id negative", MID, _prompt(lambda p: [-5] + p[1:]), "prompt_token_ids"),
    ("prompt id a bool", MID, _prompt(lambda p: [False] + p[1:]), "prompt_token_ids"),
    ("prompt id a float", MID, _prompt(lambda p: [float(p[0])] + p[1:]), "prompt_token_ids"),
    ("prompt ids a string", MID, _set(prompt_token_ids="hello"), "prompt_token_ids"),
    # the same faults on the first and the last echoed call
    ("first call: fewer logprobs", 2, _logprobs(lambda lp: lp[:-1]), "generation_log_probs"),
    ("last call: id out of vocabulary", 6, _gen(lambda g: [VOCAB + 1] + g), "generation_token_ids"),
    ("last call: prompt id out of vocabulary", 6, _prompt(lambda p: [VOCAB] + p), "prompt_token_ids"),
    # finish_reason is read from the echoed message too
    ("finish_reason not a string", MID, _set(finish_reason=1), "finish_reason"),
]


@pytest.mark.parametrize("case, index, edit, field", BAD, ids=[c[0] for c in BAD])
def test_malformed_echo_is_refused_naming_message_and_field(case, index, edit, field):
    msgs = _echoed()
    edit(msgs[index])
    before = copy.deepcopy(msgs)
    with pytest.raises(InvalidEcho) as err:
        state_from_echo(msgs, template=template("ours"))
    e = err.value
    assert (e.index, e.field) == (index, field), case
    assert e.param == f"messages[{index}].{field}"
    assert str(e).startswith(f"messages[{index}].{field}: ")
    assert isinstance(e, OnPolicyError) and (e.status, e.code) == (400, "invalid_echo")
    assert isinstance(e, ValueError)  # what the core raised before, for callers that catch that
    assert msgs == before  # nothing was consumed or rewritten


def test_the_unbroken_echo_is_accepted_and_continues_the_rollout():
    msgs = _echoed()
    state, clean = state_from_echo(msgs, template=template("ours"))
    plan = build_prompt(state, clean, template=template("ours"), history_policy="reject")
    assert plan.monotonic and not plan.new_segment
    seg = state.segments[0]
    gen_ids = [t for m in msgs if m["role"] == "assistant" for t in m["generation_token_ids"]]
    assert [t for t, mask in zip(seg.token_ids, seg.loss_mask) if mask] == gen_ids
    assert [lp for lp, mask in zip(seg.logprobs, seg.loss_mask) if mask] == [-0.5] * len(gen_ids)


def test_the_first_bad_message_is_the_one_named():
    msgs = _echoed()
    _logprobs(lambda lp: lp[:-1])(msgs[6])
    _gen(lambda g: g + [-1])(msgs[2])
    with pytest.raises(InvalidEcho) as err:
        state_from_echo(msgs, template=template("ours"))
    assert (err.value.index, err.value.field) == (2, "generation_token_ids")


@pytest.mark.parametrize(
    "edit",
    [
        _drop("generation_log_probs"),  # absent: logprobs 0.0, as before
        _set(generation_log_probs=None),
        _logprobs(lambda lp: [0] + lp[1:]),  # an integer is a number
        _set(finish_reason="length"),
        _set(finish_reason=None),
    ],
    ids=["logprobs absent", "logprobs null", "integer logprob", "finish_reason string", "finish_reason null"],
)
def test_optional_echo_fields_may_be_absent_or_plain(edit):
    msgs = _echoed()
    edit(msgs[MID])
    state, _ = state_from_echo(msgs, template=template("ours"))
    assert state is not None and state.turn == 3


def test_an_aborted_call_with_no_generated_id_echoes_back():
    msgs = _echoed()
    msgs[6].update(generation_token_ids=[], generation_log_probs=[])
    state, _ = state_from_echo(msgs, template=template("ours"))
    rec = state.segments[-1].turns[-1]
    assert rec.gen_start == rec.gen_end


def test_ids_past_the_tokenizer_pass_with_the_engine_vocabulary_size():
    """The model's embedding is padded past the tokenizer and can sample those ids: a server for
    such a model passes the engine's vocabulary size so its own output echoes back cleanly."""
    padding_id = MODEL_VOCAB - 1
    msgs = _echoed()
    _gen(lambda g: g[:-1] + [padding_id])(msgs[6])
    with pytest.raises(InvalidEcho) as err:
        state_from_echo(msgs, template=template("ours"))
    assert err.value.field == "generation_token_ids" and f"[0, {VOCAB})" in str(err.value)
    state, _ = state_from_echo(msgs, template=template("ours"), vocab_size=MODEL_VOCAB)
    assert state.segments[-1].token_ids[-1] == padding_id
    with pytest.raises(InvalidEcho):
        _gen(lambda g: g + [MODEL_VOCAB])(msgs[6])
        state_from_echo(msgs, template=template("ours"), vocab_size=MODEL_VOCAB)
