"""A group's shared prompt is prefilled once: the members of a call with ``n > 1`` under a rollout id
start together on the group's home engine, and with prefix caching on (salted by weight version)
every member after the first takes the prompt's KV from the cache (``message.rollout.cached_prompt_tokens``).
On the session's prefix-caching engine (shared with test_canary.py and test_refit_prefix_cache.py),
through the real data plane (TurnRunner, FleetClient) and the session's redis-server."""

from __future__ import annotations

import asyncio

from fleet_helpers import new_rid, run_events, turn_request


async def test_a_groups_prompt_is_prefilled_once_with_prefix_caching_on(raw_prefix_controller, redis_server,
                                                                         tiny_tokenizer, tiny_model_dir):
    from rollout_service.config import RolloutServiceConfig
    from rollout_service.fleet.client import connect
    from rollout_service.fleet.routing import make_policy
    from rollout_service.serve.fanout import group_turns
    from rollout_service.serve.turns import TurnRunner
    from rollout_service.store.redis_store import RedisRolloutStore

    cfg = RolloutServiceConfig.model_validate({
        "engine": {"model": str(tiny_model_dir), "enable_prefix_caching": True, "logprobs_mode": "raw_logprobs"},
        "store": {"redis_url": redis_server, "key_prefix": "groups"}})
    policy = make_policy(cfg.routing.policy, load_margin=cfg.routing.load_margin, prefix_caching=True)
    client = await connect(raw_prefix_controller.fleet_handle, policy=policy)
    store = RedisRolloutStore.from_config(cfg.store)
    runner = TurnRunner(cfg, client, store, tiny_tokenizer)
    try:
        rid = new_rid("prefill-once")
        text = " ".join(f"clue {i} says the box {i * 3} holds a {['key', 'coin', 'map'][i % 3]}." for i in range(45))
        members = group_turns(turn_request(rid, [{"role": "user", "content": f"{rid}: {text}"}], seed=3, stream=False,
                                           max_tokens=8), 4)
        await runner.note_group(rid, [m.rollout_id for m in members], "running")  # as the n call does first
        finals = [e[-1] for e in await asyncio.gather(*(run_events(runner, m) for m in members))]
        assert all("__error__" not in f for f in finals), finals
        prompt = finals[0]["prompt_token_ids"]
        assert all(f["prompt_token_ids"] == prompt for f in finals) and len(prompt) > 400
        cached = [f["rollout"].get("cached_prompt_tokens", 0) for f in finals]
        computed = sum(len(prompt) - c for c in cached)
        print(f"group of 4, prompt {len(prompt)} tokens: cached {cached}, computed {computed} "
              f"(4 separate prefills: {4 * len(prompt)})")
        assert sorted(cached)[0] == 0 and all(c >= len(prompt) // 2 for c in sorted(cached)[1:]), cached
        assert computed < 1.5 * len(prompt), (computed, cached)
        # each member is its own exact rollout, and the four samples are not one sample four times
        for m, f in zip(members, finals):
            seg = (await store.load(m.rollout_id)).segments[0]
            assert seg.token_ids == prompt + f["generation_token_ids"]
        assert len({tuple(f["generation_token_ids"]) for f in finals}) > 1
        doc = await runner.get_group(rid)
        assert doc["states"]["finished"] == 4 and [m["id"] for m in doc["members"]] == [m.rollout_id for m in members]
    finally:
        client.stop_watching()
        client.close_channels()
        await store.close()
