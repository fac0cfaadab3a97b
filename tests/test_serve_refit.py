"""Refit through the service's own control plane while HTTP rollouts are mid-generation.

Per-token weight versions must flow engine -> Redis -> the chat answer and the trajectory export.
The test restores the original weights (under a new version label) before it ends, so the
service's other tests keep comparing against the model on disk.
"""

from __future__ import annotations

import asyncio
import json
import uuid

import httpx
import pytest
import torch

from rollout_service.training import rows_from_trajectory
from serve_helpers import MODEL, parse_sse



@pytest.fixture(scope="module")
def trainer(service):
    from rollout_service.refit.client import TrainerClient
    from rollout_service.refit.controller import get_controller

    client = TrainerClient(get_controller(), timeout_s=120)
    client.init_weight_sync()
    yield client
    client.close()


async def _stream_chat(client: httpx.AsyncClient, rid: str, seen: list[int], i: int):
    body = {"model": MODEL, "messages": [{"role": "user", "content": f"long story {i}"}], "max_tokens": 700,
            "ignore_eos": True, "seed": 40 + i, "stream": True, "return_token_ids": True}
    lines = []
    async with client.stream("POST", "/v1/chat/completions", json=body, headers={"X-Rollout-Id": rid}) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            lines.append(line)
            if line.startswith("data: {"):
                choices = json.loads(line[len("data: "):]).get("choices") or [{}]
                seen[i] += len(choices[0].get("token_ids", []))
    return parse_sse(lines)


async def test_http_rollouts_spanning_a_refit_carry_both_versions(service, trainer, tiny_model_dir):
    from safetensors.torch import load_file

    base = load_file(str(tiny_model_dir / "model.safetensors"))
    g = torch.Generator().manual_seed(7)
    nudged = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in base.items()}
    old = trainer.stats()["weight_version"]
    new = f"step-{uuid.uuid4().hex[:6]}"
    rids = [f"refit-{i}-{uuid.uuid4().hex[:6]}" for i in range(4)]
    seen = [0] * len(rids)
    try:
        async with httpx.AsyncClient(base_url=service.url, timeout=300) as client:
            tasks = [asyncio.create_task(_stream_chat(client, rid, seen, i)) for i, rid in enumerate(rids)]
            deadline = asyncio.get_running_loop().time() + 120
            while not (min(seen) >= 1 and (await asyncio.to_thread(trainer.stats))["in_flight"] == len(rids)):
                assert asyncio.get_running_loop().time() < deadline, "rollouts never all in flight"
                await asyncio.sleep(0.01)
            report = await asyncio.to_thread(trainer.refit, new, nudged)
            results = await asyncio.gather(*tasks)
        assert report["ok"] and report["requests_aborted"] == 0 and report["version"] == new
        spanned = 0
        for rid, chunks in zip(rids, results):
            final = chunks[-1]["choices"][0]["delta"]
            spans = final["weight_versions"]
            assert len(final["generation_token_ids"]) == 700  # kept in flight, never aborted
            if len(spans) == 2:  # this request was mid-generation when the engines paused
                spanned += 1
                assert [s["version"] for s in spans] == [old, new], spans
                # refit.clear_cache false (the default): the new weights' tokens attended to the old KV.
                assert [s["kv_version"] for s in spans] == [old, old], spans
                assert spans[0]["start"] == 0 and spans[0]["end"] == spans[1]["start"] and spans[1]["end"] == 700
                assert 0 < spans[0]["end"] < 700
            else:
                assert spans == [{"version": old, "start": 0, "end": 700, "kv_version": old}]
            traj = httpx.get(f"{service.url}/v1/rollouts/{rid}").json()
            assert trainer.get_rollout(rid) == traj  # the trainer reads the same trajectory via the handle
            seg = traj["segments"][0]
            offset = seg["turns"][0]["gen_start"]
            assert seg["weight_versions"] == [
                {**s, "start": s["start"] + offset, "end": s["end"] + offset} for s in spans
            ]
            (row,) = rows_from_trajectory(traj)  # the trainer's rows: each token's behaviour version
            assert row.versions[offset:offset + 700] == [s["version"] for s in spans for _ in range(s["end"] - s["start"])]
            assert row.kv_versions[offset:offset + 700] == [old] * 700
        assert spanned >= 1 and spanned == report["requests_in_flight"]
        stats = trainer.stats()
        assert stats["weight_version"] == new
    finally:
        restore = f"restored-{uuid.uuid4().hex[:6]}"
        report = await asyncio.to_thread(trainer.refit, restore, base)
        assert report["ok"]
