"""Several choices in one answer (serve/fanout.py), on the frames and bodies the dialects produce:
re-indexed choices under one id, usage with each prompt once, one [DONE], an error that ends every
choice. The whole path against vLLM's own server is in tests/test_serve_vs_vllm.py (n, prompts)."""

from __future__ import annotations

import asyncio
import dataclasses
import json

import pytest

from rollout_service.serve.fanout import MAX_CHOICES, check_n, child_sampling, group_turns, merge_answers, merged_stream
from rollout_service.serve.protocol.envelope import ServiceError
from rollout_service.serve.turn_types import TurnRequest


def _frame(obj) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def _chunks(sid: str, texts: list[str], usage: dict | None, closed: list, delay: float = 0.0):
    async def frames():
        try:
            for t in texts:
                await asyncio.sleep(delay)
                yield _frame({"id": sid, "object": "text_completion", "choices": [{"index": 0, "text": t}]})
            if usage is not None:
                yield _frame({"id": sid, "object": "text_completion", "choices": [], "usage": usage})
            yield b"data: [DONE]\n\n"
        finally:
            closed.append(sid)
    return frames()


async def _failing(closed: list):
    """A choice whose call failed: its error event, then [DONE]."""
    try:
        yield _frame({"error": {"message": "engine lost", "type": "service_unavailable", "code": 503}})
        yield b"data: [DONE]\n\n"
    finally:
        closed.append("failing")


def _read(frames) -> list:
    async def run():
        return [f async for f in frames]
    return asyncio.run(run())


def test_streams_merge_under_one_id_reindexed_with_one_usage_and_one_done():
    closed: list = []
    usage = lambda p, c: {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}  # noqa: E731
    streams = [_chunks("a", ["x", "y"], usage(5, 2), closed), _chunks("b", ["z"], usage(5, 1), closed),
               _chunks("c", ["w"], usage(3, 1), closed)]
    out = _read(merged_stream(streams, [0, 0, 1], include_usage=True))
    assert out[-1] == b"data: [DONE]\n\n" and out.count(b"data: [DONE]\n\n") == 1
    chunks = [json.loads(f[6:]) for f in out[:-1]]
    assert len({c["id"] for c in chunks}) == 1
    texts: dict = {}
    for c in chunks[:-1]:
        for ch in c["choices"]:
            texts[ch["index"]] = texts.get(ch["index"], "") + ch["text"]
    assert texts == {0: "xy", 1: "z", 2: "w"}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == usage(8, 4)  # prompts 0 and 1 once each
    assert sorted(closed) == ["a", "b", "c"]


def test_every_choices_first_chunk_comes_first_in_choice_order_as_vllm_sends_the_role_chunks():
    """vLLM's streamed n > 1 chat answer starts with each choice's role chunk, in index order; the
    merged stream does too, however the choices' frames arrive (here: choice 0's whole stream is ready
    before choice 1's first frame)."""
    closed: list = []
    streams = [_chunks("a", ["role-a", "x", "y"], None, closed),
               _chunks("b", ["role-b", "z"], None, closed, delay=0.05),
               _chunks("c", ["role-c"], None, closed, delay=0.01)]
    out = _read(merged_stream(streams, [0, 0, 0], include_usage=False, firsts_in_order=True))
    chunks = [json.loads(f[6:]) for f in out[:-1]]
    firsts = [(c["choices"][0]["index"], c["choices"][0]["text"]) for c in chunks[:3]]
    assert firsts == [(0, "role-a"), (1, "role-b"), (2, "role-c")]
    texts: dict = {}
    for c in chunks:
        for ch in c["choices"]:
            texts[ch["index"]] = texts.get(ch["index"], "") + ch["text"]
    assert texts == {0: "role-axy", 1: "role-bz", 2: "role-c"}
    assert sorted(closed) == ["a", "b", "c"]


