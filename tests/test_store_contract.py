"""The RolloutStore contract, run against both implementations (memory and a real redis-server)."""

from __future__ import annotations

import asyncio
import copy
import random
import uuid

import numpy as np
import pytest

from rollout_service.onpolicy.types import RolloutState
from rollout_service.store import (
    InvalidRolloutId,
    InvalidTurnDelta,
    RedisRolloutStore,
    RolloutStore,
    TurnConflict,
)
from rollout_service.store.cache import CachedRolloutStore
from memory_store import MemoryRolloutStore
from synthetic_rollouts import synthetic_delta, synthetic_rollout

TTL = 1000


@pytest.fixture(params=["memory", "redis", "cached-redis"])
async def store(request):
    """The cache (store/cache.py) in front of Redis keeps the whole contract but one clause: it hands
    out its own object (see test_loaded_state_is_a_copy)."""
    if request.param == "memory":
        s = MemoryRolloutStore(ttl_seconds=TTL)
    else:
        url = request.getfixturevalue("redis_server")
        s = RedisRolloutStore.from_url(url, ttl_seconds=TTL, key_prefix=f"t{uuid.uuid4().hex[:8]}")
        if request.param == "cached-redis":
            s = CachedRolloutStore(s, max_rollouts=4)
    yield s
    await s.close()


async def commit_all(store, rid, deltas):
    for d in deltas:
        await store.append_turn(rid, d, expected_turn=d.turn - 1)


def named(state: RolloutState, rid: str) -> RolloutState:
    state = copy.deepcopy(state)
    state.rollout_id = rid
    return state


def test_both_implementations_satisfy_the_protocol():
    assert isinstance(MemoryRolloutStore(), RolloutStore)
    assert isinstance(RedisRolloutStore.from_url("redis://127.0.0.1:1/0"), RolloutStore)


async def test_multi_segment_multi_turn_state_round_trips_exactly(store):
    deltas, expected = synthetic_rollout(random.Random(1), [3, 1, 4], prompt_tokens=50, gen_tokens=70)
    await commit_all(store, "rollout-1", deltas)
    loaded = await store.load("rollout-1")
    assert loaded == named(expected, "rollout-1")
    assert loaded.turn == 8 and len(loaded.segments) == 3
    assert 151645 in loaded.segments[0].token_ids


async def test_every_intermediate_state_round_trips(store):
    deltas, _ = synthetic_rollout(random.Random(2), [2, 2])
    for k in range(1, len(deltas) + 1):
        await store.append_turn("r", deltas[k - 1], expected_turn=k - 1)
        state = RolloutState("r")
        for d in copy.deepcopy(deltas[:k]):
            d.apply(state)
        for seg in state.segments:
            seg.logprobs = np.asarray(seg.logprobs, dtype=np.float32).tolist()
        assert await store.load("r") == state


async def test_ids_are_bit_exact_and_logprobs_exact_after_float32_rounding(store):
    ids = [0, 1, 255, 256, 65535, 65536, 151643, 151645, 151668, 2**31 - 1]
    logprobs = [0.0, -1e-9, -0.1, -1 / 3, -2.5e-7, -17.123456789, -1e-30, -float("inf"), -3e38, -0.0]
    d = synthetic_delta(random.Random(0), turn=1, segment_index=0, new_segment=True, segment_len=0)
    d.token_ids, d.logprobs, d.loss_mask = ids, logprobs, [0, 1] * 5
    await store.append_turn("exact", d, expected_turn=0)
    seg = (await store.load("exact")).segments[0]
    assert seg.token_ids == ids
    assert seg.loss_mask == [0, 1] * 5
    assert seg.logprobs == [float(np.float32(x)) for x in logprobs]
    assert all(type(x) is int for x in seg.token_ids) and all(type(x) is float for x in seg.logprobs)


