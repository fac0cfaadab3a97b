"""An engine killed (kill -9) under load: no acknowledged turn is lost, calls in flight on it fail
with 503 or are retried on the other engine, every later turn is exact, and the fleet replaces the
engine on the current weights; a refit after the replacement reaches both engines."""

from __future__ import annotations

import asyncio
import time

import pytest
from safetensors.torch import load_file

from fleet_helpers import assert_trajectory_exact, kill_pid, new_rid, run_rollout
from refit_helpers import perturbed


N_ROLLOUTS = 16
TURNS = 3


async def test_killed_engine_loses_no_turn_and_comes_back_on_the_current_weights(fleet_rig, tiny_model_dir):
    rig = fleet_rig
    base = load_file(str(tiny_model_dir / "model.safetensors"))
    # The current version is not the model's own weights: a replacement must load it.
    report = await asyncio.to_thread(rig.trainer.refit, "death-1", perturbed(base, seed=11), transport="object_store")
    assert report["ok"] and sorted(report["engines"]) == [0, 1]
    before = await rig.checksums_by_slot()
    assert len(before) == 2 and len(set(before.values())) == 1
    await asyncio.to_thread(rig.trainer.init_weight_sync)  # a gloo group over both engines
    pids = await rig.member_pids()
    generations = {s["slot"]: s["generation"] for s in (await rig.stats())["slots"]}

    log: list[dict] = []
    rids = [new_rid("death") for _ in range(N_ROLLOUTS)]
    tasks = [asyncio.create_task(run_rollout(rig.runner, rid, TURNS, stream=i % 2 == 0, seed0=1000 * i, log=log))
             for i, rid in enumerate(rids)]
    victim = 1
    victim_key = (victim, generations[victim])
    deadline = time.monotonic() + 60
    while rig.runner.fleet.outstanding.get(victim_key, 0) < 2:  # kill it with calls in flight
        assert time.monotonic() < deadline, "no call reached the victim engine"
        await asyncio.sleep(0.01)
    in_flight_at_kill = rig.runner.fleet.outstanding.get(victim_key, 0)
    kill_pid(pids[victim])
    t_kill = time.monotonic()

    results = await asyncio.gather(*tasks)
    for rid, acked in zip(rids, results):
        await assert_trajectory_exact(rig.store, rid, acked)
    failed = [e for e in log if e["error"]]
    print(f"{in_flight_at_kill} calls in flight on the victim; {len(failed)} of {len(log)} calls answered 503 "
          f"(then retried by the agent); {N_ROLLOUTS * TURNS} turns acknowledged and stored")
    assert len(log) == N_ROLLOUTS * TURNS + len(failed)

    heal_s = await rig.wait_serving(2, version="death-1")
    print(f"kill -> two engines serving again: {time.monotonic() - t_kill:.1f}s (waited {heal_s:.1f}s after the rollouts)")
    stats = await rig.stats()
    slot = stats["slots"][victim]
    assert slot["generation"] > generations[victim] and slot["replacements"] >= 1 and slot["state"] == "healthy"
    # The replacement serves the current version: same label, same bytes as the survivor.
    assert await rig.versions_by_slot() == {0: "death-1", 1: "death-1"}
    assert await rig.checksums_by_slot() == before

    # New rollouts use the replacement (least loaded across the fleet), with exact trajectories.
    fresh = [new_rid("after") for _ in range(4)]
    finals = await asyncio.gather(*[run_rollout(rig.runner, rid, 1, stream=False, seed0=7 * i, log=[])
                                    for i, rid in enumerate(fresh)])
    assert {acked[0]["engine_index"] for acked in finals} == {0, 1}

    # A collective refit after the replacement: the trainer's group predates it, the client re-forms it.
    after = await asyncio.to_thread(rig.trainer.refit, "death-2", perturbed(base, seed=12))
    assert after["ok"] and sorted(after["engines"]) == [0, 1] and after["requests_aborted"] == 0
    sums = await rig.checksums_by_slot()
    assert sums[0] == sums[1] != before[0]
    assert await rig.versions_by_slot() == {0: "death-2", 1: "death-2"}