def test_an_error_ends_the_merged_stream_at_once_while_the_first_chunks_are_awaited():
    """Waiting for every choice's first chunk must not hold back a choice's error: a choice whose
    engine never answers is cancelled when another choice fails, as without the ordering."""
    closed: list = []

    async def stuck():
        try:
            await asyncio.sleep(3600)
            yield _frame({"id": "s", "choices": [{"index": 0, "text": "never"}]})
        finally:
            closed.append("stuck")

    async def run():
        return await asyncio.wait_for(_collect(merged_stream([stuck(), _failing(closed)], [0, 0],
                                                             include_usage=False, firsts_in_order=True)), 5)

    async def _collect(frames):
        return [f async for f in frames]

    out = asyncio.run(run())
    assert b'"engine lost"' in out[0] and out[-1] == b"data: [DONE]\n\n"
    assert sorted(closed) == ["failing", "stuck"]


def test_an_error_event_ends_the_merged_stream_and_every_choice():
    closed: list = []
    slow = _chunks("slow", ["a"] * 50, None, closed, delay=0.05)
    out = _read(merged_stream([slow, _failing(closed)], [0, 0], include_usage=False))
    assert json.loads(out[-2][6:])["error"]["code"] == 503 and out[-1] == b"data: [DONE]\n\n"
    assert "slow" in closed  # the other choice's stream was closed, not left running


def test_a_choice_without_its_usage_chunk_leaves_the_others_usage():
    closed: list = []
    streams = [_chunks("a", ["x"], {"prompt_tokens": 4, "completion_tokens": 1, "total_tokens": 5}, closed),
               _chunks("b", ["y"], None, closed)]
    chunks = [json.loads(f[6:]) for f in _read(merged_stream(streams, [0, 0], include_usage=True))[:-1]]
    assert chunks[-1]["usage"] == {"prompt_tokens": 4, "completion_tokens": 1, "total_tokens": 5}


def test_answers_merge_with_their_indexes_and_the_usage_of_each_prompt_once():
    body = lambda text, p, c, r: {"id": text, "choices": [{"index": 0, "text": text}],  # noqa: E731
                                  "usage": {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
                                            "completion_tokens_details": {"reasoning_tokens": r}}}
    merged = merge_answers([body("a", 7, 3, 1), body("b", 7, 2, 2), body("c", 4, 5, 0)], [0, 0, 1])
    assert merged["id"] == "a" and [(c["index"], c["text"]) for c in merged["choices"]] == [(0, "a"), (1, "b"), (2, "c")]
    assert merged["usage"] == {"prompt_tokens": 11, "completion_tokens": 10, "total_tokens": 21,
                               "completion_tokens_details": {"reasoning_tokens": 3}}


def test_child_seeds_and_bounds_are_vllms():
    assert [child_sampling({"n": 3, "seed": 10, "top_p": 0.5}, j) for j in range(2)] == [
        {"seed": 10, "top_p": 0.5}, {"seed": 11, "top_p": 0.5}]
    assert child_sampling({"n": 2, "seed": -1}, 1) == {"seed": -1}  # vLLM's "no seed": every child unseeded
    assert child_sampling({"n": 2}, 1) == {}
    assert check_n(None, 64) == 1 and check_n(64, 64) == 64
    for n, prompts in ((0, 1), (65, 1), (2, MAX_CHOICES)):
        with pytest.raises(ServiceError) as info:
            check_n(n, 64, prompts)
        assert info.value.status == 400 and info.value.param == "n"


