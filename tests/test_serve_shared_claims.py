"""A call's claim that every replica sees (serve/shared_claims.py): under HAProxy a call that names its
rollout only by X-Session-ID is balanced over the replicas, so its retry can reach another replica
while the first attempt still runs. Two turn runners on one store and one fleet are two replicas
here (the stand-in engines of ``sim_rig``; the claim is the data plane's and the store's); the
store's claim itself runs on a real redis-server."""

from __future__ import annotations

import asyncio
import dataclasses
import uuid

from fleet_helpers import new_rid, run_events, turn_request
from rollout_service.serve.turns import TurnRunner
from rollout_service.store import RedisRolloutStore


def _replicas(rig, tokenizer) -> tuple[TurnRunner, TurnRunner]:
    return rig.runner, TurnRunner(rig.config, rig.runner.fleet, rig.store, tokenizer)


async def _while_running(first_runner, first_req, second_runner, second_req, *, after_s: float = 0.0,
                         first_still_running: bool = False) -> tuple[list, list]:
    """The second call starts once the first one has streamed a token (and ``after_s`` more)."""
    started = asyncio.Event()
    first = asyncio.create_task(run_events(first_runner, first_req,
                                           on_event=lambda e: e["kind"] == "delta" and started.set()))
    await asyncio.wait_for(started.wait(), 60)
    await asyncio.sleep(after_s)
    second = await run_events(second_runner, second_req)
    if first_still_running:
        assert not first.done(), "the second call's answer came only after the first call ended"
    return await first, second


async def test_a_retry_on_another_replica_waits_for_the_call_and_is_answered_from_the_store(sim_rig, tiny_tokenizer):
    a, b = _replicas(sim_rig, tiny_tokenizer)
    rid = new_rid("claim-retry")
    req = dataclasses.replace(turn_request(rid, [{"role": "user", "content": "count"}], seed=3, stream=True,
                                           max_tokens=300), shared_claim=True)
    first, retry = await _while_running(a, req, b, dataclasses.replace(req, stream=False))
    assert first[-1]["kind"] == "final" and retry[-1]["kind"] == "final", (first[-1], retry[-1])
    assert not first[-1]["rollout"]["replayed"] and retry[-1]["rollout"]["replayed"]
    assert retry[-1]["generation_token_ids"] == first[-1]["generation_token_ids"]
    state = await sim_rig.store.load(rid)
    assert state.turn == 1 and len(state.segments) == 1


async def test_another_call_on_another_replica_while_one_runs_is_a_409_at_once_past_the_claims_first_expiry(
        sim_rig, tiny_tokenizer, monkeypatch):
    """Refused by the claim (not by a lost append after generating): at once, while the first call still
    runs, and after the claim's first expiry had passed (its holder renewed it)."""
    from rollout_service.serve import shared_claims

    monkeypatch.setattr(shared_claims, "CLAIM_TTL_S", 0.5)
    monkeypatch.setattr(shared_claims, "RENEW_EVERY_S", 0.15)
    a, b = _replicas(sim_rig, tiny_tokenizer)
    rid = new_rid("claim-other")
    req = dataclasses.replace(turn_request(rid, [{"role": "user", "content": "count"}], seed=3, stream=True,
                                           max_tokens=800), shared_claim=True)
    other = dataclasses.replace(req, messages=[{"role": "user", "content": "something else"}])
    first, second = await _while_running(a, req, b, other, after_s=0.8, first_still_running=True)
    assert first[-1]["kind"] == "final"
    assert second[-1].get("__error__") == 409 and second[-1]["error"]["code"] == "concurrent_turn", second[-1]
    assert "on another replica" in second[-1]["error"]["message"], second[-1]
    assert (await sim_rig.store.load(rid)).turn == 1
    # The claim ended with the call: the next call on the other replica runs.
    messages = [{"role": "user", "content": "count"},
                {"role": "assistant", "content": first[-1]["message"]["content"]}, {"role": "user", "content": "more"}]
    nxt = await run_events(b, dataclasses.replace(req, messages=messages, max_tokens=4))
    assert nxt[-1]["kind"] == "final" and nxt[-1]["rollout"]["turn"] == 2


async def test_a_replayed_answer_frees_the_rollout_for_its_next_call_on_another_replica(sim_rig, tiny_tokenizer):
    """A retry answered from the store ends its claim before its answer leaves, as a stored turn does."""
    a, b = _replicas(sim_rig, tiny_tokenizer)
    rid = new_rid("claim-replay")
    messages = [{"role": "user", "content": "count"}]
    req = dataclasses.replace(turn_request(rid, messages, seed=3, stream=False, max_tokens=8), shared_claim=True)
    first = await run_events(a, req)
    events = b.run_turn(req)  # the retry, consumed only up to its answer (as a client that stops reading)
    replay = None
    async for event in events:
        replay = event
        if not hasattr(event, "token_ids"):
            break
    assert replay.rollout["replayed"]
    nxt = dataclasses.replace(req, messages=messages + [{"role": "assistant", "content": first[-1]["message"]["content"]},
                                                        {"role": "user", "content": "more"}])
    out = await run_events(a, nxt)  # the generator of the retry is still open
    assert out[-1]["kind"] == "final" and out[-1]["rollout"]["turn"] == 2, out[-1]
    await events.aclose()


async def test_without_the_shared_claim_the_retry_on_another_replica_runs_again_and_loses(sim_rig, tiny_tokenizer):
    """What the shared claim is for: each replica's own claim alone lets the retry generate again, and
    one of the two appends is refused (what a client saw under HAProxy before)."""
    a, b = _replicas(sim_rig, tiny_tokenizer)
    req = turn_request(new_rid("claim-none"), [{"role": "user", "content": "count"}], seed=3, stream=True,
                       max_tokens=300)
    first, retry = await _while_running(a, req, b, dataclasses.replace(req, stream=False))
    outcomes = sorted(str(r[-1].get("__error__", "ok")) for r in (first, retry))
    assert outcomes == ["409", "ok"], (first[-1], retry[-1])


async def test_the_store_claim_is_held_once_renewed_and_released_by_its_holder_only(redis_server):
    s = RedisRolloutStore.from_url(redis_server, key_prefix=f"t{uuid.uuid4().hex[:8]}")
    try:
        assert await s.claim_call("r", "tok-a", 300) is None
        assert await s.claim_call("r", "tok-b", 300) == "tok-a"
        assert await s.renew_call("r", "tok-a", 300) and not await s.renew_call("r", "tok-b", 300)
        await s.release_call("r", "tok-b")  # not its claim: left alone
        assert await s.claim_call("r", "tok-b", 300) == "tok-a"
        await s.release_call("r", "tok-a")
        assert await s.claim_call("r", "tok-b", 200) is None
        await asyncio.sleep(0.3)  # a holder that stops renewing: the claim expires
        assert await s.claim_call("r", "tok-c", 200) is None
        assert await s.client.pttl(s.call_key("r")) > 0
    finally:
        await s.close()
