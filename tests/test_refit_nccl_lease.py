"""A trainer that dies in the middle of an NCCL weight-update round leaves no engine paused: the
round runs under a lease the trainer renews with every call; when it runs out, every engine
reloads its last committed weights and resumes, the lock and the fleet's refit bracket are released.

vLLM's NCCL weight transfer needs GPUs; here the round's vLLM-specific worker calls are replaced by
no-op worker methods (subclass below), so the controller's own lease logic runs on a real engine.
"""

from __future__ import annotations

import asyncio
import sys
import time

import pytest
import ray
from ray import cloudpickle

from rollout_service.refit.controller import RefitController

pytestmark = pytest.mark.engine

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # Ray workers cannot import test modules

LEASE_S = 2.0


class NoNcclController(RefitController):
    """The real controller; only the two calls that need a GPU NCCL engine are stand-ins."""

    _NCCL_START = _NCCL_FINISH = "rs_weights_checksum"  # any worker method that succeeds on CPU

    async def nccl_init_weight_transfer_engine(self, init_info: dict) -> None:
        view = await self._view()
        self._nccl_members = [list(m.key) for m in view.members]


@pytest.fixture(scope="module")
def rig(ray_session, tiny_model_dir):
    from rollout_service.config import RolloutServiceConfig
    from rollout_service.fleet.fleet import EngineFleet

    cfg = RolloutServiceConfig.model_validate({"engine": {"model": str(tiny_model_dir)},
                                               "refit": {"step_timeout_s": 30, "lease_s": LEASE_S}}).model_dump()
    fleet = ray.remote(EngineFleet).options(num_cpus=0, max_concurrency=1000).remote(cfg)
    controller = ray.remote(NoNcclController).options(num_cpus=0, max_concurrency=1000).remote(cfg, fleet)
    ray.get(controller.start.remote(), timeout=600)
    yield controller, fleet
    try:
        ray.get(fleet.shutdown.remote(), timeout=60)
    finally:
        ray.kill(controller)
        ray.kill(fleet)


async def test_an_abandoned_nccl_round_resumes_every_engine_when_its_lease_runs_out(rig):
    from rollout_service.refit.types import RefitFailed, RefitInProgress

    controller, fleet = rig
    engine = (await controller.get_engines.remote())[0]
    checksum = await controller.weights_checksums.remote()
    await controller.nccl_init_weight_transfer_engine.remote({})
    await controller.nccl_start_weight_update.remote()
    assert await engine.is_paused.remote() and (await fleet.stats.remote())["refitting"]
    with pytest.raises(RefitInProgress):
        await controller.nccl_start_weight_update.remote()
    t0 = time.monotonic()
    # The trainer dies here: no update, no finish, no renewal.
    while await engine.is_paused.remote():
        assert time.monotonic() - t0 < LEASE_S + 10, "engines still paused after the lease ran out"
        await asyncio.sleep(0.1)
    released_s = time.monotonic() - t0
    print(f"lease {LEASE_S}s: engines resumed {released_s:.1f}s after the trainer's last call")
    assert released_s >= LEASE_S - 0.5
    stats = await controller.stats.remote()
    assert not stats["refitting"] and stats["num_failed_refits"] == 1 and stats["weight_version"] == "0"
    assert not (await fleet.stats.remote())["refitting"]
    assert await controller.weights_checksums.remote() == checksum  # reloaded the committed weights
    # A late call of the dead trainer's round is refused; a new round can start.
    with pytest.raises(RefitFailed, match="no NCCL weight update in progress"):
        await controller.nccl_update_weights.remote({})
    await controller.nccl_start_weight_update.remote()
    await controller.nccl_finish_weight_update.remote("lease-1")
    assert not await engine.is_paused.remote() and await engine.weight_version.remote() == "lease-1"
