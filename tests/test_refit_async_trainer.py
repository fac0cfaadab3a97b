"""TrainerClient's awaitable API in an async Ray actor: the trainer's event loop keeps running.

The trainer is an async Ray actor (the usual shape of an async RL trainer) holding a
``TrainerClient``; a ticker coroutine in the same actor records the longest gap between its ticks
while the client joins the gloo group and refits a real vLLM engine (one RefitController). The awaitable methods must give the sync path's results and exceptions, never call
``ray.get`` (Ray's own "blocking ray.get inside async actor" flag stays down), and leave the loop
free: the largest tick gap stays well under the refit's duration. A last test runs the sync
``refit`` on the loop as the control: the same bytes reach the engine, and the ticker sees the
loop blocked for the whole refit. Weight versions advance through the module: tests run in order.
The controller and its engine are tests/test_refit.py's (``refit_controller``: one engine start
for both modules), so this module's versions are named for it and it starts from whatever weights
that module left.
"""

from __future__ import annotations

import asyncio
import sys
import threading
import time

import pytest
import ray
from ray import cloudpickle

from refit_helpers import perturbed


HOLD_S = 1.0  # the trainer holds the broadcast after bucket 0: every refit below lasts longer than this
MAX_GAP_S = 0.5  # a free event loop ticks every 10 ms; a blocked one not for the whole refit

# Ray's workers cannot import a test module: ship the trainer actor's class by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


@ray.remote(num_cpus=0)
class AsyncTrainer:
    def __init__(self, controller, checkpoint_dir: str):
        # A trainer has torch.distributed imported already; importing it in the client's worker thread
        # (~0.2 s of Python holding the GIL) would show up in the first tick gap without being a block.
        import torch.distributed  # noqa: F401

        from rollout_service.refit.client import TrainerClient

        self.client = TrainerClient(controller, timeout_s=60, bucket_bytes=8 * 1024 * 1024)  # several buckets
        self.other = TrainerClient(controller, timeout_s=60)  # a second trainer, for the controller's lock
        self.checkpoint_dir = checkpoint_dir

    async def _ticking(self, awaitable) -> dict:
        """Await ``awaitable`` while a ticker coroutine measures the loop; result or exception."""
        gaps = {"max": 0.0}
        done = asyncio.Event()

        async def ticker():
            last = time.monotonic()
            while not done.is_set():
                await asyncio.sleep(0.01)
                now = time.monotonic()
                gaps["max"] = max(gaps["max"], now - last)
                last = now

        tick = asyncio.create_task(ticker())
        await asyncio.sleep(0.05)
        t0 = time.monotonic()
        result = error = None
        try:
            result = await awaitable
        except Exception as exc:  # returned to the test, which checks its type
            error = exc
        seconds = time.monotonic() - t0
        done.set()
        await tick
        return {"result": result, "error": error, "seconds": seconds, "max_gap": gaps["max"],
                "ray_get_used": _ray_get_used_in_async_actor()}

    @staticmethod
    def _hold(started: threading.Event | None = None, hold_s: float = HOLD_S):
        def on_bucket(i):  # runs in the client's sending thread
            if i == 0:
                if started is not None:
                    started.set()
                time.sleep(hold_s)
        return on_bucket

    async def init(self) -> dict:
        return await self._ticking(self.client.ainit_weight_sync())

    async def refit(self, version, params, hold: bool = True, **kw) -> dict:
        on_bucket = self._hold() if hold and kw.get("transport", "collective") == "collective" else None
        return await self._ticking(self.client.arefit(version, params, on_bucket=on_bucket, **kw))

    async def collect_garbage(self) -> dict:
        """A full collection on the loop: frees whatever a refused refit left (its out-of-step group)."""
        async def collect():
            import gc

            return gc.collect()

        return await self._ticking(collect())

    async def queries(self) -> dict:
        return await self._ticking(asyncio.gather(self.client.astats(), self.client.aweights_checksums(),
                                                  self.client.aget_rollout("no-such-rollout"), return_exceptions=True))

    async def overlapping(self, version, params, other_version) -> dict:
        """A refit held mid-broadcast; meanwhile a second refit on this client and one from another
        client (the controller's lock) are refused. Both refusals come back while the loop ticks."""
        started = threading.Event()
        first = asyncio.create_task(self.client.arefit(version, params, on_bucket=self._hold(started, 2.0)))
        while not started.is_set():
            await asyncio.sleep(0.01)
        same = await self._ticking(self.client.arefit(other_version, params, transport="object_store"))
        other = await self._ticking(self.other.arefit(other_version, self.checkpoint_dir, transport="path"))
        return {"same_client": same, "other_client": other, "first": await first}

    async def cancelled(self, version, params) -> dict:
        """Cancelling the await (a timeout) does not stop the refit; the client stays busy until it ends."""
        timed_out = await self._ticking(asyncio.wait_for(
            self.client.arefit(version, params, on_bucket=self._hold()), 0.3))
        busy = await self._ticking(self.client.arefit(version + "-again", params))
        while self.client._lock.locked():
            await asyncio.sleep(0.05)
        stats = await self.client.astats()
        return {"timed_out": timed_out, "busy": busy, "last_refit": stats["last_refit"],
                "version": stats["weight_version"]}

    async def blocking_sync_refit(self, version, params) -> dict:
        """The control: the sync API called on the loop (what the async API exists to avoid)."""
        async def sync_refit():
            return self.client.refit(version, params, on_bucket=self._hold())

        return await self._ticking(sync_refit())


