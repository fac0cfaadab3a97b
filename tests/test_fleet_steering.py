"""What a trainer steers, on the real data plane (TurnRunner + FleetClient) over two real vLLM engines,
the real fleet and refit controller and the session's redis-server: aborting a rollout while it
generates, and the staleness bound against real refits."""

from __future__ import annotations

import asyncio
import shutil
import time

import pytest

from fleet_helpers import new_rid, run_events, turn_request
from rollout_service.serve.protocol.envelope import ServiceError


async def _first_call(runner, rid: str) -> tuple[list[dict], dict]:
    messages = [{"role": "user", "content": f"{rid}: count the stars"}]
    first = (await run_events(runner, turn_request(rid, messages, seed=1, stream=False, max_tokens=4)))[-1]
    assert "__error__" not in first, first
    return messages + [{"role": "assistant", "content": first["message"]["content"]},
                       {"role": "user", "content": "go on"}], first


async def test_an_abort_ends_the_running_call_at_once_keeps_its_tokens_and_refuses_the_next(fleet_rig):
    rig = fleet_rig
    rid, other = new_rid("abort"), new_rid("bystander")
    messages, _ = await _first_call(rig.runner, rid)
    other_messages, _ = await _first_call(rig.runner, other)
    started = asyncio.Event()
    long_call = asyncio.create_task(run_events(
        rig.runner, turn_request(rid, messages, seed=2, stream=True, max_tokens=900),
        on_event=lambda e: started.set() if e["kind"] == "delta" else None))
    bystander = asyncio.create_task(run_events(
        rig.runner, turn_request(other, other_messages, seed=3, stream=True, max_tokens=24)))
    await asyncio.wait_for(started.wait(), 120)
    t0 = time.monotonic()
    answer = await rig.runner.abort_rollout(rid, "dropped by dynamic sampling")
    events = await asyncio.wait_for(long_call, 30)
    ended_s = time.monotonic() - t0
    assert answer["status"] == "aborted" and answer["aborted_calls"] == 1 and not answer["already_aborted"]
    final = events[-1]
    assert final["kind"] == "final" and final["finish_reason"] == "abort", final
    assert ended_s < 1.0, f"the aborted call ended {ended_s:.2f}s after the abort"
    generated = final["generation_token_ids"]
    assert 0 < len(generated) < 900
    # Its tokens so far are stored and marked; the rollout says aborted, with the reason.
    state = await rig.store.load(rid)
    assert state.turn == 2 and (state.status, state.status_reason) == ("aborted", "dropped by dynamic sampling")
    record = state.segments[-1].turns[-1]
    assert record.finish_reason == "abort" and state.segments[-1].token_ids[record.gen_start:record.gen_end] == generated
    # The other rollout's call was not touched.
    done = (await bystander)[-1]
    assert done["finish_reason"] == "length" and len(done["generation_token_ids"]) == 24
    # The next call: 409 rollout_aborted, nothing generated or stored.
    after = messages + [{"role": "assistant", "content": final["message"]["content"]}, {"role": "user", "content": "x"}]
    refused = (await run_events(rig.runner, turn_request(rid, after, seed=4, stream=False, max_tokens=4)))[-1]
    assert refused["__error__"] == 409 and refused["error"]["code"] == "rollout_aborted", refused
    assert "dropped by dynamic sampling" in refused["error"]["message"]
    assert (await rig.store.load(rid)).turn == 2
    # Idempotent, also through the trainer's handle; an unknown rollout is 404 (the handle: None).
    again = await asyncio.to_thread(rig.trainer.abort, rid, "again")
    assert again["already_aborted"] and again["reason"] == "dropped by dynamic sampling" and again["aborted_calls"] == 0
    with pytest.raises(ServiceError) as unknown:
        await rig.runner.abort_rollout(new_rid("never"))
    assert (unknown.value.status, unknown.value.code) == (404, "rollout_not_found")
    assert await asyncio.to_thread(rig.trainer.abort, new_rid("never")) is None


async def test_the_trainer_aborts_a_running_call_through_its_handle(fleet_rig):
    rig = fleet_rig
    rid = new_rid("trainer-abort")
    messages, _ = await _first_call(rig.runner, rid)
    # Not streamed: the abort reaches a call whose client waits for one answer, too.
    call = asyncio.create_task(run_events(rig.runner, turn_request(rid, messages, seed=7, stream=False, max_tokens=900)))
    deadline = time.monotonic() + 120
    while not (await asyncio.to_thread(rig.trainer.stats))["in_flight"]:
        assert time.monotonic() < deadline and not call.done(), "the call never reached its engine"
        await asyncio.sleep(0.05)
    answer = await asyncio.to_thread(rig.trainer.abort, rid, "early stop")
    final = (await asyncio.wait_for(call, 30))[-1]
    assert answer["aborted_calls"] == 1 and final["finish_reason"] == "abort", (answer, final)
    state = await rig.store.load(rid)
    assert state.turn == 2 and (state.status, state.status_reason) == ("aborted", "early stop")


