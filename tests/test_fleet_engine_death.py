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


@pytest.mark.leaves_rig_healing  # the replacement is the other test's subject; none waits for this one's
async def test_turns_whose_engine_dies_mid_generation_continue_on_the_other_engine(fleet_rig, tiny_model_dir):
    """Three calls in flight on one engine, killed (kill -9) once the streamed one has passed on 8
    tokens: the streamed call continues on the other engine from its prompt + those tokens (one
    unbroken stream, the stored turn equal to it, logprobs equal to a float32 forward across the
    seam, `migrations: 1`), so does the non-streamed one (streamed from its engine at
    fleet.nonstream_progress_s: its first token at once, so its progress is known), and the
    streamed one whose sampling cannot be continued exactly (presence penalty) answers 503
    engine_lost naming why. The next turn of the migrated rollout continues its tokens exactly."""
    from engine_helpers import hf_sampled_logprobs, load_hf_model
    from fleet_helpers import run_events, turn_request

    rig = fleet_rig
    base = load_file(str(tiny_model_dir / "model.safetensors"))
    await rig.wait_serving(2)
    report = await asyncio.to_thread(rig.trainer.refit, "mig-base", base, transport="object_store")
    assert report["ok"]  # the model's own weights again: the float32 forward below is the reference
    pids = await rig.member_pids()
    view = await rig.view()
    victim = view.members[1]
    runner = rig.runner
    rids = {kind: new_rid(f"mig-{kind}") for kind in ("stream", "plain", "penalty")}
    for rid in rids.values():
        runner.fleet.pins[rid] = victim.key  # all three start on the victim
    messages = {kind: [{"role": "user", "content": f"{rid}: write a long list"}] for kind, rid in rids.items()}
    passed: list[int] = []
    killed = {}

    def on_stream(event):
        if event["kind"] == "delta":
            passed.extend(event["token_ids"])
        if len(passed) >= 8 and not killed:
            killed["at"] = list(passed)
            kill_pid(pids[victim.slot])

    def req(kind, **extra):
        r = turn_request(rids[kind], messages[kind], seed=41, stream=kind != "plain", max_tokens=160)
        r.sampling.update(extra)
        return r

    penalty_events: list[dict] = []
    stream_events, plain_events, penalty_events = await asyncio.gather(
        run_events(runner, req("stream"), on_stream), run_events(runner, req("plain")),
        run_events(runner, req("penalty", presence_penalty=0.5)))
    assert killed, "the streamed call ended before the kill"

    # Streamed: one unbroken answer, continued on the other engine.
    final = stream_events[-1]
    assert "__error__" not in final, final
    gen = final["generation_token_ids"]
    streamed = [t for e in stream_events[:-1] for t in e["token_ids"]]
    assert streamed == gen and len(gen) == 160 and gen[: len(killed["at"])] == killed["at"]
    assert final["rollout"]["migrations"] == 1 and final["engine_index"] != victim.slot
    assert final["weight_versions"] == [{"version": "mig-base", "start": 0, "end": 160, "kv_version": "mig-base"}]
    state = await rig.store.load(rids["stream"])
    seg = state.segments[0]
    assert seg.token_ids == final["prompt_token_ids"] + gen and seg.turns[0].migrations == 1
    assert seg.logprobs[len(final["prompt_token_ids"]):] == final["generation_log_probs"]
    ref = hf_sampled_logprobs(load_hf_model(str(tiny_model_dir)), final["prompt_token_ids"], gen)
    worst = max(abs(a - b) for a, b in zip(final["generation_log_probs"], ref))
    print(f"migrated after {len(killed['at'])} tokens; max |logprob - fp32 forward| over 160 tokens: {worst:.2e}")
    assert worst <= 1e-4

    # Non-streamed: the client gets one answer; it too continued on the other engine from the ids
    # its engine had generated, exact across the seam.
    plain = plain_events[-1]
    assert "__error__" not in plain and len(plain["generation_token_ids"]) == 160, plain
    assert plain["rollout"]["migrations"] == 1 and plain["engine_index"] != victim.slot, plain["rollout"]
    await assert_trajectory_exact(rig.store, rids["plain"], [plain])
    ref = hf_sampled_logprobs(load_hf_model(str(tiny_model_dir)), plain["prompt_token_ids"], plain["generation_token_ids"])
    worst_plain = max(abs(a - b) for a, b in zip(plain["generation_log_probs"], ref))
    print(f"non-streamed call continued; max |logprob - fp32 forward| over 160 tokens: {worst_plain:.2e}")
    assert worst_plain <= 1e-4

    # Presence penalty counts generated ids: not continued, the retryable 503 says why; nothing stored.
    err = penalty_events[-1]
    assert err.get("__error__") == 503 and "presence" in err["error"]["message"], err
    assert await rig.store.load(rids["penalty"]) is None

    # The migrated rollout's next turn continues its stored tokens exactly.
    messages["stream"] += [{"role": "assistant", "content": final["message"]["content"]},
                           {"role": "user", "content": "and one more"}]
    nxt = (await run_events(runner, req("stream")))[-1]
    assert "__error__" not in nxt
    await assert_trajectory_exact(rig.store, rids["stream"], [final, nxt])
