"""In-flight weight refit on a real vLLM engine, gloo on CPU: keep-mode, versions, parity, safety.

One engine (default parity config) behind a RefitController actor (``refit_controller``, which
tests/test_refit_async_trainer.py uses next); the trainer side is a TrainerClient in this process
(rank 0 of the gloo group). Weight versions advance monotonically through the module, so the
tests run in file order; the first test needs the engine fresh (version "0", base weights).
"""

from __future__ import annotations

import asyncio
import copy
import threading
import time

import pytest
import ray

from rollout_service.engine.types import kv_spans
from engine_helpers import hf_sampled_logprobs, load_hf_model, stream_generation
from refit_helpers import N_ROLLOUTS, perturbed, prompts, split_at_refit, start_rollouts




# --------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def controller(refit_controller):
    return refit_controller


@pytest.fixture(scope="module")
def engine(controller):
    return ray.get(controller.get_engines.remote())[0]


@pytest.fixture(scope="module")
def client(controller):
    from rollout_service.refit.client import TrainerClient

    c = TrainerClient(controller, timeout_s=60, bucket_bytes=8 * 1024 * 1024)  # several buckets
    c.init_weight_sync()
    return c


@pytest.fixture(scope="module")
def base_weights(tiny_model_dir):
    from safetensors.torch import load_file

    return load_file(str(tiny_model_dir / "model.safetensors"))


_hf_cache: dict[int, object] = {}


def hf_model(tiny_model_dir, weights: dict, key: int):
    if key not in _hf_cache:
        model = copy.deepcopy(load_hf_model(str(tiny_model_dir)))
        model.load_state_dict(weights, strict=True)
        _hf_cache[key] = model
    return _hf_cache[key]


def max_abs(a, b) -> float:
    return max((abs(x - y) for x, y in zip(a, b)), default=0.0)


# ------------------------------------------------------------------------------------ tests
async def test_refit_keeps_streaming_rollouts_and_post_refit_tokens_match_new_weights(
    controller, engine, client, tiny_tokenizer, tiny_model_dir, base_weights
):
    """clear_cache=True: 8 rollouts frozen mid-generation, none aborted; tokens before the refit are
    the old model's exactly, tokens after it the new model's (KV recomputed), per the version spans."""
    w1 = perturbed(base_weights, seed=1)
    ps = prompts(tiny_tokenizer, "A")
    tasks, counts = await start_rollouts(engine, ps, seed0=100, max_tokens=200)

    report = await asyncio.to_thread(client.refit, "1", w1, clear_cache=True)
    assert report["ok"] and report["version"] == "1" and report["transport"] == "collective"
    assert report["requests_in_flight"] == N_ROLLOUTS and report["requests_aborted"] == 0
    assert report["bytes"] == sum(t.numel() * t.element_size() for t in w1.values())

    stats = await controller.stats.remote()  # rollouts still running, started on version 0
    assert stats["weight_version"] == "1"
    assert stats["in_flight_by_version"].get("0", 0) >= 1 and stats["lag"]["max"] == 1

    results = await asyncio.gather(*tasks)
    old_model = load_hf_model(str(tiny_model_dir))
    new_model = hf_model(tiny_model_dir, w1, 1)
    worst_old = worst_new = 0.0
    discrimination = []
    for prompt, (ids, lps, last) in zip(ps, results):
        assert last.finish_reason == "length" and len(ids) == 200
        k = split_at_refit(last.weight_versions, "0", "1", len(ids))
        # The KV was recomputed at resume by the new weights: every token is pure (kv_version = version).
        assert kv_spans(last.weight_versions, last.kv_resets, last.kv_base) == [("0", 0, k, "0"), ("1", k, len(ids), "1")]
        ref_old = hf_sampled_logprobs(old_model, prompt, ids)
        ref_new = hf_sampled_logprobs(new_model, prompt, ids)
        worst_old = max(worst_old, max_abs(lps[:k], ref_old[:k]))
        worst_new = max(worst_new, max_abs(lps[k:], ref_new[k:]))
        discrimination.append(max_abs(lps[k:], ref_old[k:]))
    print(f"clear_cache=True: pre-refit vs old max|Δ|={worst_old:.2e}, post-refit vs new max|Δ|={worst_new:.2e}, "
          f"post-refit vs old {max(discrimination):.2e}; report {report['total_s']:.3f}s")
    assert worst_old <= 1e-4 and worst_new <= 1e-4
    assert max(discrimination) > 1e-2  # the two weight sets are distinguishable by these logprobs


