"""The replica-local rollout cache: a hit costs one O(1) round trip, never a stale state.

Round trips and bytes are counted on the real redis-py client talking to a real redis-server (every
command the store sends goes through ``execute_command``), not on a mock.
"""

from __future__ import annotations

import asyncio
import random
import uuid

import pytest

from rollout_service.onpolicy.types import RolloutState
from memory_store import MemoryRolloutStore
from rollout_service.store import RedisRolloutStore, RolloutStore, StoreUnavailable, TurnConflict
from rollout_service.store.cache import CachedRolloutStore
from synthetic_rollouts import synthetic_delta, synthetic_rollout


def _reply_bytes(reply) -> int:
    if isinstance(reply, (bytes, str)):
        return len(reply)
    if isinstance(reply, (list, tuple)):
        return sum(_reply_bytes(r) for r in reply)
    return 8


class Wire:
    """Every command a RedisRolloutStore sends, with the script it ran and the bytes it got back."""

    def __init__(self, store: RedisRolloutStore):
        self.log: list[tuple[str, int]] = []
        names = {store._load.sha: "load", store._load_if_changed.sha: "load_if_changed",
                 store._append.sha: "append", store._delete.sha: "delete", store._touch.sha: "touch"}
        client = store.client
        real = client.execute_command

        async def counted(*args, **kwargs):
            reply = await real(*args, **kwargs)
            name = names.get(args[1], "?") if args[0] in ("EVALSHA", "EVAL") else str(args[0]).lower()
            self.log.append((name, _reply_bytes(reply)))
            return reply

        client.execute_command = counted

    def take(self) -> list[tuple[str, int]]:
        out, self.log = self.log, []
        return out


@pytest.fixture
async def redis_pair(redis_server):
    """Two stores on one Redis with separate clients: this replica's (cached) and another writer's."""
    prefix = f"c{uuid.uuid4().hex[:8]}"
    inner = RedisRolloutStore.from_url(redis_server, ttl_seconds=1000, key_prefix=prefix)
    other = RedisRolloutStore.from_url(redis_server, ttl_seconds=1000, key_prefix=prefix)
    cache = CachedRolloutStore(inner, max_rollouts=8)
    await inner.load_scripts()  # else the first call also loads them
    yield cache, inner, other, Wire(inner)
    await cache.close()
    await other.close()


async def commit_all(store, rid, deltas):
    for d in deltas:
        await store.append_turn(rid, d, expected_turn=d.turn - 1)


def next_delta(state: RolloutState, seed: int, *, new_segment=False, **kwargs):
    seg_index = len(state.segments) if new_segment else len(state.segments) - 1
    seg_len = 0 if new_segment else len(state.segments[-1].token_ids)
    return synthetic_delta(random.Random(seed), turn=state.turn + 1, segment_index=seg_index,
                           new_segment=new_segment, segment_len=seg_len, **kwargs)


def test_the_cache_is_a_rollout_store():
    assert isinstance(CachedRolloutStore(MemoryRolloutStore()), RolloutStore)


async def test_a_hit_is_one_small_round_trip_and_returns_the_cached_object(redis_pair):
    cache, inner, _, wire = redis_pair
    deltas, _ = synthetic_rollout(random.Random(0), [40], prompt_tokens=20, gen_tokens=60)
    await commit_all(inner, "r", deltas)
    wire.take()
    first = await cache.load("r")
    [(script, full_bytes)] = wire.take()
    assert script == "load" and full_bytes > 3200 * 9
    again = await cache.load("r")
    assert again is first
    [(script, hit_bytes)] = wire.take()
    assert script == "load_if_changed" and hit_bytes <= 8
    assert cache.stats()["hits"] == 1 and cache.stats()["misses"] == 1


async def test_an_append_through_the_cache_keeps_the_next_load_a_hit_and_exact(redis_pair):
    """Multi-segment, every turn: the advanced cached copy equals a fresh load from Redis."""
    cache, inner, other, wire = redis_pair
    deltas, _ = synthetic_rollout(random.Random(1), [1])
    await cache.append_turn("r", deltas[0], expected_turn=0)
    state = await cache.load("r")  # created turns are not cached (the store chose the incarnation)
    for k in range(12):
        d = next_delta(state, 100 + k, new_segment=k in (4, 9))
        d.record.answer = {"message": {"role": "assistant", "content": f"a{k}", "tool_calls": [{"id": f"c{k}"}]},
                           "stop_reason": None}
        d.new_messages.append({"role": "user", "content": "t", "args": (1, 2)})  # JSON turns the tuple into a list
        wire.take()
        await cache.append_turn("r", d, expected_turn=state.turn)
        assert [s for s, _ in wire.take()] == ["append"]
        loaded = await cache.load("r")
        assert loaded is state and [s for s, _ in wire.take()] == ["load_if_changed"]
        fresh = await other.load("r")
        assert loaded == fresh and loaded.incarnation == fresh.incarnation
    assert len(state.segments) == 3 and state.turn == 13
    assert cache.stats()["hits"] == 12 and cache.stats()["misses"] == 1


