"""A retried call is answered from the stored turn: field for field what the first call returned.

The rollouts are played by the real core (build_prompt, parse_output, finish_turn) the way the data
plane does it, and each call's answer is kept exactly as the data plane builds its final event
(serve/turns.py); replay_turn must rebuild that answer from the state alone — also after a round
trip through Redis (logprobs then come back float32-rounded, as every load returns them).
"""

from __future__ import annotations

import copy
import random
import uuid

import numpy as np
import pytest

from onpolicy_fixtures import IM_END, TOOLS, encode, template, tokenizer
from rollout_service.onpolicy import RolloutState, build_prompt, finish_turn, parse_output
from rollout_service.onpolicy.replay import NotReplayable, find_turn, replay_turn, stored_answer
from rollout_service.store import RedisRolloutStore
from rollout_service.store.cache import CachedRolloutStore


class DataPlane:
    """The turn runner minus the engine and the store: each call returns the final answer it would
    send, and keeps the delta it would append (with the replay fields the data plane sets)."""

    def __init__(self, tmpl_name="ours", *, tools=None, reasoning_parser=None, rollout_id="r"):
        self.tmpl = template(tmpl_name)
        self.tools = tools
        self.reasoning_parser = reasoning_parser
        self.state = RolloutState(rollout_id)
        self.messages: list[dict] = []
        self.answers: list[dict] = []
        self.deltas = []
        self.rng = random.Random(0)

    def call(self, gen_ids, *, spans=None, stop_reason=None, key=None, messages=None):
        messages = self.messages if messages is None else messages
        digest = f"digest-{len(self.answers)}"
        plan = build_prompt(self.state, messages, tools=self.tools, template=self.tmpl)
        parsed = parse_output(gen_ids, tokenizer=tokenizer(), reasoning_parser=self.reasoning_parser,
                              tool_parser="hermes" if self.tools else None, tools=self.tools, prompt_ids=plan.prompt_ids)
        finish_reason = "stop" if gen_ids[-1] == IM_END else "length"
        if parsed.tool_calls and finish_reason == "stop":
            finish_reason = "tool_calls"
        assistant = {"role": "assistant", "content": parsed.content or "", "reasoning_content": parsed.reasoning_content}
        if parsed.tool_calls:
            assistant["tool_calls"] = parsed.tool_calls
        lps = [-self.rng.random() * 3 for _ in gen_ids]
        spans = spans if spans is not None else [("v1", 0, len(gen_ids))]
        delta = finish_turn(self.state, plan, gen_ids=gen_ids, logprobs=lps, finish_reason=finish_reason,
                            weight_versions=spans, assistant_message=assistant)
        delta.record.answer = stored_answer(assistant, stop_reason=stop_reason)
        delta.record.request_digest, delta.record.idempotency_key = digest, key
        answer = {
            "prompt_token_ids": plan.prompt_ids,
            "generation_token_ids": list(gen_ids),
            "generation_log_probs": lps,
            "finish_reason": finish_reason,
            "stop_reason": stop_reason,
            "message": copy.deepcopy(assistant),
            "weight_versions": [{"version": v, "start": s, "end": e, "kv_version": v} for v, s, e in spans],
            "rollout": {"id": self.state.rollout_id, "turn": delta.turn, "segment": delta.segment_index,
                        "monotonic": plan.monotonic, "constrained": False},
            "usage": {"prompt_tokens": len(plan.prompt_ids), "completion_tokens": len(gen_ids),
                      "total_tokens": len(plan.prompt_ids) + len(gen_ids)},
        }
        self.deltas.append(copy.deepcopy(delta))
        delta.apply(self.state)
        self.messages = list(messages) + [assistant]
        self.answers.append(answer)
        return answer


def tool_rollout() -> DataPlane:
    """Tool calls (random ids), a reasoning turn, a refit in the middle of a generation, a cut-off
    turn, a stop-token stop reason, then an edited history that forks a second segment."""
    dp = DataPlane(tools=TOOLS, reasoning_parser="qwen3")
    dp.messages = [{"role": "system", "content": "Use tools."}, {"role": "user", "content": "Weather in Paris?"}]
    dp.call(encode('<think>\nNeed the tool.\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": '
                   '{"city": "Paris"}}\n</tool_call>') + [IM_END], key="k-1")
    call_id = dp.answers[-1]["message"]["tool_calls"][0]["id"]
    dp.messages.append({"role": "tool", "tool_call_id": call_id, "name": "get_weather", "content": "sunny"})
    gen = encode("It is sunny in Paris, around twenty degrees.") + [IM_END]
    dp.call(gen, spans=[("v1", 0, 4), ("v2", 4, len(gen))], stop_reason=IM_END, key="k-2")  # refit mid-generation
    dp.messages.append({"role": "user", "content": "And tomorrow?"})
    dp.call(encode("Tomorrow it will be"), spans=[("v2", 0, 3), ("v3", 3, 4)])  # cut by max_tokens
    edited = [dict(m) for m in dp.messages]
    edited[1]["content"] = "Weather in Oslo?"
    edited.append({"role": "user", "content": "Summarize."})
    dp.call(encode("Sunny, then unknown.") + [IM_END], messages=edited, key="k-4")
    dp.messages.append({"role": "user", "content": "Thanks."})
    dp.call(encode("You are welcome.") + [IM_END], spans=[])
    return dp


