"""Helpers for driving the real engine actor and checking parity with transformers."""

from __future__ import annotations

import functools

from rollout_service.engine.types import GenerateRequest, spans_up_to
from rollout_service.engine.sampling import SamplingOptions


async def stream_generation(actor, prompt_ids, *, seed, max_tokens, temperature=1.0, on_chunk=None, **sampling):
    """Stream one generation from the engine actor; return (ids, logprobs, final_chunk)."""
    req = GenerateRequest(
        prompt_ids=list(prompt_ids),
        sampling=SamplingOptions.validated(seed=seed, temperature=temperature, **sampling),
        max_tokens=max_tokens,
    )
    ids: list[int] = []
    lps: list[float] = []
    last = None
    spans_seen = []  # (ids so far, the chunk's spans): each must be the final spans cut there
    async for ref in actor.generate.options(num_returns="streaming").remote(req):
        chunk = await ref
        ids += chunk.token_ids
        lps += chunk.logprobs
        last = chunk
        spans_seen.append((len(ids), chunk.weight_versions))
        if on_chunk is not None:
            on_chunk(chunk)
    if last is not None and last.finish_reason not in (None, "abort"):
        for n, spans in spans_seen:
            assert spans is not None and [tuple(s) for s in spans] == spans_up_to(last.weight_versions, n), (n, spans)
    return ids, lps, last


@functools.lru_cache(maxsize=4)
def load_hf_model(path: str):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval()
    return model


def hf_sampled_logprobs(model, prompt_ids, gen_ids, temperature=1.0):
    """log_softmax(logits / T) of each generated id, from one float32 forward of prompt + generation."""
    import torch

    seq = torch.tensor([list(prompt_ids) + list(gen_ids)])
    with torch.no_grad():
        logits = model(seq).logits[0].float()
    start = len(prompt_ids) - 1
    logp = torch.log_softmax(logits[start : start + len(gen_ids)] / temperature, dim=-1)
    return logp.gather(1, torch.tensor(gen_ids).unsqueeze(1)).squeeze(1).tolist()