async def test_unknown_rollout_is_absent_everywhere(store):
    assert await store.load("nope") is None
    assert await store.exists("nope") is False
    assert await store.ttl("nope") is None
    assert await store.touch("nope") is False
    assert await store.delete("nope") is False


async def test_stale_expected_turn_conflicts_and_changes_nothing(store):
    deltas, expected = synthetic_rollout(random.Random(3), [2])
    await commit_all(store, "r", deltas)
    late = synthetic_delta(random.Random(9), turn=2, segment_index=0, new_segment=False, segment_len=10)
    with pytest.raises(TurnConflict) as info:
        await store.append_turn("r", late, expected_turn=1)
    assert (info.value.expected, info.value.actual) == (1, 2)
    assert await store.load("r") == named(expected, "r")


async def test_first_turn_on_an_existing_rollout_conflicts(store):
    deltas, _ = synthetic_rollout(random.Random(4), [1])
    await commit_all(store, "r", deltas)
    with pytest.raises(TurnConflict) as info:
        await store.append_turn("r", deltas[0], expected_turn=0)
    assert info.value.actual == 1


async def test_twenty_concurrent_appends_on_one_turn_exactly_one_wins(store):
    deltas, _ = synthetic_rollout(random.Random(5), [3])
    await commit_all(store, "race", deltas)
    before = copy.deepcopy(await store.load("race"))  # a cached store advances the object it handed out
    seg_len = len(before.segments[0].token_ids)
    rivals = [
        synthetic_delta(random.Random(100 + i), turn=4, segment_index=0, new_segment=False, segment_len=seg_len)
        for i in range(20)
    ]
    results = await asyncio.gather(
        *(store.append_turn("race", d, expected_turn=3) for d in rivals), return_exceptions=True
    )
    winners = [i for i, r in enumerate(results) if r is None]
    assert len(winners) == 1, results
    assert all(isinstance(r, TurnConflict) and r.actual == 4 for i, r in enumerate(results) if i != winners[0])
    expected = copy.deepcopy(rivals[winners[0]]).apply(copy.deepcopy(before))
    expected.segments[0].logprobs = np.asarray(expected.segments[0].logprobs, dtype=np.float32).tolist()
    assert await store.load("race") == expected


async def test_concurrent_first_turns_create_the_rollout_once(store):
    rivals = [
        synthetic_delta(random.Random(i), turn=1, segment_index=0, new_segment=True, segment_len=0) for i in range(20)
    ]
    results = await asyncio.gather(*(store.append_turn("new", d, expected_turn=0) for d in rivals), return_exceptions=True)
    assert sum(r is None for r in results) == 1
    state = await store.load("new")
    assert state.turn == 1 and len(state.segments) == 1 and len(state.segments[0].turns) == 1


@pytest.mark.parametrize(
    "bad_id", ["", "x" * 129, "a{b}", "a}b", "has space", "star*", "q?", "br[a]ck", "/lead", "trail/", "dou//ble", "a/..", "..", "a/./b", "é",
               "a\nb", "a/\n", 42, None]
)
async def test_invalid_rollout_ids_are_rejected_by_every_method(store, bad_id):
    d = synthetic_delta(random.Random(0), turn=1, segment_index=0, new_segment=True, segment_len=0)
    for call in (
        lambda: store.load(bad_id),
        lambda: store.append_turn(bad_id, d, expected_turn=0),
        lambda: store.delete(bad_id),
        lambda: store.exists(bad_id),
        lambda: store.touch(bad_id),
        lambda: store.ttl(bad_id),
    ):
        with pytest.raises(InvalidRolloutId) as info:
            await call()
        assert isinstance(info.value, ValueError)


async def test_valid_rollout_id_charset(store):
    for rid in ("Ab0_-.:" + "z" * 121, "grp/7", "a/b/c:1"):  # a slash between two parts: group members R/j
        deltas, expected = synthetic_rollout(random.Random(6), [1])
        await commit_all(store, rid, deltas)
        assert await store.load(rid) == named(expected, rid)


