"""The in-memory store behaves like the Redis store, so other modules can unit-test against it.

The shared contract is in test_store_contract.py; here: a differential run of random operation
sequences against both, and expiry on an injected clock.
"""

from __future__ import annotations

import random
import uuid

import pytest

from memory_store import MemoryRolloutStore
from rollout_service.store import RedisRolloutStore
from synthetic_rollouts import synthetic_delta, synthetic_rollout


def outcome(result):
    return type(result).__name__ if isinstance(result, BaseException) else result


async def run(store, op, *args, **kwargs):
    try:
        return await getattr(store, op)(*args, **kwargs)
    except Exception as e:  # the exception type is the observable behaviour being compared
        return e


@pytest.mark.parametrize("seed", range(5))
async def test_random_operation_sequences_give_identical_results(redis_server, seed):
    rng = random.Random(seed)
    memory = MemoryRolloutStore(ttl_seconds=1000)
    redis_store = RedisRolloutStore.from_url(redis_server, ttl_seconds=1000, key_prefix=f"d{uuid.uuid4().hex[:8]}")
    ids = ["a", "b", "c"]
    seen = set()
    for step in range(120):
        rid = rng.choice(ids)
        state = await memory.load(rid)
        turn = state.turn if state else 0
        nseg = len(state.segments) if state else 0
        op = rng.choices(["append", "stale", "badseg", "delete", "load"], weights=[8, 2, 1, 1, 2])[0]
        if op in ("append", "stale", "badseg"):
            new_segment = nseg == 0 or rng.random() < 0.2
            seg_index = nseg if new_segment else nseg - 1
            if op == "badseg":
                seg_index += rng.choice([-2, 1, 2])
            expected = turn if op != "stale" else max(0, turn - rng.randint(1, 2))
            seg_len = len(state.segments[seg_index].token_ids) if state and 0 <= seg_index < nseg and not new_segment else 0
            d = synthetic_delta(random.Random(step), turn=expected + 1, segment_index=seg_index,
                                new_segment=new_segment, segment_len=seg_len)
            got = [outcome(await run(s, "append_turn", rid, d, expected_turn=expected)) for s in (memory, redis_store)]
        elif op == "delete":
            got = [outcome(await run(s, "delete", rid)) for s in (memory, redis_store)]
        else:
            got = [await memory.load(rid), await redis_store.load(rid)]
        assert got[0] == got[1], (step, op, got)
        seen.add((op, str(got[0])[:20]))
    for rid in ids:
        assert await memory.load(rid) == await redis_store.load(rid)
    kinds = {o for _, o in seen}
    assert {"None", "TurnConflict", "InvalidTurnDelta", "True"} <= kinds, kinds
    await redis_store.close()


async def test_rollout_expires_after_ttl_and_each_turn_restarts_the_clock():
    now = [0.0]
    store = MemoryRolloutStore(ttl_seconds=10, clock=lambda: now[0])
    deltas, _ = synthetic_rollout(random.Random(0), [3])
    await store.append_turn("r", deltas[0], expected_turn=0)
    now[0] = 9.0
    await store.append_turn("r", deltas[1], expected_turn=1)
    now[0] = 18.0
    assert await store.ttl("r") == pytest.approx(1.0)
    assert (await store.load("r")).turn == 2
    now[0] = 19.0
    assert await store.load("r") is None and await store.exists("r") is False
    # An expired rollout is gone: its id starts again at turn 0.
    await store.append_turn("r", deltas[0], expected_turn=0)
    assert (await store.load("r")).turn == 1


async def test_touch_restarts_the_clock():
    now = [0.0]
    store = MemoryRolloutStore(ttl_seconds=10, clock=lambda: now[0])
    deltas, _ = synthetic_rollout(random.Random(0), [1])
    await store.append_turn("r", deltas[0], expected_turn=0)
    now[0] = 8.0
    assert await store.touch("r") is True
    now[0] = 17.0
    assert await store.exists("r") is True
