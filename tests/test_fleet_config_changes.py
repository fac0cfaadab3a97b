"""Redeploying with a different engine config restarts the engines on it (never silently keeps the
old ones), and deleting the Serve app stops the engines and the fleet. The app's engines are
simulated (``engine.backend: simulated``): real Ray actors and processes with the engine's
interfaces, started in a second instead of ~20 s."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
import ray

from fleet_helpers import process_gone
from serve_helpers import wait_healthy
from runtime_fixtures import TEST_KV_GIB


APP = "cfgtest"




def _engine_pids(fleet) -> list[int]:
    view = ray.get(fleet.view.remote())
    return [ray.get(m.handle.health.remote())["pid"] for m in view.members]


def test_changed_engine_config_restarts_the_fleet_and_app_deletion_stops_it(service, redis_server, tiny_model_dir):
    from ray import serve

    from rollout_service.config import RolloutServiceConfig
    from rollout_service.fleet.fleet import fleet_name, get_fleet
    from rollout_service.serve.app import build_app

    def config(max_num_seqs: int) -> RolloutServiceConfig:
        return RolloutServiceConfig.model_validate({
            # Simulated engines: what is tested is the fleet's and the app's life cycle (restart on a
            # new engine config, stop with the app); the real engine's start is the session service's.
            "engine": {"model": str(tiny_model_dir), "max_num_seqs": max_num_seqs, "num_cpus_per_engine": 0,
                       "cpu_kvcache_space_gib": TEST_KV_GIB, "backend": "simulated",
                       "sim": {"decode_step_s": 0.02}},  # a 600-token stream takes ~12 s
            "store": {"redis_url": redis_server, "key_prefix": APP},
            "service": {"instance_name": APP, "num_affinity_replicas": 1},
            "fleet": {"app_watch_interval_s": 0.3},
        })

    health = f"{service.url}/{APP}/health"
    serve.run(build_app(config(16)), name=APP, route_prefix=f"/{APP}")
    try:
        wait_healthy(health)
        fleet = get_fleet(fleet_name(APP))
        assert ray.get(fleet.engine_config.remote())["max_num_seqs"] == 16
        old_pids = _engine_pids(fleet)
        # A trainer attaching to an app deployed without `up` (serve run / serve deploy): the
        # controller is created from the running fleet's config, and dies with the fleet.
        from rollout_service.refit.controller import controller_name, get_controller

        controller = get_controller(controller_name(APP))
        stats = ray.get(controller.stats.remote(), timeout=120)
        assert stats["num_engines"] == 1 and stats["fleet"]["apps"] == [APP]

        # A streamed call running when the redeploy comes: its engine is drained (out of the serving
        # set, its calls finished), not killed under it.
        stream: dict = {}

        def long_stream() -> None:
            body = {"model": "tiny-qwen3", "messages": [{"role": "user", "content": "go"}], "max_tokens": 600,
                    "ignore_eos": True, "stream": True, "seed": 1}
            with httpx.stream("POST", f"{service.url}/{APP}/v1/chat/completions", json=body, timeout=120,
                              headers={"X-Rollout-Id": "drained-1"}) as r:
                stream["status"] = r.status_code
                stream["lines"] = [line for line in r.iter_lines() if line]

        runner = threading.Thread(target=long_stream)
        runner.start()
        time.sleep(1.0)  # the stream is under way
        t0 = time.monotonic()
        serve.run(build_app(config(8)), name=APP, route_prefix=f"/{APP}")  # the redeploy
        deadline = time.monotonic() + 300
        while ray.get(fleet.engine_config.remote())["max_num_seqs"] != 8:
            assert time.monotonic() < deadline, "the fleet kept the old engine config"
            time.sleep(0.5)
        wait_healthy(health)
        print(f"redeploy with a new engine config -> healthy on new engines: {time.monotonic() - t0:.1f}s")
        runner.join(120)
        events = [json.loads(line[6:]) for line in stream["lines"] if line.startswith("data: {")]
        assert stream["status"] == 200 and not [e for e in events if "error" in e], events[-3:]
        assert [c["finish_reason"] for e in events for c in e.get("choices", []) if c.get("finish_reason")] == ["length"]
        stored = httpx.get(f"{service.url}/{APP}/v1/rollouts/drained-1", timeout=60).json()
        assert stored["turns"] == 1 and sum(stored["segments"][0]["loss_mask"]) == 600
        drain = ray.get(fleet.stats.remote())["last_drain"]
        print(f"drain before the restart: {drain}")
        assert drain is not None and drain["unfinished"] == [] and drain["seconds"] > 0.2
        new_pids = _engine_pids(fleet)
        assert new_pids and not set(new_pids) & set(old_pids)
        assert all(process_gone(p) for p in old_pids), "old engines still running"
        # The new engines really run the new config.
        r = httpx.post(f"{service.url}/{APP}/v1/chat/completions", timeout=120, json={
            "model": "tiny-qwen3", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
        assert r.status_code == 200, r.text
    finally:
        serve.delete(APP)

    t0 = time.monotonic()
    while True:  # the fleet notices the deletion, stops its engines and exits
        try:
            get_fleet(fleet_name(APP))
        except ValueError:
            break
        assert time.monotonic() - t0 < 60, "the fleet outlived its app"
        time.sleep(0.5)
    with pytest.raises(ValueError):
        ray.get_actor(controller_name(APP), namespace="rollout-service")  # killed with its fleet
    deadline = time.monotonic() + 30
    while not all(process_gone(p) for p in new_pids):
        assert time.monotonic() < deadline, "engines outlived the deleted app"
        time.sleep(0.5)
    print(f"app deleted -> fleet and engines gone: {time.monotonic() - t0:.1f}s")
