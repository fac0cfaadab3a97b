"""A rollout pinned to an engine that dies continues on another engine, from its stored tokens."""

from __future__ import annotations

import uuid

import pytest
import ray

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def doomed_engine(ray_session, engine_config):
    from rollout_service.engine.replica import create_engine_actor

    actor = create_engine_actor(engine_config, 1)
    ray.get(actor.start.remote(), timeout=300)
    yield actor
    ray.kill(actor)


async def _call(runner, rid, messages, seed):
    events = [e async for e in runner.run_call({"rollout_id": rid, "messages": messages, "max_tokens": 8,
                                                 "sampling": {"seed": seed}})]
    assert "__error__" not in events[-1], events[-1]
    return events[-1]


async def test_rollout_fails_over_to_a_live_engine(engine_actor, doomed_engine, redis_server, tiny_tokenizer, engine_config):
    from rollout_service.config import RolloutServiceConfig, StoreConfig
    from rollout_service.serve.turns import TurnRunner
    from rollout_service.store.redis_store import RedisRolloutStore

    cfg = RolloutServiceConfig(engine=engine_config, store=StoreConfig(redis_url=redis_server, key_prefix="failover"))
    store = RedisRolloutStore.from_config(cfg.store)
    runner = TurnRunner(cfg, [engine_actor, doomed_engine], store, tiny_tokenizer)
    rid = f"fo-{uuid.uuid4().hex[:8]}"
    runner.pool.pins[rid] = 1  # pinned to the engine that is about to die
    messages = [{"role": "user", "content": "first"}]
    first = await _call(runner, rid, messages, seed=1)
    assert first["engine_index"] == 1

    ray.kill(doomed_engine, no_restart=True)
    messages += [{"role": "assistant", "content": first["message"]["content"]}, {"role": "user", "content": "second"}]
    second = await _call(runner, rid, messages, seed=2)
    assert second["engine_index"] == 0 and runner.pool.dead == {1}
    base = first["prompt_token_ids"] + first["generation_token_ids"]
    assert second["prompt_token_ids"][: len(base)] == base
    state = await store.load(rid)
    assert state.turn == 2 and len(state.segments) == 1
    assert state.segments[0].token_ids == second["prompt_token_ids"] + second["generation_token_ids"]
    # New rollouts go to the live engine only.
    assert runner.pool.pick(f"new-{rid}") == 0
    await store.close()