async def test_refit_without_clear_cache_keeps_stale_kv_for_in_flight_requests(
    controller, engine, client, tiny_tokenizer, tiny_model_dir, base_weights
):
    """clear_cache=False (the V0-like default): in-flight requests keep the KV computed by the old
    weights. Exact: tokens before the refit (old weights) and a fresh request after it (new
    weights). Not exact, by design: positions after the refit attend with new weights over old KV,
    and their spans say so (version new, kv_version old)."""
    w1, w2 = perturbed(base_weights, seed=1), perturbed(base_weights, seed=2)
    ps = prompts(tiny_tokenizer, "B")
    tasks, _ = await start_rollouts(engine, ps, seed0=200, max_tokens=160)
    report = await asyncio.to_thread(client.refit, "2", w2)  # clear_cache defaults to False
    assert report["ok"] and not report["clear_cache"] and report["requests_aborted"] == 0
    results = await asyncio.gather(*tasks)

    m1, m2 = hf_model(tiny_model_dir, w1, 1), hf_model(tiny_model_dir, w2, 2)
    worst_pre, post_vs_new, post_vs_old = 0.0, [], []
    for prompt, (ids, lps, last) in zip(ps, results):
        assert last.finish_reason == "length"
        k = split_at_refit(last.weight_versions, "1", "2", len(ids))
        # Sampled by "2" over KV "1" computed: the tokens after the refit say so (kv_version "1").
        assert kv_spans(last.weight_versions, last.kv_resets, last.kv_base) == [("1", 0, k, "1"), ("2", k, len(ids), "1")]
        worst_pre = max(worst_pre, max_abs(lps[:k], hf_sampled_logprobs(m1, prompt, ids)[:k]))
        post_vs_new.append(max_abs(lps[k:], hf_sampled_logprobs(m2, prompt, ids)[k:]))
        post_vs_old.append(max_abs(lps[k:], hf_sampled_logprobs(m1, prompt, ids)[k:]))
    print(f"clear_cache=False: pre-refit vs old {worst_pre:.2e}; post-refit vs new {max(post_vs_new):.2e}, "
          f"vs old {max(post_vs_old):.2e} (stale KV: neither)")
    assert worst_pre <= 1e-4
    assert max(post_vs_new) > 1e-4 and max(post_vs_old) > 1e-4  # mixed: matches neither pure model

    fresh = prompts(tiny_tokenizer, "B-fresh", 2)
    for i, p in enumerate(fresh):
        ids, lps, last = await stream_generation(engine, p, seed=300 + i, max_tokens=64, ignore_eos=True)
        assert last.weight_versions == [("2", 0, 64)] and last.kv_resets == [] and last.kv_base == "2"
        assert max_abs(lps, hf_sampled_logprobs(m2, p, ids)) <= 1e-4


async def test_object_store_and_checkpoint_path_load_the_same_weights_as_the_collective(
    controller, client, base_weights, tiny_model_dir, tmp_path
):
    import shutil

    from safetensors.torch import save_file

    w3 = perturbed(base_weights, seed=3)
    before = await controller.weights_checksums.remote()
    r = await asyncio.to_thread(client.refit, "3", w3)
    via_collective = await controller.weights_checksums.remote()
    assert via_collective != before

    r_obj = await asyncio.to_thread(client.refit, "4", w3, transport="object_store")
    via_object_store = await controller.weights_checksums.remote()

    ckpt = tmp_path / "step-5"
    ckpt.mkdir()
    shutil.copy(tiny_model_dir / "config.json", ckpt / "config.json")
    save_file(w3, str(ckpt / "model.safetensors"))
    r_path = await asyncio.to_thread(client.refit, "5", str(ckpt), transport="path")
    via_path = await controller.weights_checksums.remote()

    assert via_collective == via_object_store == via_path
    for rep in (r, r_obj, r_path):
        assert rep["ok"] and rep["requests_aborted"] == 0
        print(f"{rep['transport']:>12}: {rep['bytes'] / 1e6:.1f} MB pause {rep['pause_s']:.3f}s transfer "
              f"{rep['transfer_s']:.3f}s load {rep['load_s']:.3f}s resume {rep['resume_s']:.3f}s")