async def test_the_trainer_aborts_a_group_whose_members_are_on_their_first_call(fleet_rig):
    """A call with n = 4 under a rollout id (its members R/0..R/3, on two engines: with prefix caching
    off, where they run buys nothing, the policy spreads them), aborted through the trainer's handle while every member generates its first call: each ends at
    once with finish_reason abort and its tokens so far stored; TrainerClient.group reads them, the
    members' next calls get 409."""
    from rollout_service.serve.fanout import group_turns
    from rollout_service.training import rows_from_group

    rig = fleet_rig
    rid = new_rid("group-abort")
    messages = [{"role": "user", "content": f"{rid}: count the stars"}]
    members = group_turns(turn_request(rid, messages, seed=5, stream=True, max_tokens=900), 4)
    await rig.runner.note_group(rid, [m.rollout_id for m in members], "running")  # as the n call does first
    started = {m.rollout_id: asyncio.Event() for m in members}
    calls = [asyncio.create_task(run_events(rig.runner, m, on_event=lambda e, m=m: started[m.rollout_id].set()
                                            if e["kind"] == "delta" else None)) for m in members]
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started.values())), 120)
    t0 = time.monotonic()
    answer = await asyncio.to_thread(rig.trainer.abort_group, rid, "over-sampled")
    finals = [e[-1] for e in await asyncio.wait_for(asyncio.gather(*calls), 30)]
    ended_s = time.monotonic() - t0
    assert answer["aborted_calls"] == 4 and [m["id"] for m in answer["members"]] == [f"{rid}/{j}" for j in range(4)]
    assert all(f["kind"] == "final" and f["finish_reason"] == "abort" for f in finals), finals
    assert ended_s < 1.5, f"the members ended {ended_s:.2f}s after the abort (the handle's round trip included)"
    group = await asyncio.to_thread(rig.trainer.group, rid)
    assert group["states"]["aborted"] == 4
    for member, final in zip(group["members"], finals):
        assert member["status_reason"] == "over-sampled" and member["turns"] == 1
        seg = member["trajectory"]["segments"][0]
        assert seg["token_ids"] == final["prompt_token_ids"] + final["generation_token_ids"]
        assert 0 < len(final["generation_token_ids"]) < 900
    assert rows_from_group(group) == []  # none finished
    refused = (await run_events(rig.runner, turn_request(f"{rid}/2", messages, seed=9, stream=False, max_tokens=4)))[-1]
    assert refused["__error__"] == 409 and refused["error"]["code"] == "rollout_aborted", refused
    again = await asyncio.to_thread(rig.trainer.abort_group, rid, "again")
    assert again["aborted_calls"] == 0 and all(m["already_aborted"] for m in again["members"])
    assert await asyncio.to_thread(rig.trainer.group, new_rid("never")) is None
    assert await asyncio.to_thread(rig.trainer.abort_group, new_rid("never")) is None


async def test_a_call_past_the_staleness_bound_is_refused_and_nothing_is_stored(fleet_rig, tiny_model_dir, tmp_path):
    rig = fleet_rig
    rid, loose = new_rid("stale"), new_rid("loose")
    messages, first = await _first_call(rig.runner, rid)
    loose_messages, _ = await _first_call(rig.runner, loose)
    started_on = first["weight_versions"][0]["version"]
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    shutil.copy(tiny_model_dir / "model.safetensors", ckpt / "model.safetensors")
    labels = [f"{rid}-v{i}" for i in range(3)]
    for label in labels:  # three refits between the two calls (the same weights: only the labels matter here)
        report = await asyncio.to_thread(rig.trainer.refit, label, str(ckpt), transport="path")
        assert report["ok"], report
    await rig.wait_serving(2, version=labels[-1])
    assert (await rig.view()).lag(started_on) == 3  # the fleet's own view (the runner's copy may lag behind)

    req = turn_request(rid, messages, seed=5, stream=False, max_tokens=4)
    req.max_staleness = 1
    refused = (await run_events(rig.runner, req))[-1]
    assert refused["__error__"] == 409 and refused["error"]["code"] == "rollout_stale", refused
    assert started_on in refused["error"]["message"] and labels[-1] in refused["error"]["message"]
    state = await rig.store.load(rid)
    assert state.turn == 1 and state.status == "stale" and "bound is 1" in state.status_reason
    # Within the bound, or with none (rollouts.max_staleness unset): admitted, on the new version.
    req.max_staleness = 3
    ok = (await run_events(rig.runner, req))[-1]
    assert "__error__" not in ok and ok["weight_versions"][0]["version"] == labels[-1]
    admitted = (await run_events(rig.runner, turn_request(loose, loose_messages, seed=6, stream=False, max_tokens=4)))[-1]
    assert "__error__" not in admitted and (await rig.store.load(loose)).turn == 2