def _bad_deltas():
    def base():
        return synthetic_delta(random.Random(0), turn=1, segment_index=0, new_segment=True, segment_len=0)

    cases = {}
    d = base(); d.loss_mask = d.loss_mask[:-1]; cases["ragged mask"] = d  # noqa: E702
    d = base(); d.logprobs = d.logprobs + [0.0]; cases["ragged logprobs"] = d  # noqa: E702
    d = base(); d.token_ids[0] = 2**31; cases["id beyond int32"] = d  # noqa: E702
    d = base(); d.token_ids[0] = -1; cases["negative id"] = d  # noqa: E702
    d = base(); d.loss_mask[0] = 2; cases["mask not 0/1"] = d  # noqa: E702
    d = base(); d.turn = 2; d.record.turn = 2; cases["turn skips"] = d  # noqa: E702
    d = base(); d.record.turn = 5; cases["record turn differs"] = d  # noqa: E702
    d = base(); d.new_segment = False; cases["extends a missing segment"] = d  # noqa: E702
    d = base(); d.segment_index = 1; cases["skips a segment"] = d  # noqa: E702
    d = base(); d.new_messages = [{"x": object()}]; cases["message not JSON"] = d  # noqa: E702
    d = base(); d.render_context = {"nan": float("nan")}; cases["NaN in JSON"] = d  # noqa: E702
    return cases


@pytest.mark.parametrize("case", list(_bad_deltas()))
async def test_invalid_delta_is_refused_before_anything_is_written(store, case):
    with pytest.raises(InvalidTurnDelta):
        await store.append_turn("bad", _bad_deltas()[case], expected_turn=0)
    assert await store.exists("bad") is False


async def test_segment_index_must_extend_last_or_open_next(store):
    deltas, expected = synthetic_rollout(random.Random(7), [1, 1])
    await commit_all(store, "r", deltas)
    back = synthetic_delta(random.Random(0), turn=3, segment_index=0, new_segment=False, segment_len=0)
    with pytest.raises(InvalidTurnDelta):
        await store.append_turn("r", back, expected_turn=2)
    assert await store.load("r") == named(expected, "r")


async def test_delete_frees_the_rollout_and_the_id_can_start_over(store):
    deltas, expected = synthetic_rollout(random.Random(8), [2, 1])
    await commit_all(store, "r", deltas)
    assert await store.delete("r") is True
    assert await store.load("r") is None and await store.exists("r") is False
    assert await store.delete("r") is False
    await commit_all(store, "r", deltas)
    assert await store.load("r") == named(expected, "r")


async def test_ttl_is_set_on_append_and_restarted_by_touch(store):
    deltas, _ = synthetic_rollout(random.Random(10), [1])
    await commit_all(store, "r", deltas)
    ttl = await store.ttl("r")
    assert TTL - 5 < ttl <= TTL
    assert await store.touch("r") is True
    assert TTL - 5 < await store.ttl("r") <= TTL


async def test_loaded_state_is_a_copy(store):
    if isinstance(store, CachedRolloutStore):
        pytest.skip("the cache hands out its own object (read-only by contract; see store/cache.py)")
    deltas, expected = synthetic_rollout(random.Random(11), [2])
    await commit_all(store, "r", deltas)
    s = await store.load("r")
    s.segments[0].token_ids.append(7)
    s.segments[0].messages[0]["content"] = "edited"
    assert await store.load("r") == named(expected, "r")


async def test_json_values_come_back_normalised(store):
    d = synthetic_delta(random.Random(0), turn=1, segment_index=0, new_segment=True, segment_len=0)
    d.new_messages = [{"role": "user", "content": "ü 🙂", "args": (1, 2), "n": None}]
    d.render_context = {"tools": [], "kwargs": {"enable_thinking": False}}
    await store.append_turn("r", d, expected_turn=0)
    seg = (await store.load("r")).segments[0]
    assert seg.messages == [{"role": "user", "content": "ü 🙂", "args": [1, 2], "n": None}]
    assert seg.render_context == {"tools": [], "kwargs": {"enable_thinking": False}}