def _ray_get_used_in_async_actor() -> bool:
    """Ray's own flag: set by the first ``ray.get`` called anywhere in an async actor's process."""
    from ray._private import worker

    return bool(getattr(worker, "blocking_get_inside_async_warned", False))


# --------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def controller(refit_controller):
    return refit_controller


@pytest.fixture(scope="module")
def trainer(controller, tiny_model_dir):
    actor = AsyncTrainer.remote(controller, str(tiny_model_dir))
    yield actor
    ray.kill(actor)


@pytest.fixture(scope="module")
def base_weights(tiny_model_dir):
    from safetensors.torch import load_file

    return load_file(str(tiny_model_dir / "model.safetensors"))


def _free_loop(out: dict, *, longer_than: float | None = None) -> None:
    print(f"awaited {out['seconds']:.2f}s, max tick gap {out['max_gap'] * 1000:.0f} ms")
    assert out["max_gap"] < MAX_GAP_S, out
    assert not out["ray_get_used"], "the awaitable API called ray.get inside the async actor"
    if longer_than is not None:
        assert out["seconds"] > longer_than, out


# ------------------------------------------------------------------------------------ tests
async def test_async_init_and_refits_leave_the_trainer_loop_free(controller, trainer, base_weights):
    c0 = await controller.weights_checksums.remote()

    init = await trainer.init.remote()
    assert init["error"] is None, init["error"]
    assert init["result"]["world_size"] == 2 and init["result"]["worker_ranks"] == [1]
    _free_loop(init)

    out = await trainer.refit.remote("async-1", perturbed(base_weights, seed=1))
    assert out["error"] is None, out["error"]
    report = out["result"]
    assert report["ok"] and report["version"] == "async-1" and report["transport"] == "collective"
    assert report["requests_aborted"] == 0 and report["trainer_send_s"] >= HOLD_S
    _free_loop(out, longer_than=HOLD_S)
    c1 = await controller.weights_checksums.remote()
    assert c1 != c0

    out = await trainer.refit.remote("async-2", perturbed(base_weights, seed=2), transport="object_store")
    assert out["error"] is None, out["error"]
    assert out["result"]["ok"] and out["result"]["transport"] == "object_store"
    _free_loop(out)
    c2 = await controller.weights_checksums.remote()
    assert c2 not in (c0, c1)

    queries = await trainer.queries.remote()
    stats, checksums, rollout = queries["result"]
    assert stats["weight_version"] == "async-2" and stats["last_refit"]["version"] == "async-2"
    assert checksums == c2
    assert isinstance(rollout, RuntimeError) and "redis_url" in str(rollout)  # this controller has no store
    _free_loop(queries)