async def test_failure_mid_transfer_resumes_every_engine_on_the_old_weights(
    controller, engine, client, tiny_tokenizer, base_weights
):
    before = await controller.weights_checksums.remote()
    version = await controller.current_version.remote()
    ps = prompts(tiny_tokenizer, "C", 4)
    tasks, _ = await start_rollouts(engine, ps, seed0=400, max_tokens=120)

    def fail_after_first_bucket(i):
        if i == 0:
            raise RuntimeError("injected: trainer died after bucket 0")

    from rollout_service.refit.types import RefitFailed

    with pytest.raises(RefitFailed) as err:
        await asyncio.to_thread(client.refit, "6", perturbed(base_weights, seed=6), on_bucket=fail_after_first_bucket)
    report = err.value.report
    assert report["failed_step"] == "transfer" and "trainer aborted the transfer" in report["error"]
    assert report["requests_aborted"] == 0
    assert await controller.weights_checksums.remote() == before
    assert await controller.current_version.remote() == version
    assert not await engine.is_paused.remote()
    for ids, _, last in await asyncio.gather(*tasks):
        assert last.finish_reason == "length" and last.weight_versions == [(version, 0, 120)]

    # The group is still in step: the next collective refit works.
    assert (await asyncio.to_thread(client.refit, "6", perturbed(base_weights, seed=6)))["ok"]


async def test_failure_mid_load_rolls_back_the_half_loaded_model(controller, engine, tiny_tokenizer):
    from rollout_service.refit.transports import CheckpointPathTransfer
    from rollout_service.refit.types import RefitFailed

    before = await controller.weights_checksums.remote()
    version = await controller.current_version.remote()
    path = await engine.tokenizer_path.remote()  # the original checkpoint: different weights
    with pytest.raises(RefitFailed) as err:
        await controller.refit.remote("7", CheckpointPathTransfer(path), fail_load_after_tensors=5)
    report = err.value.report
    assert report["failed_step"] == "load" and report["rolled_back"], report["error"]
    assert await controller.weights_checksums.remote() == before
    assert await controller.current_version.remote() == version
    assert not await engine.is_paused.remote()