async def test_empty_turn_is_a_valid_append(store):
    d = synthetic_delta(random.Random(0), turn=1, segment_index=0, new_segment=True, segment_len=0, prompt_tokens=0, gen_tokens=0)
    d.new_messages = []
    await store.append_turn("r", d, expected_turn=0)
    state = await store.load("r")
    assert state.turn == 1 and state.segments[0].token_ids == [] and state.segments[0].messages == []


async def test_ping(store):
    assert await store.ping() is True


async def test_load_if_changed_answers_unchanged_only_for_the_stored_turn(store):
    from rollout_service.store.base import UNCHANGED

    assert await store.load_if_changed("r", 0) is None
    deltas, expected = synthetic_rollout(random.Random(12), [2, 1])
    await commit_all(store, "r", deltas)
    current = await store.load("r")
    assert current.incarnation
    assert await store.load_if_changed("r", 3) is UNCHANGED
    assert await store.load_if_changed("r", 3, known_incarnation=current.incarnation) is UNCHANGED
    for stale in (0, 2, 4):
        got = await store.load_if_changed("r", stale)
        assert got == named(expected, "r") and got.incarnation == current.incarnation
    assert await store.load_if_changed("r", 3, known_incarnation="0" * 16) == named(expected, "r")
    assert await store.load_if_changed("nope", 3) is None


async def test_a_recreated_rollout_has_a_new_incarnation_even_at_the_same_turn(store):
    from rollout_service.store.base import UNCHANGED

    deltas, expected = synthetic_rollout(random.Random(13), [2])
    await commit_all(store, "r", deltas)
    first = copy.deepcopy(await store.load("r"))
    await store.append_turn("r", synthetic_delta(random.Random(1), turn=3, segment_index=0, new_segment=False,
                                                 segment_len=len(first.segments[0].token_ids)), expected_turn=2)
    assert (await store.load("r")).incarnation == first.incarnation  # appends keep it
    await store.delete("r")
    other, other_expected = synthetic_rollout(random.Random(14), [2])
    await commit_all(store, "r", other)
    again = await store.load("r")
    assert again.turn == first.turn and again.incarnation != first.incarnation
    # Same turn counter, different rollout: the counter alone would call a stale copy current.
    assert await store.load_if_changed("r", 2) is UNCHANGED
    assert await store.load_if_changed("r", 2, known_incarnation=first.incarnation) == named(other_expected, "r")


async def test_replay_fields_of_a_turn_record_round_trip(store):
    d = synthetic_delta(random.Random(0), turn=1, segment_index=0, new_segment=True, segment_len=0)
    answer = {"message": {"role": "assistant", "content": "ü", "reasoning_content": None,
                          "tool_calls": [{"id": "call_x1", "type": "function",
                                          "function": {"name": "search", "arguments": "{\"q\": \"x\"}"}}]},
              "stop_reason": 151645}
    d.record.request_digest, d.record.idempotency_key, d.record.answer = "sha256:ab", "key-1", answer
    await store.append_turn("r", d, expected_turn=0)
    rec = (await store.load("r")).segments[0].turns[0]
    assert (rec.request_digest, rec.idempotency_key, rec.answer) == ("sha256:ab", "key-1", answer)


