"""The vLLM engine replica actor: generation, logprob parity with transformers, keep-mode pause."""

from __future__ import annotations

import asyncio
import time

import pytest
import ray

from engine_helpers import hf_sampled_logprobs, load_hf_model, stream_generation



def chat_prompt(tok, text: str) -> list[int]:
    return tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)


def _ids(x):
    return list(x["input_ids"]) if isinstance(x, dict) or hasattr(x, "keys") else list(x)


async def test_generation_returns_ids_logprobs_finish_reason_and_version(engine_actor, tiny_tokenizer):
    prompt = _ids(chat_prompt(tiny_tokenizer, "Hello there"))
    ids, lps, last = await stream_generation(engine_actor, prompt, seed=7, max_tokens=24, ignore_eos=True)
    assert len(ids) == 24 and len(lps) == 24
    assert all(isinstance(t, int) and 0 <= t < 151936 for t in ids)
    assert all(lp <= 0.0 for lp in lps)
    assert last.finish_reason == "length"
    assert last.num_prompt_tokens == len(prompt)
    assert last.weight_versions == [("0", 0, 24)]


async def test_a_stop_string_still_stops_the_generation(engine_actor, tiny_tokenizer):
    """The engine detokenizes only for stop strings (nothing else reads its text): they still match.
    The stop string is text the same seeded generation produces without it."""
    prompt = _ids(chat_prompt(tiny_tokenizer, "Say something"))
    full, _, _ = await stream_generation(engine_actor, prompt, seed=11, max_tokens=40, ignore_eos=True)
    start = next(i for i in range(8, 30) if (t := tiny_tokenizer.decode(full[i:i + 3])).strip() and "\ufffd" not in t
                 and "\ufffd" not in tiny_tokenizer.decode(full[:i + 3]))
    stop = tiny_tokenizer.decode(full[start:start + 3])
    ids, lps, last = await stream_generation(engine_actor, prompt, seed=11, max_tokens=40, ignore_eos=True, stop=[stop])
    assert last.finish_reason == "stop" and last.stop_reason == stop
    assert ids == full[:len(ids)] and len(ids) <= start + 3 and len(lps) == len(ids)
    assert stop in tiny_tokenizer.decode(ids)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
async def test_processed_logprobs_match_transformers_float32(engine_actor, tiny_tokenizer, tiny_model_dir, temperature):
    """>= 1,000 sampled tokens; the engine's processed logprob == log_softmax(logits / T), |Δ| <= 1e-4."""
    prompts = [_ids(chat_prompt(tiny_tokenizer, f"Question {i}: what is {i} + {i}?")) for i in range(8)]
    results = await asyncio.gather(
        *[
            stream_generation(engine_actor, p, seed=100 + i, max_tokens=130, temperature=temperature, ignore_eos=True)
            for i, p in enumerate(prompts)
        ]
    )
    model = load_hf_model(str(tiny_model_dir))
    deltas = []
    for prompt, (ids, lps, _) in zip(prompts, results):
        ref = hf_sampled_logprobs(model, prompt, ids, temperature=temperature)
        deltas += [abs(a - b) for a, b in zip(lps, ref)]
    assert len(deltas) >= 1000
    worst = max(deltas)
    print(f"parity T={temperature}: {len(deltas)} tokens, max |Δ| = {worst:.3g}")
    assert worst <= 1e-4


async def test_keep_mode_pause_freezes_then_completes_identically(engine_actor, tiny_tokenizer):
    """No token while paused, nothing aborted, and the same ids as a never-paused run."""
    prompts = [_ids(chat_prompt(tiny_tokenizer, f"Tell story number {i}")) for i in range(4)]
    n_tokens = 160

    reference = await asyncio.gather(
        *[stream_generation(engine_actor, p, seed=500 + i, max_tokens=n_tokens, ignore_eos=True) for i, p in enumerate(prompts)]
    )

    arrivals: list[float] = []
    tasks = [
        asyncio.create_task(
            stream_generation(
                engine_actor, p, seed=500 + i, max_tokens=n_tokens, ignore_eos=True,
                on_chunk=lambda c: arrivals.append(time.monotonic()),
            )
        )
        for i, p in enumerate(prompts)
    ]
    while len(arrivals) < 8:  # every request is mid-generation
        await asyncio.sleep(0.01)
    await engine_actor.pause.remote(mode="keep", clear_cache=False)
    assert await engine_actor.is_paused.remote()
    await asyncio.sleep(0.3)  # let chunks already in transit land
    paused_at = time.monotonic()
    count_at_pause = len(arrivals)
    await asyncio.sleep(1.5)
    during_pause = [t for t in arrivals if t > paused_at]
    assert during_pause == [], f"{len(during_pause)} chunks arrived while paused"
    assert not any(t.done() for t in tasks), "a request ended while paused"
    await engine_actor.resume.remote()
    results = await asyncio.gather(*tasks)
    assert len(arrivals) > count_at_pause
    for (ids, _, last), (ref_ids, _, _) in zip(results, reference):
        assert last.finish_reason == "length"  # not "abort"
        assert ids == ref_ids


async def test_health_reports_state(engine_actor):
    h = await engine_actor.health.remote()
    assert h["ready"] and not h["paused"] and h["weight_version"] == "0"


async def test_worker_extension_reachable_by_collective_rpc(engine_actor):
    sums = await engine_actor.collective_rpc.remote("rs_weights_checksum")
    assert len(sums) == 1 and len(sums[0]) == 64
