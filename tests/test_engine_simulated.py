"""The simulated engine (``engine.backend: simulated``) against the engine actor's contract, as a Ray
actor in the session's Ray: the data channel equal to Ray calls, batched streams equal to
``generate_all``, a consumer going away aborting, refusals as client errors, keep-mode pause
freezing then completing identically, weight-version spans across a refit, the weight paths
(object store, checkpoint path, export to a replacement, rollback), the prefix cache salted by the
version, the timing model's lower bound, and death by signal as an engine lost."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import time

import pytest

from rollout_service.config import EngineConfig
from rollout_service.engine.sampling import SamplingOptions
from rollout_service.engine.types import GenerateRequest, GenerationChunk
from rollout_service.fleet.client import FleetClient
from rollout_service.fleet.types import EngineCallDeadline, FleetView, Member, is_engine_death

PROMPT = [151644, 872, 198, 9707, 11, 1879, 0, 151645, 198, 151644, 77091, 198]
STEP_S = 0.004


def _config(tiny_model_dir, **sim) -> EngineConfig:
    return EngineConfig(model=str(tiny_model_dir), backend="simulated", num_cpus_per_engine=0, max_num_seqs=8,
                        enable_prefix_caching=True,
                        sim={"decode_step_s": STEP_S, "decode_step_s_per_seq": 0.0001, "prefill_s_per_token": 1e-5,
                             "kv_capacity_tokens": 4096, **sim})


def _start(config: EngineConfig, index: int = 0):
    import ray

    from rollout_service.engine.actor import create_engine_actor

    actor = create_engine_actor(config, index)
    ray.get(actor.start.remote(), timeout=60)
    return actor


@pytest.fixture(scope="module")
def sim(ray_session, tiny_model_dir):
    import ray

    actor = _start(_config(tiny_model_dir))
    address = ray.get(actor.open_channel.remote(), timeout=60)
    yield actor, address
    ray.kill(actor)


def _request(seed: int | None, max_tokens: int = 12, prompt=PROMPT, **sampling) -> GenerateRequest:
    return GenerateRequest(prompt_ids=list(prompt), sampling=SamplingOptions.validated(seed=seed, **sampling),
                           max_tokens=max_tokens)


def _client(actor, address):
    over_tcp, over_ray = Member(0, 0, actor, 0, address), Member(0, 0, actor, 0, None)
    return FleetClient(None, FleetView(1, "0", (over_tcp,))), over_tcp, over_ray


async def _collect(client, member, request, stream) -> GenerationChunk:
    chunks = [c async for c in client.generate(member, request, stream)]
    assert [c.finish_reason is not None for c in chunks] == [False] * (len(chunks) - 1) + [True]
    return GenerationChunk.concat(chunks)


async def test_the_channel_and_ray_calls_give_the_same_deterministic_generations(sim, tiny_model_dir):
    actor, address = sim
    client, tcp, ray_member = _client(actor, address)
    try:
        seen = []
        for stream in (False, True):
            for seed in (1, 2):
                req = _request(seed, top_logprobs=3)
                a = await _collect(client, tcp, dataclasses.replace(req, request_id=f"t{seed}{stream}"), stream)
                b = await _collect(client, ray_member, dataclasses.replace(req, request_id=f"r{seed}{stream}"), stream)
                assert len(a.token_ids) == 12 and (a.token_ids, a.logprobs) == (b.token_ids, b.logprobs)
                assert a.top_logprobs == b.top_logprobs and len(a.top_logprobs) == 12
                assert all(len(d) == 3 and d[t] == lp for d, t, lp in zip(a.top_logprobs, a.token_ids, a.logprobs))
                assert all(lp <= 0 for lp in a.logprobs)
                assert a.finish_reason == b.finish_reason == "length"
                assert [tuple(w) for w in a.weight_versions] == [("0", 0, 12)]
                assert a.num_prompt_tokens == len(PROMPT)
                seen.append((seed, a.token_ids))
        assert seen[0][1] == seen[2][1] and seen[0][1] != seen[1][1]  # the seed decides, not the call path
        first_added = 151643  # the tiny model's first added token: never sampled
        assert all(0 <= t < first_added for _, ids in seen for t in ids)
        greedy = [(await _collect(client, tcp, _request(s, temperature=0.0), False)).token_ids for s in (1, 2)]
        assert greedy[0] == greedy[1]  # greedy: the prompt alone decides
    finally:
        client.close_channels()


async def test_a_batched_stream_has_the_tokens_of_an_unbatched_one_and_of_generate_all(sim):
    actor, _ = sim
    n = 60
    req = _request(11, n, top_logprobs=2)

    async def stream(window):
        chunks, times, t0 = [], [], time.monotonic()
        async for ref in actor.generate.options(num_returns="streaming").remote(
                dataclasses.replace(req, request_id=f"w{window}"), window):
            chunks.append(await ref)
            times.append(time.monotonic() - t0)
        return chunks, times

    batched, times = await stream(0.05)
    unbatched, _ = await stream(0.0)
    whole = await actor.generate_all.remote(dataclasses.replace(req, request_id="all"))
    assert len(batched[0].token_ids) == 1 and times[0] < times[-1] / 2
    assert len(batched) <= n // 3 < len(unbatched)
    a, b = GenerationChunk.concat(batched), GenerationChunk.concat(unbatched)
    assert (a.token_ids, a.logprobs, a.top_logprobs) == (b.token_ids, b.logprobs, b.top_logprobs) \
        == (whole.token_ids, whole.logprobs, whole.top_logprobs)
    assert a.weight_versions == b.weight_versions == whole.weight_versions == [("0", 0, n)]


async def test_a_consumer_going_away_aborts_and_the_engine_serves_on(sim):
    actor, address = sim
    client, tcp, _ = _client(actor, address)
    try:
        aborted = await actor.num_aborted.remote()
        chunks = client.generate(tcp, _request(3, max_tokens=400), True)
        first = await chunks.__anext__()
        assert first.token_ids and first.finish_reason is None
        assert await actor.num_in_flight.remote() == 1
        await chunks.aclose()
        deadline = time.monotonic() + 10
        while await actor.num_in_flight.remote() and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert await actor.num_in_flight.remote() == 0
        assert await actor.num_aborted.remote() == aborted  # gone, not an abort the engine decided
        assert len((await _collect(client, tcp, _request(4, max_tokens=3), False)).token_ids) == 3
    finally:
        client.close_channels()


async def test_what_it_cannot_simulate_is_refused_as_the_clients_error(sim):
    from rollout_service.serve.errors import engine_refusal

    actor, address = sim
    client, tcp, ray_member = _client(actor, address)
    try:
        for param, req in [("stop", _request(0, stop=["x"])),
                           ("structured_outputs", _request(0, structured_outputs={"regex": "a+"})),
                           ("max_tokens", _request(0, max_tokens=2000))]:
            for member in (tcp, ray_member):
                with pytest.raises(Exception) as info:
                    await _collect(client, member, dataclasses.replace(req, request_id=f"{param}{id(member)}"), False)
                assert not is_engine_death(info.value), info.value
                mapped = engine_refusal(info.value)
                assert mapped is not None, info.value
                assert (mapped.status, mapped.code, mapped.param) == (400, "engine_rejected_request", param)
        assert await actor.num_in_flight.remote() == 0
    finally:
        client.close_channels()


async def test_a_stop_token_ends_the_generation_with_its_id(sim):
    actor, _ = sim
    free = await actor.generate_all.remote(_request(5, max_tokens=30))
    stop_id = free.token_ids[9]
    stopped = await actor.generate_all.remote(_request(5, max_tokens=30, stop_token_ids=[stop_id]))
    cut = free.token_ids.index(stop_id) + 1
    assert stopped.token_ids == free.token_ids[:cut]
    assert (stopped.finish_reason, stopped.stop_reason) == ("stop", stop_id)


async def test_keep_pause_freezes_a_refit_relabels_and_the_run_completes_identically(sim):
    actor, _ = sim
    n = 150
    reqs = [_request(500 + i, n) for i in range(3)]
    reference = await asyncio.gather(*[actor.generate_all.remote(dataclasses.replace(r, request_id=f"ref{i}"))
                                       for i, r in enumerate(reqs)])
    arrivals: list[float] = []

    async def run(i, r):
        chunks = []
        async for ref in actor.generate.options(num_returns="streaming").remote(
                dataclasses.replace(r, request_id=f"p{i}"), 0.0):
            chunks.append(await ref)
            arrivals.append(time.monotonic())
        return GenerationChunk.concat(chunks)

    tasks = [asyncio.create_task(run(i, r)) for i, r in enumerate(reqs)]
    while len(arrivals) < 30:
        await asyncio.sleep(0.005)
    await actor.pause.remote(mode="keep")
    assert await actor.is_paused.remote()
    await actor.set_weight_version.remote("1")
    await asyncio.sleep(0.2)
    paused_at, count = time.monotonic(), len(arrivals)
    await asyncio.sleep(0.5)
    assert [t for t in arrivals if t > paused_at] == [] and not any(t.done() for t in tasks)
    await actor.resume.remote()
    results = await asyncio.gather(*tasks)
    assert len(arrivals) > count
    try:
        for got, ref in zip(results, reference):
            assert got.finish_reason == "length" and got.token_ids == ref.token_ids and got.logprobs == ref.logprobs
            (v0, s0, e0), (v1, s1, e1) = [tuple(w) for w in got.weight_versions]
            assert (v0, s0, v1, e1) == ("0", 0, "1", n) and e0 == s1 and 0 < e0 < n
    finally:
        await actor.set_weight_version.remote("0")


async def test_pause_in_abort_mode_ends_what_runs(sim):
    actor, _ = sim
    aborted = await actor.num_aborted.remote()
    task = asyncio.ensure_future(actor.generate_all.remote(_request(6, max_tokens=400)))
    while not await actor.num_in_flight.remote():
        await asyncio.sleep(0.01)
    await actor.pause.remote(mode="abort")
    try:
        out = await task
        assert out.finish_reason == "abort" and len(out.token_ids) < 400
        assert await actor.num_aborted.remote() == aborted + 1
    finally:
        await actor.resume.remote()


async def test_the_prefix_cache_serves_a_repeated_prompt_until_the_weights_change(sim):
    actor, _ = sim
    prompt = list(range(1000, 1100))
    first = await actor.generate_all.remote(_request(7, 4, prompt=prompt))
    again = await actor.generate_all.remote(_request(8, 4, prompt=prompt))
    assert first.num_cached_tokens == 0 and again.num_cached_tokens == 96  # whole 16-token blocks
    await actor.set_weight_version.remote("salt-test")
    try:
        after = await actor.generate_all.remote(_request(9, 4, prompt=prompt))
        assert after.num_cached_tokens == 0  # no hit crosses a refit
    finally:
        await actor.set_weight_version.remote("0")


async def test_decode_steps_take_the_modelled_time(sim):
    actor, _ = sim
    n = 50
    t0 = time.monotonic()
    await actor.generate_all.remote(_request(10, n))
    took = time.monotonic() - t0
    assert took >= n * STEP_S  # a lower bound only: these machines are noisy
    print(f"{n} tokens in {took:.3f}s (model: >= {n * STEP_S:.3f}s)")


async def test_weights_stage_load_commit_rollback_and_export_to_a_replacement(sim, tiny_model_dir, tmp_path):
    import ray
    import torch

    from safetensors.torch import load_file, save_file

    actor, _ = sim
    base = (await actor.collective_rpc.remote("rs_weights_checksum"))[0]
    state = load_file(str(tiny_model_dir / "model.safetensors"))
    changed = {k: (v + 1 if v.is_floating_point() else v) for k, v in state.items()}

    # object store: staged, loaded, committed; the digest is of the bytes
    [staged] = await actor.stage_weights_from_object_store.remote([ray.put(changed)], 60)
    assert staged["bytes"] == sum(t.numel() * t.element_size() for t in changed.values())
    await actor.collective_rpc.remote("rs_load_staged")
    await actor.collective_rpc.remote("rs_commit")
    new = (await actor.collective_rpc.remote("rs_weights_checksum"))[0]
    assert new != base

    # a failed load, rolled back to what was committed
    await actor.stage_weights_from_object_store.remote([ray.put(state)], 60)
    with pytest.raises(Exception, match="injected load fault"):
        await actor.collective_rpc.remote("rs_load_staged", kwargs={"fail_after_tensors": 3})
    assert (await actor.collective_rpc.remote("rs_weights_checksum"))[0] != new
    assert (await actor.collective_rpc.remote("rs_rollback"))[0]["reloaded"]
    assert (await actor.collective_rpc.remote("rs_weights_checksum"))[0] == new

    # export: a replacement loads the same weights
    version_ref, weights_ref = actor.export_weights.options(num_returns=2).remote(60)
    await actor.set_weight_version.remote("0")
    replacement = _start(_config(tiny_model_dir), index=1)
    try:
        await replacement.stage_weights_from_object_store.remote([weights_ref], 60)
        await replacement.collective_rpc.remote("rs_load_staged")
        await replacement.collective_rpc.remote("rs_commit")
        assert (await replacement.collective_rpc.remote("rs_weights_checksum"))[0] == new
        assert await version_ref == "0"
    finally:
        ray.kill(replacement)

    # checkpoint directory: back to the model's own weights
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    save_file({k: v.contiguous() for k, v in state.items()}, str(ckpt / "model.safetensors"))
    await actor.collective_rpc.remote("rs_stage_path", args=(str(ckpt),))
    await actor.collective_rpc.remote("rs_load_staged")
    await actor.collective_rpc.remote("rs_commit")
    assert (await actor.collective_rpc.remote("rs_weights_checksum"))[0] not in (base, new)
    await actor.collective_rpc.remote("rs_reload_from_path", args=(str(tiny_model_dir),))
    assert (await actor.collective_rpc.remote("rs_weights_checksum"))[0] == base
    del torch


async def test_a_killed_engine_is_an_engine_lost_and_uses_little_memory(ray_session, tiny_model_dir):
    import psutil
    import ray

    actor = _start(_config(tiny_model_dir), index=2)
    address = await actor.open_channel.remote()
    client, tcp, _ = _client(actor, address)
    try:
        health = await actor.health.remote()
        assert health["backend"] == "simulated" and health["ready"]
        rss_mb = psutil.Process(health["pid"]).memory_info().rss / 2**20
        print(f"simulated engine actor RSS: {rss_mb:.0f} MB")
        mods = await actor.__ray_call__.remote(lambda self: sorted({m.split(".")[0] for m in __import__("sys").modules}))
        assert "torch" not in mods and "vllm" not in mods
        stream = client.generate(tcp, _request(1, max_tokens=1000), True)
        await stream.__anext__()
        os.kill(health["pid"], signal.SIGKILL)
        with pytest.raises(Exception) as info:
            async for _ in stream:
                pass
        assert is_engine_death(info.value), info.value
    finally:
        client.close_channels()
        ray.kill(actor)


async def _past_deadline(client, member, request, stream) -> tuple[float, int]:
    """(seconds until EngineCallDeadline, tokens received before it) of one call through the failover path."""
    client.view = FleetView(1, "0", (member,))
    got, t0 = 0, time.monotonic()
    with pytest.raises(EngineCallDeadline) as info:
        async for chunk in client.generate_with_failover("deadline-rollout", request, stream):
            got += len(chunk.token_ids)
    assert info.value.status == 504 and "nothing was stored" in str(info.value)
    return time.monotonic() - t0, got


async def test_a_generation_past_its_deadline_is_aborted_in_its_engine_and_the_engine_serves_on(sim):
    """fleet.call_deadline_s: 0.3 s + 0 per token for a 400-token generation at 4 ms a step (1.6 s):
    over the data channel and over Ray, streamed and not, the call ends at its deadline with a 504 and
    the engine's request is gone; with the per-token part the same generation fits and completes."""
    actor, address = sim
    client, tcp, over_ray = _client(actor, address)
    client.call_deadline_s, client.call_deadline_s_per_token = 0.3, 0.0
    try:
        for member in (tcp, over_ray):
            for stream in (True, False):
                took, got = await _past_deadline(client, member, _request(7, max_tokens=400), stream)
                assert 0.3 <= took < 1.3, (member.channel, stream, took)
                assert (got > 0) == stream  # a streamed call had passed tokens on; a whole one none
                deadline = time.monotonic() + 10
                while await actor.num_in_flight.remote() and time.monotonic() < deadline:
                    await asyncio.sleep(0.02)
                assert await actor.num_in_flight.remote() == 0, (member.channel, stream)
        client.call_deadline_s_per_token = 0.01  # 0.3 + 4 s for 400 tokens
        client.view = FleetView(1, "0", (tcp,))
        chunks = [c async for c in client.generate_with_failover("deadline-rollout", _request(7, max_tokens=400), False)]
        assert len(GenerationChunk.concat(chunks).token_ids) == 400
    finally:
        client.close_channels()


async def test_a_call_on_a_stopped_engine_ends_at_its_deadline(ray_session, tiny_model_dir):
    """A real stalled peer: the engine process SIGSTOPped mid-stream, its socket open. The call ends
    with a 504 at its deadline instead of waiting for the fleet's hang detection."""
    import ray

    actor = _start(_config(tiny_model_dir), index=3)
    address = await actor.open_channel.remote()
    client, tcp, _ = _client(actor, address)
    client.call_deadline_s = 1.0
    pid = (await actor.health.remote())["pid"]
    try:
        client.view = FleetView(1, "0", (tcp,))
        got, t0 = 0, time.monotonic()
        with pytest.raises(EngineCallDeadline):
            async for chunk in client.generate_with_failover("stopped-rollout", _request(5, max_tokens=1000), True):
                got += len(chunk.token_ids)
                if got >= 5 and t0 > 0:
                    os.kill(pid, signal.SIGSTOP)
                    t0 = -time.monotonic()  # stopped once
        took = time.monotonic() + t0
        assert got >= 5 and took < 2.0, (got, took)
    finally:
        os.kill(pid, signal.SIGCONT)
        client.close_channels()
        ray.kill(actor)