async def test_an_aborted_rollout_takes_only_the_call_the_abort_ended(store):
    from rollout_service.store.base import UNCHANGED, RolloutAborted

    assert await store.mark("nope", "aborted", "x") is None  # unknown: nothing created
    assert await store.load("nope") is None
    deltas, expected = synthetic_rollout(random.Random(21), [2])
    await commit_all(store, "r", deltas)
    before = copy.deepcopy(await store.load("r"))
    assert before.status is None
    assert await store.mark("r", "aborted", "dropped by dynamic sampling") is True
    after = await store.load("r")
    assert after == named(expected, "r")  # the history is untouched and readable
    assert (after.status, after.status_reason) == ("aborted", "dropped by dynamic sampling")
    # A copy loaded before the abort is not current any more, though the turn did not move.
    assert await store.load_if_changed("r", 2, known_incarnation=before.incarnation) is not UNCHANGED
    assert await store.load_if_changed("r", 2, known_status="aborted") is UNCHANGED
    seg_len = len(after.segments[0].token_ids)
    later = synthetic_delta(random.Random(2), turn=3, segment_index=0, new_segment=False, segment_len=seg_len)
    with pytest.raises(RolloutAborted) as err:
        await store.append_turn("r", later, expected_turn=2)
    assert (err.value.status, err.value.code) == (409, "rollout_aborted")
    assert (await store.load("r")).turn == 2
    # The call that was generating when the abort came ends with finish_reason abort: it lands.
    later.record.finish_reason = "abort"
    await store.append_turn("r", later, expected_turn=2)
    assert (await store.load("r")).turn == 3
    # Idempotent, the first reason stands; a later "stale" does not undo it.
    assert await store.mark("r", "aborted", "again") is False
    assert await store.mark("r", "stale", "3 versions behind") is False
    assert (await store.load("r")).status_reason == "dropped by dynamic sampling"
    with pytest.raises(ValueError):
        await store.mark("r", "finished")


async def test_a_stale_mark_is_a_status_not_a_lock(store):
    deltas, _ = synthetic_rollout(random.Random(22), [1])
    await commit_all(store, "r", deltas)
    assert await store.mark("r", "stale", "rollout_stale: 3 > 1") is True
    state = await store.load("r")
    assert (state.status, state.status_reason) == ("stale", "rollout_stale: 3 > 1")
    more = synthetic_delta(random.Random(3), turn=2, segment_index=0, new_segment=False,
                           segment_len=len(state.segments[0].token_ids))
    await store.append_turn("r", more, expected_turn=1)  # a turn under a looser bound may still run
    assert await store.mark("r", "aborted", "done") is True


async def test_a_group_records_its_members_and_their_last_call(store):
    assert await store.group_members("g") == {}
    await store.set_group_members("g", {"g/0": "running", "g/1": "running"})
    await store.set_group_members("g", {"g/1": "finished"})
    await store.set_group_members("other", {"x": "failed"})
    assert await store.group_members("g") == {"g/0": "running", "g/1": "finished"}
    assert await store.group_members("other") == {"x": "failed"}
    with pytest.raises(InvalidRolloutId):
        await store.set_group_members("g", {"bad id": "running"})
    with pytest.raises(InvalidRolloutId):
        await store.group_members("bad/")


async def test_aborting_a_rollout_before_its_first_turn_creates_it_aborted(store):
    """A group member still on its first call: ``mark(create=True)`` makes a rollout with no turn and
    the status; that call's abort answer still lands, nothing else does."""
    from rollout_service.store.base import RolloutAborted

    assert await store.mark("m/0", "aborted", "group dropped", create=True) is True
    state = await store.load("m/0")
    assert (state.turn, state.segments, state.status, state.status_reason) == (0, [], "aborted", "group dropped")
    assert await store.mark("m/0", "aborted", "again", create=True) is False  # idempotent
    first = synthetic_delta(random.Random(4), turn=1, segment_index=0, new_segment=True, segment_len=0)
    with pytest.raises(RolloutAborted):
        await store.append_turn("m/0", first, expected_turn=0)
    first.record.finish_reason = "abort"
    await store.append_turn("m/0", first, expected_turn=0)
    state = await store.load("m/0")
    assert state.turn == 1 and state.status == "aborted"
    assert await store.ttl("m/0") is not None