def test_n_under_a_rollout_id_opens_a_group_of_rollouts():
    turn = TurnRequest(messages=[{"role": "user", "content": "hi"}], sampling={"n": 3, "seed": 7}, rollout_id="grpo-1")
    members = group_turns(turn, 3)
    assert [m.rollout_id for m in members] == ["grpo-1/0", "grpo-1/1", "grpo-1/2"]
    assert {m.rollout_group for m in members} == {"grpo-1"} and all(m.group_together for m in members)
    assert [m.sampling for m in members] == [{"seed": 7}, {"seed": 8}, {"seed": 9}]
    assert len({m.digest() for m in members}) == 3  # each member's own call (its seed)
    named = group_turns(dataclasses.replace(turn, rollout_group="step-4"), 2)
    assert {m.rollout_group for m in named} == {"step-4"}
    longest = TurnRequest(messages=[], rollout_id="r" * 126)
    assert group_turns(longest, 10)[-1].rollout_id == "r" * 126 + "/9"
    with pytest.raises(ServiceError) as info:
        group_turns(longest, 11)  # r.../10 is 129 characters
    assert info.value.status == 400 and info.value.param == "X-Rollout-Id"


class RecordingFleet:
    """The fleet client's generation interface: records the group each call is placed by, answers
    with a few ids (or fails the rollouts named in ``fail``)."""

    def __init__(self, fail=()):
        self.groups: dict[str, str | None] = {}
        self.fail = set(fail)

    def members(self):
        return ()

    async def generate_with_failover(self, rollout_id, request, stream, routed=None, group=None):
        from rollout_service.engine.types import GenerationChunk
        from rollout_service.fleet.types import NoEngineAvailable

        self.groups[rollout_id] = group
        if rollout_id in self.fail:
            raise NoEngineAvailable("no engine replica is serving (test)")
        yield GenerationChunk(token_ids=[9707, 11], logprobs=[-0.5, -0.25], finish_reason="length",
                              weight_versions=[("0", 0, 2)])


def test_a_groups_members_start_together_and_each_call_is_recorded(tiny_model_dir, tiny_tokenizer):
    """Under routing.group_placement spread (the default), the members of a call with n > 1 are still
    placed as one group; a call that only names X-Rollout-Group is not, but is recorded in it. Each
    member's record goes running -> finished, or failed when its call ends without a turn."""
    from memory_store import MemoryRolloutStore
    from rollout_service.config import RolloutServiceConfig
    from rollout_service.onpolicy.groups import parse_call_entry
    from rollout_service.serve.turns import TurnRunner

    cfg = RolloutServiceConfig.model_validate({"engine": {"model": str(tiny_model_dir)}})
    fleet, store = RecordingFleet(fail={"g/2"}), MemoryRolloutStore()
    runner = TurnRunner(cfg, fleet, store, tiny_tokenizer)
    base = TurnRequest(messages=[{"role": "user", "content": "hi"}], max_tokens=2, rollout_id="g", sampling={"seed": 1})
    members = group_turns(base, 3)
    named = dataclasses.replace(base, rollout_id="solo", rollout_group="g")

    async def run(req):
        try:
            return [e async for e in runner.run_turn(req)][-1]
        except ServiceError as exc:
            return exc

    async def main():
        await runner.note_group("g", [m.rollout_id for m in members], "running")  # as the n call does
        assert {k: parse_call_entry(v)[0] for k, v in (await store.group_members("g")).items()} == dict.fromkeys(
            ["g/0", "g/1", "g/2"], "running")
        return await asyncio.gather(*(run(r) for r in [*members, named]))

    results = asyncio.run(main())
    assert isinstance(results[2], ServiceError) and results[2].status == 503
    assert fleet.groups == {"g/0": "g", "g/1": "g", "g/2": "g", "solo": None}
    records = asyncio.run(store.group_members("g"))
    assert {k: parse_call_entry(v)[0] for k, v in records.items()} == {
        "g/0": "finished", "g/1": "finished", "g/2": "failed", "solo": "finished"}
    doc = asyncio.run(runner.get_group("g"))
    assert [(m["id"], m["state"], m["turns"]) for m in doc["members"]] == [
        ("g/0", "finished", 1), ("g/1", "finished", 1), ("g/2", "failed", 0), ("solo", "finished", 1)]