async def test_another_writers_append_is_seen(redis_pair):
    cache, inner, other, wire = redis_pair
    deltas, _ = synthetic_rollout(random.Random(2), [3])
    await commit_all(inner, "r", deltas)
    cached = await cache.load("r")
    d = next_delta(await other.load("r"), 7)
    await other.append_turn("r", d, expected_turn=3)  # e.g. the replica that owned it before a remap
    wire.take()
    reloaded = await cache.load("r")
    [(script, nbytes)] = wire.take()
    assert script == "load_if_changed" and nbytes > 1000  # the mismatch answer is the whole snapshot
    assert reloaded.turn == 4 and reloaded == await other.load("r")
    assert cached.turn == 3  # the stale copy was replaced, not patched
    assert cache.stats()["reloads"] == 1
    assert await cache.load("r") is reloaded


async def test_a_recreated_rollout_at_the_same_turn_is_not_served_stale(redis_pair):
    cache, inner, other, _ = redis_pair
    deltas, _ = synthetic_rollout(random.Random(3), [2])
    await commit_all(inner, "r", deltas)
    stale = await cache.load("r")
    await other.delete("r")  # through another replica: this cache never saw it
    new_deltas, _ = synthetic_rollout(random.Random(4), [2])
    await commit_all(other, "r", new_deltas)
    got = await cache.load("r")
    assert got.turn == stale.turn == 2
    assert got == await other.load("r") and got != stale


async def test_delete_and_vanishing_evict(redis_pair):
    cache, inner, other, wire = redis_pair
    deltas, _ = synthetic_rollout(random.Random(5), [2])
    for rid in ("a", "b"):
        await commit_all(inner, rid, deltas)
        await cache.load(rid)
    assert await cache.delete("a") is True
    assert "a" not in cache and await cache.load("a") is None
    await other.delete("b")  # or expiry: the keys are simply gone
    assert await cache.load("b") is None and "b" not in cache
    assert len(cache) == 0


async def test_expiry_evicts():
    now = [0.0]
    inner = MemoryRolloutStore(ttl_seconds=10, clock=lambda: now[0])
    cache = CachedRolloutStore(inner)
    deltas, _ = synthetic_rollout(random.Random(6), [2])
    await commit_all(inner, "r", deltas)
    assert (await cache.load("r")).turn == 2 and "r" in cache
    now[0] = 11.0
    assert await cache.load("r") is None and "r" not in cache
    await commit_all(inner, "r", deltas[:1])  # the id starts over: a fresh load, not the old copy
    assert (await cache.load("r")).turn == 1


async def test_a_conflict_evicts_and_the_next_load_is_exact(redis_pair):
    cache, inner, other, _ = redis_pair
    deltas, _ = synthetic_rollout(random.Random(7), [2])
    await commit_all(inner, "r", deltas)
    state = await cache.load("r")
    ours = next_delta(state, 1)
    await other.append_turn("r", next_delta(state, 2), expected_turn=2)  # another writer wins turn 3
    with pytest.raises(TurnConflict):
        await cache.append_turn("r", ours, expected_turn=2)
    assert "r" not in cache and state.turn == 2  # the copy the caller holds was not advanced
    assert await cache.load("r") == await other.load("r")
    assert cache.stats()["invalidations"] == 1


async def test_an_append_on_a_turn_the_cache_does_not_hold_drops_the_copy():
    inner = MemoryRolloutStore()
    cache = CachedRolloutStore(inner)
    deltas, _ = synthetic_rollout(random.Random(8), [3])
    await commit_all(inner, "r", deltas[:2])
    await cache.load("r")  # cached at turn 2
    await inner.append_turn("r", deltas[2], expected_turn=2)  # behind the cache's back
    d = next_delta(await inner.load("r"), 3)
    await cache.append_turn("r", d, expected_turn=3)  # succeeds in the store; cached copy is at 2
    assert "r" not in cache
    assert await cache.load("r") == await inner.load("r")


