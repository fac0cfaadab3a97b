"""Prefix caching on is safe across refits: the cache salt is the weight version, so no prefix-cache
hit crosses a refit (even with clear_cache=False), while hits within one version still happen."""

from __future__ import annotations

import copy

import pytest
import torch

from engine_helpers import hf_sampled_logprobs, load_hf_model, stream_generation



async def test_no_prefix_cache_hit_crosses_a_refit(raw_prefix_controller, tiny_tokenizer, tiny_model_dir):
    """On the session's prefix-caching engine (raw logprobs, shared with the canary's test: at T = 1
    without top-k / top-p, raw and processed logprobs are the same numbers)."""
    prefix_cache_controller = raw_prefix_controller
    from safetensors.torch import load_file

    from rollout_service.refit.client import TrainerClient

    engine = (await prefix_cache_controller.get_engines.remote())[0]
    text = " ".join(f"fact {i} is that the number {i * 7} is odd or even." for i in range(40))
    prompt = list(tiny_tokenizer(text)["input_ids"])
    assert len(prompt) > 300  # spans several KV blocks

    async def run(seed):
        ids, lps, last = await stream_generation(engine, prompt, seed=seed, max_tokens=16, ignore_eos=True)
        return ids, lps, last

    await run(1)
    _, _, warm = await run(2)
    assert warm.num_cached_tokens and warm.num_cached_tokens > 0, "prefix caching is not active"

    base = load_file(str(tiny_model_dir / "model.safetensors"))
    g = torch.Generator().manual_seed(11)
    w1 = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in base.items()}
    client = TrainerClient(prefix_cache_controller, timeout_s=60)
    report = client.refit("1", w1, transport="object_store", clear_cache=False)
    assert report["ok"] and not report["clear_cache"]

    ids, lps, after = await run(3)
    assert after.weight_versions == [("1", 0, 16)]
    assert not after.num_cached_tokens, f"{after.num_cached_tokens} prompt tokens reused KV of the old weights"
    new_model = copy.deepcopy(load_hf_model(str(tiny_model_dir)))
    new_model.load_state_dict(w1)
    assert max(abs(a - b) for a, b in zip(lps, hf_sampled_logprobs(new_model, prompt, ids))) <= 1e-4

    _, _, again = await run(4)
    assert again.num_cached_tokens and again.num_cached_tokens > 0  # hits resume within version 1
