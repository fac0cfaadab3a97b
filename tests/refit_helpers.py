"""Shared by the refit test modules: weight perturbations, prompts, rollouts started mid-refit."""

from __future__ import annotations

import asyncio
import contextlib
import time

import ray
import torch

from engine_helpers import stream_generation
from runtime_fixtures import TEST_KV_GIB

N_ROLLOUTS = 8


def controller_config(tiny_model_dir, fleet_overrides: dict | None = None, refit: dict | None = None, **engine_overrides):
    """The config of :func:`running_controller`'s fleet and controller (``refit``: fields over its
    refit section, for a test that changes them with ``update_config``)."""
    from rollout_service.config import RolloutServiceConfig

    return RolloutServiceConfig.model_validate(
        {"engine": {"model": str(tiny_model_dir), "cpu_kvcache_space_gib": TEST_KV_GIB, **engine_overrides},
         "refit": {"step_timeout_s": 60, **(refit or {})}, "fleet": fleet_overrides or {}}
    )


@contextlib.contextmanager
def running_controller(tiny_model_dir, fleet_overrides: dict | None = None, **engine_overrides):
    """A standalone engine fleet and RefitController over it (neither detached nor named, so they
    never meet the session's service), engines started; shut down after."""
    from rollout_service.config import RolloutServiceConfig
    from rollout_service.fleet.fleet import EngineFleet
    from rollout_service.refit.controller import RefitController

    cfg = controller_config(tiny_model_dir, fleet_overrides, **engine_overrides)
    fleet = ray.remote(EngineFleet).options(num_cpus=0, max_concurrency=1000).remote(cfg.model_dump())
    actor = ray.remote(RefitController).options(num_cpus=0, max_concurrency=1000).remote(cfg.model_dump(), fleet)
    try:
        ray.get(actor.start.remote(), timeout=600)
        actor.fleet_handle = fleet
        yield actor
    finally:
        try:
            ray.get(fleet.shutdown.remote(), timeout=60)
        finally:
            ray.kill(actor)
            ray.kill(fleet)


def perturbed(base: dict, seed: int, scale: float = 0.05) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {k: v + scale * torch.randn(v.shape, generator=g) for k, v in base.items()}


def prompts(tok, tag: str, n: int = N_ROLLOUTS) -> list[list[int]]:
    out = []
    for i in range(n):
        ids = tok.apply_chat_template([{"role": "user", "content": f"{tag} rollout {i}: tell a story"}],
                                      add_generation_prompt=True, tokenize=True)
        out.append(list(ids["input_ids"]) if hasattr(ids, "keys") else list(ids))
    return out


async def start_rollouts(engine, prompt_list, *, seed0: int, max_tokens: int, min_tokens_each: int = 4):
    """Start streaming rollouts and return once every one of them is mid-generation."""
    counts = [0] * len(prompt_list)

    def counter(i):
        def on_chunk(chunk):
            counts[i] += len(chunk.token_ids)
        return on_chunk

    tasks = [
        asyncio.create_task(
            stream_generation(engine, p, seed=seed0 + i, max_tokens=max_tokens, ignore_eos=True, on_chunk=counter(i))
        )
        for i, p in enumerate(prompt_list)
    ]
    deadline = time.monotonic() + 60
    while min(counts) < min_tokens_each:
        assert time.monotonic() < deadline, f"rollouts did not start: {counts}"
        await asyncio.sleep(0.01)
    return tasks, counts


def split_at_refit(spans, old: str, new: str, n: int) -> int:
    assert [s[0] for s in spans] == [old, new], spans
    assert spans[0][1] == 0 and spans[0][2] == spans[1][1] and spans[1][2] == n, spans
    k = spans[0][2]
    assert 0 < k < n, f"refit boundary {k} not inside the generation of {n} tokens"
    return k
