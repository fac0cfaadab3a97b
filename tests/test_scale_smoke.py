"""The service at fleet scale, CI-sized: 16 simulated engines behind the real Serve app, Redis and
refit controller; 200 two-turn rollouts through HTTP while a refit lands and an engine is killed
with SIGKILL. Counts are exact: every call answered, every rollout stored with both turns, every
token labelled with a version the fleet served, the refit committed on all 16, the killed engine
replaced (scripts/bench_scale.py is the measured version of this at 8-64 engines)."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import threading
import time

import httpx
import pytest
import ray

APP = "scale"
ENGINES = 16
ROLLOUTS = 200
CONCURRENCY = 24


def _config(tiny_model_dir, redis_url):
    from rollout_service.config import RolloutServiceConfig

    return RolloutServiceConfig.model_validate({
        "engine": {"model": str(tiny_model_dir), "backend": "simulated", "num_engines": ENGINES,
                   "num_cpus_per_engine": 0, "enable_prefix_caching": True, "max_num_seqs": 32,
                   "sim": {"decode_step_s": 0.002, "decode_step_s_per_seq": 0.0001, "prefill_s_per_token": 1e-6}},
        "store": {"redis_url": redis_url, "key_prefix": APP},
        "service": {"instance_name": APP, "num_affinity_replicas": 1},
        "routing": {"policy": "sticky_least_loaded", "load_margin": 2},
        "fleet": {"app_watch_interval_s": 0.3, "probe_interval_s": 0.5},
    })


def _engine_pids(fleet) -> dict[int, int]:
    view = ray.get(fleet.view.remote(), timeout=60)
    return {m.slot: ray.get(m.handle.health.remote(), timeout=60)["pid"] for m in view.members}


def test_sixteen_engines_two_hundred_rollouts_a_refit_and_a_kill_with_nothing_lost(service, redis_server,
                                                                                      tiny_model_dir, tmp_path):
    from ray import serve

    from rollout_service.fleet.fleet import fleet_name, get_fleet
    from rollout_service.refit.client import TrainerClient
    from rollout_service.refit.controller import controller_name, get_controller
    from rollout_service.serve.app import build_app

    base = f"{service.url}/{APP}"
    t0 = time.monotonic()
    serve.run(build_app(_config(tiny_model_dir, redis_server)), name=APP, route_prefix=f"/{APP}")
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(f"{base}/health", timeout=30).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the simulated fleet did not come up"
            time.sleep(0.5)
        fleet = get_fleet(fleet_name(APP))
        deadline = time.monotonic() + 120
        while len(pids := _engine_pids(fleet)) < ENGINES:
            assert time.monotonic() < deadline, f"{len(pids)} of {ENGINES} engines serving"
            time.sleep(0.5)
        print(f"{ENGINES} simulated engines + app up in {time.monotonic() - t0:.1f}s")

        ckpt = tmp_path / "ckpt-1"
        ckpt.mkdir()
        shutil.copy(tiny_model_dir / "model.safetensors", ckpt / "model.safetensors")
        trainer = TrainerClient(get_controller(controller_name(APP)), timeout_s=120)
        events: dict[str, object] = {}
        done = {"n": 0}

        def disturb():
            while done["n"] < ROLLOUTS // 4:
                time.sleep(0.05)
            events["report"] = trainer.refit("v1", str(ckpt), transport="path")
            while done["n"] < ROLLOUTS // 2:
                time.sleep(0.05)
            victim = _engine_pids(fleet)[3]
            os.kill(victim, signal.SIGKILL)
            events["killed"] = victim

        async def rollout(client, i, failures):
            rid = f"scale-{i}"
            messages = [{"role": "user", "content": f"task {i}: say something"}]
            versions = set()
            for turn in range(2):
                r = await client.post(f"{base}/v1/chat/completions", headers={"X-Rollout-Id": rid}, json={
                    "model": "tiny-qwen3", "messages": messages, "max_tokens": 6 + i % 5, "seed": i})
                if r.status_code != 200:
                    failures.append((rid, turn, r.status_code, r.text[:300]))
                    return
                msg = r.json()["choices"][0]["message"]
                versions |= {w["version"] for w in msg["weight_versions"]}
                messages += [{"role": "assistant", "content": msg["content"] or ""},
                             {"role": "user", "content": "go on"}]
            done["n"] += 1
            return versions

        async def run_all():
            failures: list = []
            sem = asyncio.Semaphore(CONCURRENCY)
            async with httpx.AsyncClient(timeout=120) as client:
                async def one(i):
                    async with sem:
                        return await rollout(client, i, failures)
                results = await asyncio.gather(*[one(i) for i in range(ROLLOUTS)])
            return results, failures

        side = threading.Thread(target=disturb, daemon=True)
        side.start()
        t0 = time.monotonic()
        results, failures = asyncio.run(run_all())
        took = time.monotonic() - t0
        side.join(timeout=120)
        print(f"{ROLLOUTS} rollouts x 2 turns in {took:.1f}s ({2 * ROLLOUTS / took:.0f} turns/s)")

        assert failures == [], failures[:5]
        assert done["n"] == ROLLOUTS
        report = events["report"]
        assert report["ok"] and len(report["engines"]) == ENGINES and report["requests_aborted"] == 0
        # Staged ahead of the pause (refit.staging: overlap): the stall is the load, label and resume.
        assert report["staging"] == "overlap" and report["staged_bytes"] > 0
        assert 0 < report["stall_s"] <= report["total_s"] - report["stage_s"] and 0 <= report["control_s"] <= report["stall_s"]
        assert "killed" in events
        assert set().union(*results) <= {"0", "v1"} and any("v1" in v for v in results)

        # Every rollout stored with both turns, read back through the API.
        with httpx.Client(timeout=60) as client:
            for i in range(ROLLOUTS):
                r = client.get(f"{base}/v1/rollouts/scale-{i}")
                assert r.status_code == 200, r.text
                traj = r.json()
                assert traj["turns"] == 2 and len(traj["segments"]) == 1, traj

        # The killed engine was replaced, on the refit's weights.
        deadline = time.monotonic() + 120
        while True:
            stats = ray.get(fleet.stats.remote(), timeout=60)
            healthy = [s for s in stats["slots"] if s["state"] == "healthy"]
            if len(healthy) == ENGINES and stats["slots"][3]["generation"] >= 1:
                break
            assert time.monotonic() < deadline, stats["slots"]
            time.sleep(0.5)
        assert all(s["weight_version"] == "v1" for s in stats["slots"])
        sums = set(trainer.weights_checksums())
        assert len(sums) == 1  # the replacement loaded the same weights as the other fifteen
        status = httpx.get(f"{base}/v1/status", timeout=60).json()
        assert status["backend"] == "simulated" and status["routing"]["policy"] == "sticky_least_loaded"
        assert status["refits"]["committed"] == 1 and status["routing"]["pin_moves"] >= 0
        print(f"pin moves: {status['routing']['pin_moves']}, refit stall {report['stall_s'] * 1e3:.0f} ms "
              f"(control {report['control_s'] * 1e3:.0f} ms)")
    finally:
        serve.delete(APP)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                get_fleet(fleet_name(APP))
            except ValueError:
                break
            time.sleep(0.5)