async def test_refused_refits_raise_the_controllers_exception_from_the_await(controller, trainer, base_weights):
    from rollout_service.refit.types import RefitInProgress, WeightSyncNotInitialized

    w3 = perturbed(base_weights, seed=3)
    before = await controller.weights_checksums.remote()

    # Object store: the controller refuses a reused version; the await raises the ValueError itself.
    out = await trainer.refit.remote("async-1", w3, transport="object_store")
    assert type(out["error"]) is ValueError and "already used" in str(out["error"]), out["error"]
    _free_loop(out)

    # Collective: the refusal arrives while the trainer waits for the workers to join (the poll);
    # the pending handshake leaves the group out of step, so the client forgets it.
    out = await trainer.refit.remote("async-2", w3, hold=False)
    assert type(out["error"]) is ValueError and "already used" in str(out["error"]), out["error"]
    _free_loop(out)
    # Freeing that group (its handshake still pending) must not stall the loop for the group's timeout.
    _free_loop(await trainer.collect_garbage.remote())
    out = await trainer.refit.remote("async-3", w3, hold=False)
    assert type(out["error"]) is WeightSyncNotInitialized, out["error"]
    _free_loop(out)
    assert await controller.weights_checksums.remote() == before
    assert await controller.current_version.remote() == "async-2"

    init = await trainer.init.remote()
    assert init["error"] is None, init["error"]
    _free_loop(init)
    overlap = await trainer.overlapping.remote("async-3", w3, "async-4")
    for who in ("same_client", "other_client"):  # the client's own lock, then the controller's
        assert type(overlap[who]["error"]) is RefitInProgress, (who, overlap[who]["error"])
        _free_loop(overlap[who])
    assert overlap["first"]["ok"] and overlap["first"]["version"] == "async-3"
    assert await controller.weights_checksums.remote() != before

    out = await trainer.cancelled.remote("async-4", perturbed(base_weights, seed=4))
    assert isinstance(out["timed_out"]["error"], asyncio.TimeoutError)
    assert type(out["busy"]["error"]) is RefitInProgress
    assert out["last_refit"]["ok"] and out["version"] == "async-4"  # the cancelled await's refit completed
    _free_loop(out["timed_out"])
    _free_loop(out["busy"])


async def test_sync_refit_on_the_loop_blocks_it_and_loads_the_same_bytes(controller, trainer, base_weights):
    """The control: the sync path blocks the loop for the whole refit (the shim runs the coroutine to
    completion on a private loop in a worker thread while the caller's loop waits for it; it never
    calls ray.get either), and loads the same bytes as the async path did for the same weights
    (version 1's)."""
    out = await trainer.refit.remote("async-5", perturbed(base_weights, seed=1))  # async, version 1's weights
    assert out["error"] is None and out["result"]["ok"]
    _free_loop(out)
    c1 = await controller.weights_checksums.remote()
    await trainer.refit.remote("async-6", perturbed(base_weights, seed=6), transport="object_store")
    assert await controller.weights_checksums.remote() != c1

    sync = await trainer.blocking_sync_refit.remote("async-7", perturbed(base_weights, seed=1))
    assert sync["error"] is None and sync["result"]["ok"] and sync["result"]["transport"] == "collective"
    print(f"sync refit on the loop: {sync['seconds']:.2f}s, max tick gap {sync['max_gap']:.2f}s")
    assert sync["max_gap"] >= HOLD_S and not sync["ray_get_used"]
    assert await controller.weights_checksums.remote() == c1
