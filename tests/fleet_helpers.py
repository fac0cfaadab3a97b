"""A two-engine fleet under fault: the real fleet actor, real vLLM engines, the real data plane
(TurnRunner + FleetClient) over the session's redis-server, and a refit controller over the fleet.

Shared by the fleet fault tests (session scope: engines start once; every fault test leaves the
fleet healed, serving two engines on one version, before it returns).
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import ray

from runtime_fixtures import TEST_KV_GIB

# Small thresholds so detection and replacement fit in a test; generous enough for a loaded 2-core box.
FLEET = {"probe_interval_s": 0.5, "probe_timeout_s": 3.0, "dead_after_failures": 3, "unresponsive_after_s": 6.0,
         "backoff_initial_s": 1.0, "max_replacements": 20, "replacement_window_s": 3600}
HEAL_TIMEOUT_S = 240


@dataclass
class FleetRig:
    fleet: Any
    controller: Any
    runner: Any
    store: Any
    trainer: Any
    config: Any
    rollouts: dict[str, list[dict]] = field(default_factory=dict)

    async def view(self):
        return await self.fleet.view.remote()

    async def stats(self):
        return await self.fleet.stats.remote()

    async def member_pids(self) -> dict[int, int]:
        view = await self.view()
        infos = await asyncio.gather(*[m.handle.health.remote() for m in view.members])
        return {m.slot: info["pid"] for m, info in zip(view.members, infos)}

    async def wait_serving(self, n: int, timeout: float = HEAL_TIMEOUT_S, version: str | None = None) -> float:
        """Seconds until ``n`` engines serve (on ``version``), also in this process's FleetClient."""
        t0 = time.monotonic()
        while True:
            view = await self.view()
            ok = len(view.members) == n and (version is None or view.version == version)
            client_view = self.runner.fleet.view
            if ok and client_view is not None and client_view.epoch == view.epoch:
                return time.monotonic() - t0
            assert time.monotonic() - t0 < timeout, f"fleet did not heal in {timeout}s: {await self.stats()}"
            await asyncio.sleep(0.25)

    async def wait_not_serving(self, slot: int, timeout: float = 60) -> float:
        t0 = time.monotonic()
        while slot in [m.slot for m in (await self.view()).members]:
            assert time.monotonic() - t0 < timeout, f"slot {slot} still serving after {timeout}s"
            await asyncio.sleep(0.1)
        return time.monotonic() - t0

    async def checksums_by_slot(self) -> dict[int, str]:
        view = await self.view()
        sums = await asyncio.gather(*[m.handle.collective_rpc.remote("rs_weights_checksum") for m in view.members])
        return {m.slot: s[0] for m, s in zip(view.members, sums)}

    async def versions_by_slot(self) -> dict[int, str]:
        view = await self.view()
        return dict(zip([m.slot for m in view.members],
                        await asyncio.gather(*[m.handle.weight_version.remote() for m in view.members])))

    async def paused_by_slot(self) -> dict[int, bool]:
        view = await self.view()
        return dict(zip([m.slot for m in view.members],
                        await asyncio.gather(*[m.handle.is_paused.remote() for m in view.members])))


def kill_pid(pid: int, sig=signal.SIGKILL) -> None:
    os.kill(pid, sig)


def process_gone(pid: int) -> bool:
    """Gone, or a zombie waiting for its parent (it runs nothing either way)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


async def call(runner, rid: str | None, messages: list[dict], *, seed: int, stream: bool, max_tokens: int = 12) -> dict:
    """One model call through the data plane; returns the final event or the error result."""
    return (await run_events(runner, turn_request(rid, messages, seed=seed, stream=stream, max_tokens=max_tokens)))[-1]


def turn_request(rid: str | None, messages: list[dict], *, seed: int, stream: bool, max_tokens: int = 12):
    from rollout_service.serve.turn_types import TurnRequest

    return TurnRequest(rollout_id=rid, messages=messages, max_tokens=max_tokens, stream=stream,
                       sampling={"seed": seed, "ignore_eos": True})


async def run_events(runner, req, on_event=None) -> list[dict]:
    """The runner's events as dicts (``kind`` delta / final), or the error as its tagged result last."""
    from dataclasses import asdict

    from rollout_service.serve.protocol.envelope import ServiceError
    from rollout_service.serve.turn_types import TokenDelta

    events: list[dict] = []
    try:
        async for e in runner.run_turn(req):
            events.append({"kind": "delta" if isinstance(e, TokenDelta) else "final", **asdict(e)})
            if on_event is not None:
                on_event(events[-1])
    except ServiceError as exc:
        events.append(exc.to_result())
    return events