def float32(answer: dict) -> dict:
    out = copy.deepcopy(answer)
    out["generation_log_probs"] = np.asarray(out["generation_log_probs"], dtype=np.float32).tolist()
    return out


def test_every_stored_call_replays_its_exact_answer():
    dp = tool_rollout()
    assert [len(dp.state.segments), dp.state.turn] == [2, 5]
    assert dp.answers[3]["rollout"] == {"id": "r", "turn": 4, "segment": 1, "monotonic": False, "constrained": False}
    for k, answer in enumerate(dp.answers, start=1):
        replayed = replay_turn(dp.state, k)
        assert replayed.to_dict() == answer, k
        assert replayed.request_digest == f"digest-{k - 1}"
    first = replay_turn(dp.state, 1)
    assert first.message["tool_calls"][0]["id"].startswith("chatcmpl-tool-")  # the id the client got, not a new one
    assert first.message["reasoning_content"].strip() == "Need the tool."
    assert first.finish_reason == "tool_calls"
    second = replay_turn(dp.state, 2)
    assert [(w.version, w.start, w.end) for w in second.weight_versions] == [("v1", 0, 4), ("v2", 4, 11)]
    assert second.stop_reason == IM_END
    # The whole prompt of a monotonic call: the first call's prompt, its generation, then the tail.
    assert second.prompt_token_ids[: len(dp.answers[0]["prompt_token_ids"])] == dp.answers[0]["prompt_token_ids"]


def test_weight_spans_convert_between_generation_and_segment_offsets():
    dp = tool_rollout()
    seg = dp.state.segments[0]
    rec = seg.turns[2]
    assert [(w.start, w.end) for w in rec.weight_versions] == [(rec.gen_start, rec.gen_start + 3),
                                                               (rec.gen_start + 3, rec.gen_end)]
    assert [(w.version, w.start, w.end) for w in replay_turn(dp.state, 3).weight_versions] == [("v2", 0, 3), ("v3", 3, 4)]


def test_replay_returns_fresh_objects():
    dp = tool_rollout()
    r = replay_turn(dp.state, 1)
    r.message["tool_calls"][0]["id"] = "changed"
    r.prompt_token_ids.append(0)
    assert replay_turn(dp.state, 1).to_dict() == dp.answers[0]


def test_find_turn_by_key_at_any_turn_and_by_digest_only_for_the_last_call():
    dp = tool_rollout()
    assert find_turn(dp.state, idempotency_key="k-1") == 1
    assert find_turn(dp.state, idempotency_key="k-4") == 4
    assert find_turn(dp.state, idempotency_key="nope") is None
    assert find_turn(dp.state, request_digest="digest-4") == 5
    assert find_turn(dp.state, request_digest="digest-3") is None  # an older request is not a lost answer
    assert find_turn(None, idempotency_key="k-1") is None
    with pytest.raises(ValueError):
        find_turn(dp.state)
    with pytest.raises(ValueError):
        find_turn(dp.state, idempotency_key="k-1", request_digest="digest-4")


def test_unknown_turns_and_turns_stored_without_an_answer_are_not_replayable():
    dp = tool_rollout()
    for bad in (0, 6, -1):
        with pytest.raises(NotReplayable):
            replay_turn(dp.state, bad)
    dp.state.segments[0].turns[0].answer = None  # e.g. written before answers were stored
    with pytest.raises(NotReplayable) as err:
        replay_turn(dp.state, 1)
    assert isinstance(err.value, LookupError) and "without its answer" in str(err.value)


@pytest.mark.parametrize("cached", [False, True])
async def test_replay_after_a_round_trip_through_redis(redis_server, cached):
    dp = tool_rollout()
    store = RedisRolloutStore.from_url(redis_server, ttl_seconds=100, key_prefix=f"rp{uuid.uuid4().hex[:8]}")
    if cached:
        store = CachedRolloutStore(store)
    try:
        for d in dp.deltas:
            await store.append_turn("r", d, expected_turn=d.turn - 1)
            await store.load("r")  # with the cache: every later append advances the cached copy
        state = await store.load("r")
        assert find_turn(state, idempotency_key="k-2") == 2
        for k, answer in enumerate(dp.answers, start=1):
            assert replay_turn(state, k).to_dict() == float32(answer)
    finally:
        await store.close()