@pytest.mark.parametrize("staging", ["inside", "overlap"])
async def test_concurrent_refit_is_rejected_and_new_requests_are_served_as_the_staging_mode_says(
    controller, engine, client, tiny_tokenizer, base_weights, tiny_model_dir, request, staging
):
    """The trainer holds its broadcast after the first bucket. ``inside`` (the transfer inside the
    pause): a request sent meanwhile waits for the refit and is served wholly by the new weights.
    ``overlap`` (the default): the engine is not paused while the weights stage, the request is
    served meanwhile wholly by the old weights, and the pause covers only load, label and resume;
    a request after the refit is the new weights' to float32 parity. Either way a second refit is
    refused while one runs."""
    from rollout_service.refit.transports import CheckpointPathTransfer
    from rollout_service.refit.types import RefitInProgress
    from refit_helpers import controller_config

    await controller.update_config.remote(controller_config(tiny_model_dir, refit={"staging": staging}).model_dump())
    request.addfinalizer(lambda: ray.get(controller.update_config.remote(controller_config(tiny_model_dir).model_dump())))
    old = await controller.current_version.remote()
    new = f"8-{staging}"
    paused_mid_transfer = threading.Event()
    release = threading.Event()

    def hold_after_first_bucket(i):
        if i == 0:
            paused_mid_transfer.set()
            assert release.wait(60)

    w8 = perturbed(base_weights, seed=8)
    refit = asyncio.create_task(asyncio.to_thread(client.refit, new, w8, on_bucket=hold_after_first_bucket))
    while not paused_mid_transfer.is_set():
        await asyncio.sleep(0.01)

    with pytest.raises(RefitInProgress):
        await controller.refit.remote("9", CheckpointPathTransfer(str(tiny_model_dir)))
    with pytest.raises(RefitInProgress):
        client.refit("9", w8)
    assert (await controller.stats.remote())["refitting"]

    arrivals = []
    prompt = prompts(tiny_tokenizer, "D", 1)[0]
    late = asyncio.create_task(
        stream_generation(engine, prompt, seed=9, max_tokens=32, ignore_eos=True, on_chunk=arrivals.append)
    )
    try:
        if staging == "inside":
            await asyncio.sleep(1.0)
            assert arrivals == [] and not late.done()  # queued while the engine is paused
        else:
            t0 = time.monotonic()
            ids, lps, last = await asyncio.wait_for(late, 60)  # served while the weights stage
            served_s = time.monotonic() - t0
            assert not await engine.is_paused.remote()
            assert last.weight_versions == [(old, 0, 32)]
    finally:
        release.set()
    report = await refit
    assert report["ok"] and report["staging"] == staging and report["requests_aborted"] == 0
    assert report["stall_s"] <= report["total_s"]
    if staging == "inside":
        ids, lps, last = await late
        assert last.weight_versions == [(new, 0, 32)]  # served entirely by the new weights
        assert report["stage_s"] == 0 and report["staged_bytes"] == 0
    else:
        # The transfer (held by the trainer for the whole generation above) was outside the stall.
        assert report["staged_bytes"] == report["bytes"] > 0
        assert report["stage_s"] >= served_s and report["total_s"] >= report["stage_s"] + report["stall_s"]
        ids, lps, last = await stream_generation(engine, prompt, seed=9, max_tokens=32, ignore_eos=True)
        assert last.weight_versions == [(new, 0, 32)]
    m8 = hf_model(tiny_model_dir, w8, 8)
    worst = max_abs(lps, hf_sampled_logprobs(m8, prompt, ids))
    print(f"staging {staging}: stage {report['stage_s']:.3f}s stall {report['stall_s']:.3f}s (load "
          f"{report['load_s']:.3f}s) total {report['total_s']:.3f}s; new weights max|Δ|={worst:.2e}")
    assert worst <= 1e-4


async def test_nccl_round_that_fails_in_the_worker_resumes_engines_and_releases_the_lock(
    controller, engine, client, base_weights, tiny_model_dir
):
    # The GPU path's control plane on a real engine: a controller configured as a GPU service
    # (refit.backend nccl) drives this CPU engine, which has no NCCL weight-transfer engine, so
    # vLLM's own worker refuses the calls: the init, then start_weight_update after the pause.
    from vllm.distributed.weight_transfer.nccl_common import NCCLWeightTransferInitInfo, worker_init_payload

    from rollout_service.config import RolloutServiceConfig
    from rollout_service.refit.controller import RefitController

    gpu_service = RolloutServiceConfig.model_validate(
        {"engine": {"model": str(tiny_model_dir), "device": "cuda"}, "refit": {"backend": "nccl", "step_timeout_s": 60}})
    nccl = ray.remote(RefitController).options(num_cpus=0, max_concurrency=100).remote(
        gpu_service.model_dump(), controller.fleet_handle)
    try:
        info = worker_init_payload(NCCLWeightTransferInitInfo(master_address="127.0.0.1", master_port=29500,
                                                              rank_offset=1, world_size=2))
        refused = "Please set weight_transfer_config"  # vLLM's Worker._check_weight_transfer_engine
        with pytest.raises(Exception, match=refused):
            await nccl.nccl_init_weight_transfer_engine.remote(info)
        with pytest.raises(Exception, match=refused):
            await nccl.nccl_start_weight_update.remote()
        assert not await engine.is_paused.remote()
        assert not (await nccl.stats.remote())["refitting"]
        assert not (await controller.fleet_handle.stats.remote())["refitting"]
    finally:
        ray.kill(nccl)
    assert (await asyncio.to_thread(client.refit, "10", perturbed(base_weights, seed=10)))["ok"]
