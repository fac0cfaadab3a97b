"""`GET /v1/status` and `rollout-service status`: engines, the last refit, the stored rollouts.

Over the running service (one real engine, the session's redis-server): the count of stored
rollouts moves by exactly the rollouts created and deleted, a refit shows up as the last refit, and
the real CLI (a subprocess) prints the same facts as a table and as JSON.
"""

from __future__ import annotations

import asyncio
import json
import random
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from serve_helpers import MODEL

from rollout_service.store.redis_store import RedisRolloutStore
from synthetic_rollouts import synthetic_rollout

CLI = Path(sys.executable).with_name("rollout-service")


async def test_count_rollouts_counts_meta_keys_under_its_own_prefix_only(redis_server):
    prefix = f"cnt{uuid.uuid4().hex[:6]}"
    stores = {p: RedisRolloutStore.from_url(redis_server, key_prefix=p) for p in (prefix, prefix + "x", prefix + ":sub")}
    try:
        assert await stores[prefix].count_rollouts() == 0
        rng = random.Random(0)
        for p, n in ((prefix, 3), (prefix + "x", 2), (prefix + ":sub", 1)):
            for i in range(n):
                deltas, _ = synthetic_rollout(rng, [2, 1])  # 2 segments: 13 keys, one of them meta
                for k, d in enumerate(deltas):
                    await stores[p].append_turn(f"r{i}", d, expected_turn=k)
        assert [await s.count_rollouts() for s in stores.values()] == [3, 2, 1]
        await stores[prefix].delete("r0")
        assert await stores[prefix].count_rollouts() == 2
    finally:
        for s in stores.values():
            await s.close()


def _status(http) -> dict:
    r = http.get("/v1/status")
    assert r.status_code == 200, r.text
    return r.json()


def test_status_reports_the_engines_and_counts_stored_rollouts_exactly(http, service):
    before = _status(http)
    assert before["object"] == "service.status" and before["model"] == MODEL and before["errors"] == {}
    assert before["backend"] == "vllm"
    # The default policy without prefix caching (the parity default) routes as least_loaded.
    assert before["routing"] == {"policy": "least_loaded", "configured": "sticky_least_loaded",
                                 "load_margin": service.config.routing.load_margin, "pin_moves": 0}
    assert [e["slot"] for e in before["engines"]] == list(range(service.config.engine.num_engines))
    for e in before["engines"]:
        assert e["state"] == "healthy" and e["weight_version"] == before["weight_version"]
        assert isinstance(e["in_flight"], int) and e["in_flight"] >= 0
    assert before["rollouts"]["key_prefix"] == "svc"
    assert before["rollouts"]["durability"] == {"durability": "local", "ok": True}

    rids = [f"status-{uuid.uuid4().hex[:8]}" for _ in range(3)]
    for rid in rids:
        r = http.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 2,
                                                    "messages": [{"role": "user", "content": "count me"}]},
                      headers={"X-Rollout-Id": rid})
        assert r.status_code == 200, r.text
    assert _status(http)["rollouts"]["stored"] == before["rollouts"]["stored"] + 3
    assert http.delete(f"/v1/rollouts/{rids[0]}").status_code == 200
    assert _status(http)["rollouts"]["stored"] == before["rollouts"]["stored"] + 2


async def test_status_shows_the_last_refit(service, tiny_model_dir):
    """The model's own weights from disk under a new label: other tests keep the same model."""
    import httpx

    from rollout_service.refit.client import TrainerClient
    from rollout_service.refit.controller import get_controller

    async with httpx.AsyncClient(base_url=service.url, timeout=120) as client:
        before = (await client.get("/v1/status")).json()
        label = f"status-{uuid.uuid4().hex[:6]}"
        trainer = TrainerClient(get_controller(), timeout_s=120)
        try:
            report = await asyncio.to_thread(trainer.refit, label, str(tiny_model_dir), transport="path")
        finally:
            trainer.close()
        assert report["ok"]
        after = (await client.get("/v1/status")).json()
    last = after["last_refit"]
    assert last["outcome"] == "committed" and last["version"] == label
    assert last["from_version"] == before["weight_version"]
    assert last["ended_at"] >= last["started_at"] and last["duration_s"] >= 0
    assert after["refits"]["committed"] == ((before["refits"] or {}).get("committed", 0)) + 1
    assert after["weight_version"] == label and all(e["weight_version"] == label for e in after["engines"])


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(CLI), "status", *args], capture_output=True, text=True, timeout=120)


def test_the_status_command_prints_a_table_and_json(http, service):
    status = _status(http)
    table = _cli("--url", service.url)
    assert table.returncode == 0, table.stderr
    out = table.stdout
    assert f"weight version {status['weight_version']}" in out
    assert "ENGINE" in out and "STATE" in out and "IN FLIGHT" in out
    rows = [ln.split() for ln in out.splitlines() if ln.split()[:1] == ["0"]]
    assert rows and rows[0][1] == "healthy" and rows[0][2] == status["weight_version"]
    assert "last refit:" in out and "stored rollouts:" in out and "(key prefix svc)" in out
    assert "engines: vllm backend; routing least_loaded (configured sticky_least_loaded), 0 pin moves" in out

    as_json = _cli("--url", service.url, "--json")
    assert as_json.returncode == 0, as_json.stderr
    doc = json.loads(as_json.stdout)
    assert doc["object"] == "service.status" and doc["weight_version"] == status["weight_version"]
    assert [e["slot"] for e in doc["engines"]] == [e["slot"] for e in status["engines"]]


def test_the_status_command_exits_2_when_nothing_answers():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    done = _cli("--url", f"http://127.0.0.1:{port}", "--timeout", "5")
    assert done.returncode == 2 and "did not answer" in done.stderr
