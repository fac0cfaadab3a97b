"""A fleet stopped while an engine is still starting (``up`` interrupted, an app deleted during a
replacement) kills that engine at once: a starting engine answers no call before its start ends, so
the graceful stop that running engines get would only wait out its deadline. On a stand-in engine
whose start blocks its actor as a real model load does (``engine.sim.start_s``)."""

from __future__ import annotations

import time
from pathlib import Path

import ray

from fleet_helpers import FLEET, SIM_ENGINE, process_gone

START_S = 60.0


def _starting_engine_pids() -> set[int]:
    """Processes whose Ray title says they run a stand-in engine's start (``ray::SimulatedEngine.start``)."""
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                title = (entry / "cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
            except OSError:
                continue
            if title.startswith("ray::SimulatedEngine.start"):
                found.add(int(entry.name))
    return found


def test_a_fleet_stopped_while_an_engine_starts_kills_it_at_once(ray_session, tiny_model_dir):
    from rollout_service.config import RolloutServiceConfig
    from rollout_service.fleet.fleet import EngineFleet

    before = _starting_engine_pids()
    cfg = RolloutServiceConfig.model_validate({
        "engine": {"model": str(tiny_model_dir), "num_engines": 1, "num_cpus_per_engine": 0,
                   **SIM_ENGINE, "sim": {**SIM_ENGINE["sim"], "start_s": START_S}},
        "fleet": FLEET,
    })
    fleet = ray.remote(EngineFleet).options(num_cpus=0, max_concurrency=1000).remote(cfg.model_dump())
    try:
        ray.get(fleet.start.remote(wait=False), timeout=60)
        deadline = time.monotonic() + 60
        while not (starting := _starting_engine_pids() - before):
            assert time.monotonic() < deadline, "the engine's start never began"
            time.sleep(0.1)
        t0 = time.monotonic()
        ray.get(fleet.shutdown.remote(), timeout=START_S)
        took = time.monotonic() - t0
        print(f"fleet stopped {took:.2f}s after its call, its engine {START_S:.0f}s from started")
        assert took < 5.0  # not the 20 s a started engine's graceful stop may take, nor the rest of the start
        deadline = time.monotonic() + 10
        while not all(process_gone(pid) for pid in starting):
            assert time.monotonic() < deadline, f"the starting engine outlived the stop: {starting}"
            time.sleep(0.1)
    finally:
        ray.kill(fleet)
