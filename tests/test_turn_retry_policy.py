"""retry_policy: replay (default) answers a repeated last call from the store; fork runs it as an edit."""

from __future__ import annotations

from fleet_helpers import new_rid, run_events, turn_request
from rollout_service.serve.turns import TurnRunner


async def _two_calls(runner, rid):
    messages = [{"role": "user", "content": f"{rid}: hello"}]
    first = (await run_events(runner, turn_request(rid, messages, seed=1, stream=False, max_tokens=4)))[-1]
    messages = messages + [{"role": "assistant", "content": first["message"]["content"]},
                           {"role": "user", "content": "again"}]
    second = (await run_events(runner, turn_request(rid, messages, seed=2, stream=False, max_tokens=4)))[-1]
    repeat = (await run_events(runner, turn_request(rid, messages, seed=2, stream=False, max_tokens=4)))[-1]
    return second, repeat


async def test_replay_policy_returns_the_stored_answer_and_fork_policy_forks(fleet_rig, tiny_tokenizer):
    rig = fleet_rig
    second, repeat = await _two_calls(rig.runner, new_rid("replay"))
    assert rig.config.service.retry_policy == "replay"
    assert repeat["replayed"] and repeat["rollout"]["turn"] == 2 and repeat["rollout"]["segment"] == 0
    assert repeat["generation_token_ids"] == second["generation_token_ids"]

    forking = rig.config.model_copy(deep=True)
    forking.service.retry_policy = "fork"
    runner = TurnRunner(forking, rig.runner.fleet, rig.store, tiny_tokenizer)
    rid = new_rid("fork")
    second, repeat = await _two_calls(runner, rid)
    assert not repeat["replayed"] and repeat["rollout"]["turn"] == 3 and repeat["rollout"]["segment"] == 1
    state = await rig.store.load(rid)
    assert state.turn == 3 and len(state.segments) == 2
