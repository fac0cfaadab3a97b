"""Redis memory: what a stored token and turn cost, and what a full Redis does.

Sizing (the numbers docs/deployment.md's "Redis sizing" quotes, measured with ``MEMORY USAGE`` of a
rollout's keys on a real redis-server): token ids, logprobs and loss mask take 9 bytes per token
plus allocator slack, the messages their JSON text, each turn a few hundred bytes more.

Full: a real redis-server with a tiny ``maxmemory`` and ``noeviction`` (what ``EmbeddedRedis`` and
k8s/redis run with) is filled with one rollout's turns until it refuses a write; then the turn of
another rollout is refused too, and both histories load exactly as they were before the refusal
(a Lua append refused at its first write leaves no trace). Freeing memory lets the same turn in.
"""

from __future__ import annotations

import random
import uuid

import pytest

from rollout_service.store import EmbeddedRedis, RedisRolloutStore
from rollout_service.store.base import StoreError, StoreFull
from synthetic_rollouts import synthetic_delta, synthetic_rollout

MAXMEMORY = 4 * 1024 * 1024  # a few MiB above an empty server's ~1 MiB


@pytest.fixture
def tiny_redis(tmp_path):
    server = EmbeddedRedis(tmp_path, maxmemory=MAXMEMORY)
    yield server.start()
    server.stop()


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _big_turn(rng: random.Random, turn: int, segment_len: int):
    return synthetic_delta(rng, turn=turn, segment_index=0, new_segment=turn == 1, segment_len=segment_len,
                           prompt_tokens=4_000, gen_tokens=4_000)


async def test_a_full_redis_refuses_the_turn_with_store_full_and_keeps_every_history(tiny_redis):
    store = RedisRolloutStore.from_url(tiny_redis, ttl_seconds=1000)
    config = {_text(k): _text(v) for k, v in (await store.client.config_get("maxmemory*")).items()}
    assert config["maxmemory"] == str(MAXMEMORY) and config["maxmemory-policy"] == "noeviction"

    deltas, expected = synthetic_rollout(random.Random(1), [3])
    for d in deltas[:2]:
        await store.append_turn("kept", d, expected_turn=d.turn - 1)
    before = await store.load("kept")

    rng, turn, length = random.Random(2), 0, 0
    with pytest.raises(StoreFull, match="maxmemory") as refused:
        for _ in range(200):  # ~64 KiB a turn: a 4 MiB server is full long before
            delta = _big_turn(rng, turn + 1, length)
            await store.append_turn("filler", delta, expected_turn=turn)
            turn, length = turn + 1, length + len(delta.token_ids)
    assert isinstance(refused.value, StoreError) and turn > 0
    filled = await store.load("filler")
    assert filled.turn == turn and len(filled.segments[0].token_ids) == length  # the refused turn left no trace

    with pytest.raises(StoreFull):
        await store.append_turn("kept", deltas[2], expected_turn=2)
    assert await store.load("kept") == before  # untouched: turn counter, tokens, logprobs, records, messages
    assert await store.load("filler") == filled

    assert await store.delete("filler")  # memory freed: the same turn goes in now
    await store.append_turn("kept", deltas[2], expected_turn=2)
    expected.rollout_id = "kept"
    assert await store.load("kept") == expected
    await store.close()


async def test_the_data_plane_answers_507_store_full_when_redis_refuses_the_turn(tiny_redis):
    """TurnRunner's append step (the one write of a turn) on a full Redis: ServiceError 507
    ``store_full`` (docs/errors.md), nothing of the turn stored; the step itself, with a stand-in for
    the rest of the runner it does not use."""
    from types import SimpleNamespace

    from rollout_service.serve.protocol.envelope import ServiceError
    from rollout_service.serve.turns import TurnRunner

    store = RedisRolloutStore.from_url(tiny_redis, ttl_seconds=1000)
    deltas, _ = synthetic_rollout(random.Random(1), [2])
    await store.append_turn("kept", deltas[0], expected_turn=0)
    before = await store.load("kept")
    rng, turn, length = random.Random(2), 0, 0
    with pytest.raises(StoreFull):
        for _ in range(200):
            delta = _big_turn(rng, turn + 1, length)
            await store.append_turn("filler", delta, expected_turn=turn)
            turn, length = turn + 1, length + len(delta.token_ids)

    runner = SimpleNamespace(store=store)
    runner._store_op = TurnRunner._store_op.__get__(runner)
    with pytest.raises(ServiceError) as answered:
        await TurnRunner._append(runner, "kept", deltas[1], 1)
    err = answered.value
    assert (err.status, err.type, err.code) == (507, "server_error", "store_full")
    assert "store is full" in err.message and "not stored" in err.message
    assert await store.load("kept") == before
    await store.close()


def _agent_turn(rng: random.Random, turn: int, segment_len: int, text_bytes_per_token: float, sizes=None):
    """An agent turn: a long first prompt (system, tools, task), then tool results and answers; the
    messages carry the text of their tokens (about 4 bytes a token of English)."""
    prompt, gen = sizes or ((1000, 200) if turn == 1 else (150, 200))
    d = synthetic_delta(rng, turn=turn, segment_index=0, new_segment=turn == 1, segment_len=segment_len,
                        prompt_tokens=prompt, gen_tokens=gen)
    d.new_messages = [{"role": "user" if turn == 1 else "tool", "content": "x" * int(prompt * text_bytes_per_token)},
                      {"role": "assistant", "content": "y" * int(gen * text_bytes_per_token)}]
    return d


async def _stored_bytes(store, rollout_id: str) -> int:
    keys = [k async for k in store.client.scan_iter(match=store.key_pattern(rollout_id))]
    return sum([await store.client.memory_usage(k, samples=0) for k in keys])


async def _store_rollout(store, rollout_id: str, turns: int, make) -> int:
    rng, length = random.Random(0), 0
    for t in range(1, turns + 1):
        delta = make(rng, t, length)
        await store.append_turn(rollout_id, delta, expected_turn=t - 1)
        length += len(delta.token_ids)
    return length


async def test_a_stored_token_costs_about_ten_bytes_plus_its_message_text_and_a_turn_about_300(redis_server):
    store = RedisRolloutStore.from_url(redis_server, key_prefix=f"mem{uuid.uuid4().hex[:8]}")
    tokens = await _store_rollout(store, "bare", 20, lambda rng, t, n: _agent_turn(rng, t, n, 0.0))
    bare = await _stored_bytes(store, "bare") / tokens
    await _store_rollout(store, "text", 20, lambda rng, t, n: _agent_turn(rng, t, n, 4.0))
    text = await _stored_bytes(store, "text") / tokens
    await _store_rollout(store, "turns", 40, lambda rng, t, n: _agent_turn(rng, t, n, 0.0, sizes=(1, 1)))
    per_turn = await _stored_bytes(store, "turns") / 40
    print(f"{tokens} tokens in 20 turns: {bare:.1f} B/token without message text, {text:.1f} B/token with "
          f"4 B/token of text; {per_turn:.0f} B per turn of 2 tokens and 2 empty messages")
    assert 9 <= bare <= 11.5  # int32 id + float32 logprob + uint8 mask, plus allocator slack and the turn records
    assert 3.5 <= text - bare <= 5  # the messages: their text, stored once
    assert per_turn <= 400  # turn record, two message entries, render context, weight span
    await store.close()
