"""An engine killed in the middle of a refit: the refit fails cleanly (old version on every
survivor, all resumed, nothing aborted), the fleet replaces the engine on that old version, and
the next refit reaches both engines. On stand-in engines (``sim_rig``: they join the gloo group and
receive every bucket): the failure path is the controller's and the fleet's; a real engine's refit
after a replacement is tests/test_fleet_engine_death.py's."""

from __future__ import annotations

import asyncio

import pytest
from safetensors.torch import load_file

from fleet_helpers import kill_pid
from refit_helpers import perturbed



async def test_engine_killed_mid_transfer_fails_the_refit_cleanly(sim_rig, tiny_model_dir):
    from rollout_service.refit.client import TrainerClient
    from rollout_service.refit.types import RefitFailed

    rig = sim_rig
    base = load_file(str(tiny_model_dir / "model.safetensors"))
    trainer = TrainerClient(rig.controller, timeout_s=60, bucket_bytes=8 * 1024 * 1024)  # several buckets
    await asyncio.to_thread(trainer.init_weight_sync, timeout_s=5)  # receives time out after 5 s
    version = (await rig.view()).version
    checksums = await rig.checksums_by_slot()
    pids = await rig.member_pids()
    victim = 1

    def kill_after_first_bucket(i):
        if i == 0:
            kill_pid(pids[victim])

    with pytest.raises(RefitFailed) as err:
        await asyncio.to_thread(trainer.refit, "killed-mid-refit", perturbed(base, seed=21),
                                on_bucket=kill_after_first_bucket, timeout_s=10)
    report = err.value.report
    print(f"refit failed at {report['failed_step']}: {report['error'][:200]}")
    assert report["engines_lost"] == [victim] and not report["ok"] and report["requests_aborted"] == 0
    # The survivor: old weights, old label, not paused.
    survivors = await rig.checksums_by_slot()
    assert survivors and all(survivors[s] == checksums[s] for s in survivors)
    assert set((await rig.versions_by_slot()).values()) == {version}
    assert not any((await rig.paused_by_slot()).values())

    await rig.wait_serving(2, version=version)  # replaced on the old (current) version
    assert await rig.checksums_by_slot() == checksums
    await asyncio.to_thread(trainer.init_weight_sync)
    ok = await asyncio.to_thread(trainer.refit, "after-the-fault", perturbed(base, seed=22))
    assert ok["ok"] and sorted(ok["engines"]) == [0, 1]
    sums = await rig.checksums_by_slot()
    assert sums[0] == sums[1] != checksums[0]
    assert await rig.versions_by_slot() == {0: "after-the-fault", 1: "after-the-fault"}


async def test_refit_while_an_engine_is_down_proceeds_and_the_replacement_joins_on_the_new_version(
    sim_rig, tiny_model_dir
):
    rig = sim_rig
    base = load_file(str(tiny_model_dir / "model.safetensors"))
    await rig.wait_serving(2)
    pids = await rig.member_pids()
    victim = 0
    kill_pid(pids[victim])
    await rig.wait_not_serving(victim)
    report = await asyncio.to_thread(rig.trainer.refit, "while-down", perturbed(base, seed=41),
                                     transport="object_store")
    assert report["ok"] and report["engines"] == [1 - victim]  # over the live engine only
    survivor = (await rig.checksums_by_slot())[1 - victim]
    # The replacement may not serve before it holds "while-down": at no point two versions.
    t0 = asyncio.get_running_loop().time()
    while True:
        versions = await rig.versions_by_slot()
        assert set(versions.values()) == {"while-down"}, versions
        if len(versions) == 2:
            break
        assert asyncio.get_running_loop().time() - t0 < 300, "replacement never joined"
        await asyncio.sleep(0.2)
    assert await rig.checksums_by_slot() == {0: survivor, 1: survivor}
