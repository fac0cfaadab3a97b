"""Replica fault drill: a Serve replica of the app (`RolloutService`) is killed under agent traffic.

The whole service (`up`'s LocalService: Ray Serve, one vLLM engine, redis-server, two replicas)
behind the chosen HTTP ingress (``--proxy haproxy``, `up`'s default, or ``serve``). Agents run
multi-turn rollouts over HTTP with ``X-Rollout-Id``; each turn carries an ``Idempotency-Key`` and is
retried on any failure (error status, connection error, or no answer within ``--call-timeout``), as
an agent harness does. Mid-run one replica process gets SIGKILL; Serve starts a replacement.

Measured per ingress: what the calls in flight saw (statuses, connection errors, timeouts), the
longest call, the time until every rollout answered again, forks (a retry must never fork) and
acknowledged turns lost (every 200 answer's tokens must be in the stored trajectory, in order).

    .venv/bin/python scripts/drill_replica_kill.py [--proxy haproxy|serve] [--rollouts 12] [--turns 8]

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
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from rollout_service.ops.runtime import apply_local_env  # noqa: E402

apply_local_env()

REPLICA_CMD = b"ServeReplica:rollout-service:RolloutService"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def replica_pids() -> list[int]:
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                if REPLICA_CMD in Path(f"/proc/{name}/cmdline").read_bytes():
                    out.append(int(name))
            except OSError:
                pass
    return sorted(out)


class Agents:
    def __init__(self, url: str, model: str, rollouts: int, turns: int, call_timeout: float):
        import httpx

        self.http = httpx.AsyncClient(base_url=url, timeout=call_timeout)
        self.model, self.rollouts, self.turns = model, rollouts, turns
        self.outcomes: Counter = Counter()
        self.longest = 0.0
        self.failures: list[tuple[float, str]] = []
        self.answered: list[float] = []
        self.replicas: dict[str, list[str]] = {}  # rollout id -> the replica that answered each acked turn

    async def agent(self, rid: str, seed: int) -> list[dict]:
        messages = [{"role": "user", "content": f"{rid}: count the stars"}]
        acked = []
        for turn in range(self.turns):
            key = f"{rid}-turn-{turn}"
            for attempt in range(20):
                t0 = time.monotonic()
                try:
                    r = await self.http.post("/v1/chat/completions", headers={"X-Rollout-Id": rid, "Idempotency-Key": key},
                                             json={"model": self.model, "messages": messages, "max_tokens": 12,
                                                   "seed": seed + turn, "ignore_eos": True})
                    outcome = str(r.status_code)
                except Exception as exc:  # connection reset, timeout: the retry decides
                    r, outcome = None, type(exc).__name__
                took = time.monotonic() - t0
                self.longest = max(self.longest, took)
                self.outcomes[outcome] += 1
                if r is not None and r.status_code == 200:
                    self.answered.append(time.monotonic())
                    self.replicas.setdefault(rid, []).append(r.headers.get("x-rollout-replica", ""))
                    break
                self.failures.append((time.monotonic(), f"{outcome}: {(r.text[:120] if r is not None else '')}"))
                await asyncio.sleep(0.5)
            else:
                raise RuntimeError(f"{rid} turn {turn}: no answer after 20 attempts")
            msg = r.json()["choices"][0]["message"]
            acked.append(msg)
            messages += [{"role": "assistant", "content": msg["content"], "reasoning_content": msg.get("reasoning_content")},
                         {"role": "user", "content": f"turn {turn}"}]
        return acked

    async def check(self, rid: str, acked: list[dict]) -> tuple[int, int]:
        """(acknowledged turns lost, forks) of one rollout, from the stored trajectory."""
        for attempt in range(5):  # a kept-alive connection closed by HAProxy's reload: retried, as clients do
            try:
                traj = (await self.http.get(f"/v1/rollouts/{rid}", headers={"X-Rollout-Id": rid})).json()
                break
            except Exception:
                if attempt == 4:
                    raise
                await asyncio.sleep(0.5)
        forks = len(traj["segments"]) - 1
        seg = traj["segments"][-1]
        lost = sum(seg["token_ids"][: len(m["prompt_token_ids"]) + len(m["generation_token_ids"])]
                   != m["prompt_token_ids"] + m["generation_token_ids"] for m in acked)
        return lost + max(0, len(acked) - traj["turns"]), forks


async def drill(args) -> dict:
    from rollout_service.config import RolloutServiceConfig
    from rollout_service.ops.launcher import LocalService

    cfg = RolloutServiceConfig.model_validate({"service": {"num_affinity_replicas": 2}})
    svc = LocalService(cfg, port=free_port(), proxy=args.proxy, log=lambda *a: print(*a, flush=True))
    try:
        await asyncio.to_thread(svc.start)
        import httpx

        model = httpx.get(f"{svc.url}/v1/models", timeout=60).json()["data"][0]["id"]
        agents = Agents(svc.url, model, args.rollouts, args.turns, args.call_timeout)
        rids = [f"drill-{uuid.uuid4().hex[:6]}-{i}" for i in range(args.rollouts)]
        t_start = time.monotonic()
        tasks = [asyncio.create_task(agents.agent(rid, 1000 * i)) for i, rid in enumerate(rids)]
        await asyncio.sleep(args.kill_after)
        before = replica_pids()
        victim = before[0]
        os.kill(victim, signal.SIGKILL)
        t_kill = time.monotonic()
        print(f"[drill] SIGKILL replica pid {victim} (replicas {before}) at t={t_kill - t_start:.1f}s", flush=True)
        results = await asyncio.gather(*tasks)
        t_end = time.monotonic()
        checks = [await agents.check(rid, acked) for rid, acked in zip(rids, results)]
        after_kill = [t for t in agents.answered if t > t_kill]
        failed_after = [t for t, _ in agents.failures if t > t_kill]
        replaced = sorted(set(replica_pids()) - set(before))
        await agents.http.aclose()
        return {
            "proxy": args.proxy, "rollouts": args.rollouts, "turns": args.turns,
            "outcomes": dict(agents.outcomes), "longest_call_s": agents.longest,
            "failing_window_s": (max(failed_after) - t_kill) if failed_after else 0.0,
            "first_answer_after_kill_s": (min(after_kill) - t_kill) if after_kill else None,
            "run_s": t_end - t_start, "acked": sum(len(r) for r in results),
            "lost": sum(c[0] for c in checks), "forks": sum(c[1] for c in checks),
            "replacement_replica": replaced, "failures": [f for _, f in agents.failures][:8],
        }
    finally:
        await asyncio.to_thread(svc.stop)
        from rollout_service.ops.runtime import shutdown_local_ray

        shutdown_local_ray()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--proxy", choices=["haproxy", "serve"], default="haproxy")
    p.add_argument("--rollouts", type=int, default=12)
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--kill-after", type=float, default=4.0, help="seconds of traffic before the kill")
    p.add_argument("--call-timeout", type=float, default=30.0, help="client timeout per call (then it retries)")
    args = p.parse_args()
    row = asyncio.run(drill(args))
    print(f"\n{row}\n")
    print("| ingress | rollouts x turns | call outcomes | longest call (s) | failing window after the kill (s) | "
          "acked turns | lost | forks |")
    print("|---|---|---|---:|---:|---:|---:|---:|")
    print(f"| {row['proxy']} | {row['rollouts']} x {row['turns']} | "
          f"{', '.join(f'{k}: {v}' for k, v in sorted(row['outcomes'].items()))} | {row['longest_call_s']:.1f} | "
          f"{row['failing_window_s']:.1f} | {row['acked']} | {row['lost']} | {row['forks']} |")
    return 0 if row["lost"] == 0 and row["forks"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