class FlakyStore(MemoryRolloutStore):
    """The memory store, failing or hanging on demand (the store's own error types)."""

    fail: str | None = None
    gate: asyncio.Event | None = None

    async def load_if_changed(self, *args, **kwargs):
        if self.fail == "load_if_changed":
            raise StoreUnavailable("down")
        return await super().load_if_changed(*args, **kwargs)

    async def append_turn(self, *args, **kwargs):
        if self.gate is not None:
            await self.gate.wait()
        if self.fail == "append_turn":
            raise StoreUnavailable("down")
        return await super().append_turn(*args, **kwargs)


async def test_store_errors_and_cancellation_evict():
    inner = FlakyStore()
    cache = CachedRolloutStore(inner)
    deltas, _ = synthetic_rollout(random.Random(9), [3])
    await commit_all(inner, "r", deltas[:2])

    await cache.load("r")
    inner.fail = "load_if_changed"
    with pytest.raises(StoreUnavailable):
        await cache.load("r")
    assert "r" not in cache

    inner.fail = None
    await cache.load("r")
    inner.fail = "append_turn"
    with pytest.raises(StoreUnavailable):
        await cache.append_turn("r", deltas[2], expected_turn=2)
    assert "r" not in cache

    inner.fail = None
    await cache.load("r")
    inner.gate = asyncio.Event()
    task = asyncio.create_task(cache.append_turn("r", deltas[2], expected_turn=2))
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert "r" not in cache  # the append may or may not have landed: only the store knows


async def test_lru_bound_on_rollouts_keeps_the_recently_used():
    inner = MemoryRolloutStore()
    cache = CachedRolloutStore(inner, max_rollouts=3, max_tokens=None)
    deltas, _ = synthetic_rollout(random.Random(10), [1])
    for rid in "abcde":
        await commit_all(inner, rid, deltas)
    for rid in "abc":
        await cache.load(rid)
    await cache.load("a")  # a hit makes "a" the most recently used
    await cache.load("d")
    assert sorted(cache._entries) == ["a", "c", "d"]
    await cache.load("e")
    assert sorted(cache._entries) == ["a", "d", "e"]
    assert cache.stats()["evictions"] == 2 and len(cache) == 3


async def test_lru_bound_on_tokens():
    inner = MemoryRolloutStore()
    deltas, _ = synthetic_rollout(random.Random(11), [2], prompt_tokens=20, gen_tokens=30)  # 100 tokens
    cache = CachedRolloutStore(inner, max_rollouts=100, max_tokens=250)
    for rid in "abc":
        await commit_all(inner, rid, deltas)
        await cache.load(rid)
    assert sorted(cache._entries) == ["b", "c"] and cache.stats()["tokens"] == 200
    # Growing past the bound drops the least recently used first.
    state = await cache.load("b")
    await cache.append_turn("b", next_delta(state, 1, gen_tokens=40), expected_turn=2)  # +60 tokens
    assert sorted(cache._entries) == ["b"] and cache.stats()["tokens"] == 160
    # A rollout larger than the whole budget is served but not kept.
    big, _ = synthetic_rollout(random.Random(12), [1], prompt_tokens=100, gen_tokens=200)
    await commit_all(inner, "big", big)
    assert (await cache.load("big")).turn == 1 and "big" not in cache


async def test_many_rollouts_interleaved_match_the_store(redis_pair):
    """Random appends through the cache and by another writer, deletes and loads: every load equals
    Redis's own answer, and a bounded cache keeps hitting for the rollouts it holds."""
    cache, inner, other, _ = redis_pair
    rng = random.Random(13)
    ids = [f"r{i}" for i in range(12)]  # more than max_rollouts=8
    for step in range(300):
        rid = rng.choice(ids)
        truth = await other.load(rid)
        op = rng.choices(["ours", "theirs", "delete", "load"], weights=[6, 1, 1, 3])[0]
        if op in ("ours", "theirs"):
            writer = cache if op == "ours" else other
            if truth is None:
                d = synthetic_delta(random.Random(step), turn=1, segment_index=0, new_segment=True, segment_len=0)
            else:
                d = next_delta(truth, step, new_segment=rng.random() < 0.15)
            await writer.append_turn(rid, d, expected_turn=truth.turn if truth else 0)
        elif op == "delete":
            await (cache if rng.random() < 0.5 else other).delete(rid)
        got = await cache.load(rid)
        assert got == await other.load(rid), (step, op, rid)
        if got is not None:
            assert got.incarnation == (await other.load(rid)).incarnation
    stats = cache.stats()
    assert stats["hits"] > 100 and stats["reloads"] > 0 and stats["evictions"] > 0 and stats["rollouts"] <= 8
