"""Refit with two engines: one gloo group of three ranks (trainer + a worker per engine).

The rank layout, the broadcast to several receivers with every receive posted up front, and the
all-or-nothing rules (no engine loads unless every engine staged everything; an aborted transfer
leaves every engine on its old weights) only show with more than one engine.

The engines are the session's two-engine fleet rig (tests/fleet_helpers.py; the fleet fault tests
leave it healed, both engines on one version), so versions are named for this module, and the
first test starts from whatever version the rig serves.
"""

from __future__ import annotations

import asyncio

import pytest
import ray

from refit_helpers import perturbed, prompts, split_at_refit, start_rollouts


PER_ENGINE = 3
GEN_TOKENS = 640  # of max_model_len 1024, after a ~20-token prompt


@pytest.fixture(scope="module")
async def controller(fleet_rig):
    await fleet_rig.wait_serving(2)
    return fleet_rig.controller


@pytest.fixture(scope="module")
async def engines(fleet_rig, controller):
    engines = (await fleet_rig.view()).handles()
    assert len(engines) == 2
    return engines


@pytest.fixture(scope="module")
def client(controller):
    from rollout_service.refit.client import TrainerClient

    c = TrainerClient(controller, timeout_s=60, bucket_bytes=8 * 1024 * 1024)  # several buckets
    info = c.init_weight_sync()
    assert info["world_size"] == 3 and sorted(info["worker_ranks"]) == [1, 2]
    return c


@pytest.fixture(scope="module")
def base_weights(tiny_model_dir):
    from safetensors.torch import load_file

    return load_file(str(tiny_model_dir / "model.safetensors"))


async def test_collective_refit_reaches_every_engine_mid_generation_exactly(
    controller, engines, client, tiny_tokenizer, base_weights
):
    before = await controller.weights_checksums.remote()
    assert len(before) == 2 and before[0] == before[1]
    v0 = await controller.current_version.remote()
    w1 = perturbed(base_weights, seed=1)  # before the rollouts: ~1 s on a loaded machine
    # Both engines' rollouts start together and are long enough to be mid-generation when the refit
    # pauses them, also on a slow machine (96, then 256 tokens once finished on one engine before
    # the refit counted them: 3 in flight instead of 6).
    started = await asyncio.gather(*[
        start_rollouts(engine, prompts(tiny_tokenizer, f"E{k}", PER_ENGINE), seed0=100 * k, max_tokens=GEN_TOKENS)
        for k, engine in enumerate(engines)])
    running = [task for tasks, _ in started for task in tasks]

    report = await asyncio.to_thread(client.refit, "multi-1", w1)
    assert report["ok"] and report["requests_in_flight"] == 2 * PER_ENGINE and report["requests_aborted"] == 0
    for _, _, last in await asyncio.gather(*running):
        assert last.finish_reason == "length"
        split_at_refit(last.weight_versions, v0, "multi-1", GEN_TOKENS)

    after = await controller.weights_checksums.remote()
    assert after[0] == after[1] != before[0]
    # The same state dict through the object store gives the same bytes on both engines.
    again = await asyncio.to_thread(client.refit, "multi-2", perturbed(base_weights, seed=1), transport="object_store")
    assert again["ok"] and await controller.weights_checksums.remote() == after
    assert await asyncio.gather(*[e.weight_version.remote() for e in engines]) == ["multi-2", "multi-2"]


async def test_aborted_transfer_leaves_every_engine_on_its_old_weights(controller, engines, client, base_weights):
    from rollout_service.refit.types import RefitFailed

    before = await controller.weights_checksums.remote()

    def fail_after_second_bucket(i):
        if i == 1:
            raise RuntimeError("injected: trainer died after bucket 1")

    with pytest.raises(RefitFailed) as err:
        await asyncio.to_thread(client.refit, "multi-3", perturbed(base_weights, seed=3), on_bucket=fail_after_second_bucket)
    assert err.value.report["failed_step"] == "transfer" and "trainer aborted the transfer" in err.value.report["error"]
    assert await controller.weights_checksums.remote() == before
    assert await asyncio.gather(*[e.weight_version.remote() for e in engines]) == ["multi-2", "multi-2"]
    assert not any(await asyncio.gather(*[e.is_paused.remote() for e in engines]))
    # The three-rank group is still in step.
    assert (await asyncio.to_thread(client.refit, "multi-3", perturbed(base_weights, seed=3)))["ok"]
    final = await controller.weights_checksums.remote()
    assert final[0] == final[1] != before[0]


async def test_a_trainer_that_stalls_mid_transfer_times_out_and_every_engine_resumes(
    controller, engines, client, base_weights
):
    import time

    from rollout_service.refit.types import RefitFailed, WeightSyncNotInitialized

    client.init_weight_sync(timeout_s=3)  # the group's receive timeout
    before = await controller.weights_checksums.remote()
    version = await controller.current_version.remote()

    def stall_after_first_bucket(i):
        if i == 0:
            time.sleep(8)  # the workers never get the trailer in time

    t0 = time.monotonic()
    with pytest.raises(RefitFailed) as err:
        await asyncio.to_thread(
            client.refit, "multi-4", perturbed(base_weights, seed=4), on_bucket=stall_after_first_bucket, timeout_s=3
        )
    elapsed = time.monotonic() - t0
    report = err.value.report
    print(f"stalled refit failed after {elapsed:.1f}s: {report['error']}")
    assert 8 <= elapsed < 45
    assert report["failed_step"] == "transfer" and not report["ok"] and report["requests_aborted"] == 0
    assert await controller.weights_checksums.remote() == before
    assert await controller.current_version.remote() == version
    assert not any(await asyncio.gather(*[e.is_paused.remote() for e in engines]))
    # The group is out of step: both sides forgot it, and say so instead of hanging.
    with pytest.raises(WeightSyncNotInitialized):
        client.refit("multi-4", perturbed(base_weights, seed=4))
    client.init_weight_sync()
    assert (await asyncio.to_thread(client.refit, "multi-4", perturbed(base_weights, seed=4)))["ok"]