async def run_rollout(runner, rid: str, turns: int, *, stream: bool, seed0: int, log: list[dict],
                      max_retries: int = 20) -> list[dict]:
    """A rollout of ``turns`` calls; a call that fails with 503 is retried (what an agent does).
    ``log`` gets every call's outcome. Returns the acknowledged (200) finals in order."""
    messages = [{"role": "user", "content": f"{rid}: count the stars"}]
    acked = []
    for turn in range(turns):
        for attempt in range(max_retries):
            final = await call(runner, rid, messages, seed=seed0 + 100 * turn + attempt, stream=stream)
            log.append({"rid": rid, "turn": turn, "error": final.get("__error__")})
            if "__error__" not in final:
                break
            assert final["__error__"] == 503, final  # an engine fault is never a 500
            await asyncio.sleep(0.2)
        else:
            raise AssertionError(f"{rid} turn {turn}: no success after {max_retries} attempts")
        acked.append(final)
        messages = messages + [{"role": "assistant", "content": final["message"]["content"]},
                               {"role": "user", "content": f"turn {turn + 1}"}]
    return acked


async def assert_trajectory_exact(store, rid: str, acked: list[dict]) -> None:
    """Every acknowledged turn is stored, in order, and each prompt extends the previous turn exactly."""
    state = await store.load(rid)
    assert state is not None and state.turn == len(acked), (rid, state and state.turn, len(acked))
    assert len(state.segments) == 1, f"{rid}: a fault must not fork the rollout"
    seq = state.segments[0].token_ids
    for prev, cur in zip(acked, acked[1:]):
        base = prev["prompt_token_ids"] + prev["generation_token_ids"]
        assert cur["prompt_token_ids"][: len(base)] == base, f"{rid}: prompt continuity broken"
    last = acked[-1]
    assert seq == last["prompt_token_ids"] + last["generation_token_ids"]


def new_rid(tag: str) -> str:
    return f"{tag}-{uuid.uuid4().hex[:8]}"


# The stand-in engines of ``sim_rig`` (engine/simulated.py): real actors and processes, killed by real
# signals, sampling in a few ms a token, so a fault drill's time is the fleet's, not vLLM's start-up.
SIM_ENGINE = {"backend": "simulated", "max_num_seqs": 16,
              "sim": {"decode_step_s": 0.004, "decode_step_s_per_seq": 0.0001, "prefill_s_per_token": 1e-6}}


def start_rig(tiny_model_dir, redis_url: str, tokenizer, *, simulated: bool = False):
    """Build the rig (sync parts); the caller connects the FleetClient inside its event loop. Two real
    vLLM engines, or (``simulated``) two stand-ins with the same interfaces, under their own key prefix."""
    from rollout_service.config import RolloutServiceConfig
    from rollout_service.fleet.fleet import EngineFleet
    from rollout_service.refit.controller import RefitController

    engine = {"model": str(tiny_model_dir), "num_engines": 2, "num_cpus_per_engine": 0, "cpu_kvcache_space_gib": TEST_KV_GIB}
    cfg = RolloutServiceConfig.model_validate({
        "engine": {**engine, **(SIM_ENGINE if simulated else {})},
        "store": {"redis_url": redis_url, "key_prefix": "simfleet" if simulated else "fleet"},
        "refit": {"step_timeout_s": 60},
        "fleet": FLEET,
    })
    fleet = ray.remote(EngineFleet).options(num_cpus=0, max_concurrency=1000).remote(cfg.model_dump())
    controller = ray.remote(RefitController).options(num_cpus=0, max_concurrency=1000).remote(cfg.model_dump(), fleet)
    ray.get(controller.start.remote(), timeout=600)
    return cfg, fleet, controller
