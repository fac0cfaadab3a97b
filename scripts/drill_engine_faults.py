"""Engine fault drill: the whole service (`up`'s LocalService: Ray Serve, two vLLM engines, redis-server)
under agent traffic over HTTP while engines are killed, hung and all lost at once.

For each fault it measures: fault -> detected (slot out of the serving set), fault -> healed (two
engines serving again, on the current weights), the calls that failed meanwhile (503; agents retry
them), and acknowledged turns lost (must be 0: every 200 answer's tokens are in the stored
trajectory, in order). Prints a table; the latest results go in docs/reliability.md.

    .venv/bin/python scripts/drill_engine_faults.py [--rollouts 16] [--turns 4]

Traffic goes to 127.0.0.1 only, is bounded, and the drill stops everything it started.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from rollout_service.ops.runtime import apply_local_env  # noqa: E402

apply_local_env()

FLEET = {"probe_interval_s": 0.5, "probe_timeout_s": 3.0, "dead_after_failures": 3, "unresponsive_after_s": 6.0,
         "backoff_initial_s": 1.0}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Drill:
    def __init__(self, svc, rollouts: int, turns: int):
        import httpx
        import ray

        self.svc, self.ray = svc, ray
        self.http = httpx.AsyncClient(base_url=svc.url, timeout=120)
        self.rollouts, self.turns = rollouts, turns

    async def view(self):
        return await self.svc.fleet.view.remote()

    async def pids(self) -> dict[int, int]:
        view = await self.view()
        infos = await asyncio.gather(*[m.handle.health.remote() for m in view.members])
        return {m.slot: i["pid"] for m, i in zip(view.members, infos)}

    async def agent(self, rid: str, seed: int, stats: dict) -> list[dict]:
        """One rollout: each turn retried on 503 until it succeeds (what an agent harness does)."""
        messages = [{"role": "user", "content": f"{rid}: count the stars"}]
        acked = []
        for turn in range(self.turns):
            while True:
                r = await self.http.post("/v1/chat/completions", headers={"X-Rollout-Id": rid}, json={
                    "model": "tiny-qwen3", "messages": messages, "max_tokens": 12, "seed": seed + turn,
                    "stream": False, "ignore_eos": True})
                stats["calls"] += 1
                if r.status_code == 200:
                    break
                assert r.status_code == 503, (r.status_code, r.text)
                stats["failed"] += 1
                stats["first_fail"] = stats.get("first_fail") or time.monotonic()
                stats["last_fail"] = time.monotonic()
                await asyncio.sleep(0.2)
            msg = r.json()["choices"][0]["message"]
            acked.append(msg)
            messages += [{"role": "assistant", "content": msg["content"]}, {"role": "user", "content": f"turn {turn}"}]
        return acked

    async def lost_turns(self, rid: str, acked: list[dict]) -> int:
        traj = (await self.http.get(f"/v1/rollouts/{rid}")).json()
        seg = traj["segments"][-1]
        lost = 0
        for msg in acked:
            seq = msg["prompt_token_ids"] + msg["generation_token_ids"]
            if seg["token_ids"][: len(seq)] != seq:
                lost += 1
        return lost + max(0, len(acked) - sum(len(s["turns"]) for s in traj["segments"]))

    async def wait(self, predicate, timeout=600, step=0.1) -> float:
        t0 = time.monotonic()
        while not await predicate():
            if time.monotonic() - t0 > timeout:
                raise TimeoutError("drill step timed out")
            await asyncio.sleep(step)
        return time.monotonic() - t0

    async def health_ok(self) -> bool:
        try:
            return (await self.http.get("/health")).status_code == 200
        except Exception:
            return False

    async def run_fault(self, name: str, fault) -> dict:
        view = await self.view()
        n = len(view.members)
        stats = {"calls": 0, "failed": 0}
        slug = "".join(c if c.isalnum() else "-" for c in name)
        rids = [f"drill-{slug}-{uuid.uuid4().hex[:6]}-{i}" for i in range(self.rollouts)]
        tasks = [asyncio.create_task(self.agent(rid, 1000 * i, stats)) for i, rid in enumerate(rids)]
        await asyncio.sleep(1.0)  # calls in flight on every engine
        t_fault, victims = await fault()
        await self.wait(lambda: self._out(victims), timeout=120)
        detect_s = time.monotonic() - t_fault
        health_during = 200 if await self.health_ok() else 503  # all engines lost: 503
        results = await asyncio.gather(*tasks)

        async def healed():
            v = await self.view()
            return len(v.members) == n and v.version == view.version

        await self.wait(healed)
        heal_s = time.monotonic() - t_fault
        lost = sum([await self.lost_turns(rid, acked) for rid, acked in zip(rids, results)])
        outage = (stats["last_fail"] - stats["first_fail"]) if stats.get("first_fail") else 0.0
        return {"fault": name, "detect_s": detect_s, "heal_s": heal_s, "calls": stats["calls"],
                "health_during": health_during,
                "failed": stats["failed"], "failing_window_s": outage,
                "acked": self.rollouts * self.turns, "lost": lost}

    async def _out(self, victims) -> bool:
        serving = {m.slot for m in (await self.view()).members}
        return not (serving & set(victims))

    async def kill_one(self):
        pids = await self.pids()
        slot = max(pids)
        os.kill(pids[slot], signal.SIGKILL)
        return time.monotonic(), [slot]

    async def hang_one(self):
        pids = await self.pids()
        slot = min(pids)
        os.kill(pids[slot], signal.SIGSTOP)
        return time.monotonic(), [slot]

    async def kill_all(self):
        pids = await self.pids()
        for pid in pids.values():
            os.kill(pid, signal.SIGKILL)
        return time.monotonic(), list(pids)


async def drill(args) -> list[dict]:
    from rollout_service.config import RolloutServiceConfig
    from rollout_service.ops.launcher import LocalService

    cfg = RolloutServiceConfig.model_validate({
        "engine": {"num_engines": 2, "num_cpus_per_engine": 0},
        "service": {"num_affinity_replicas": 2},
        "fleet": FLEET,
    })
    svc = await asyncio.to_thread(LocalService(cfg, port=free_port(), log=lambda *a: print(*a, flush=True)).start)
    try:
        d = Drill(svc, args.rollouts, args.turns)
        rows = []
        for name, fault in (("kill -9 one engine", d.kill_one), ("SIGSTOP one engine", d.hang_one),
                            ("kill -9 every engine", d.kill_all)):
            rows.append(await d.run_fault(name, fault))
            rows[-1]["health_ok"] = await d.health_ok()
            print(rows[-1], flush=True)
        await d.http.aclose()
        return rows
    finally:
        await asyncio.to_thread(svc.stop)
        import ray

        ray.shutdown()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rollouts", type=int, default=16)
    p.add_argument("--turns", type=int, default=4)
    args = p.parse_args()
    rows = asyncio.run(drill(args))
    print(f"\n{args.rollouts} rollouts x {args.turns} turns per fault, 2 engines (tiny model, CPU); fleet: {FLEET}\n")
    print("| fault | detected (s) | healed (s) | calls | failed (503) | failing window (s) | acked turns | lost "
          "| /health during | /health after |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['fault']} | {r['detect_s']:.1f} | {r['heal_s']:.1f} | {r['calls']} | {r['failed']} | "
              f"{r['failing_window_s']:.1f} | {r['acked']} | {r['lost']} | {r['health_during']} | "
              f"{200 if r['health_ok'] else 503} |")
    return 0 if all(r["lost"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
