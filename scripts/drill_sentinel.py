"""Store failover drill: how many acknowledged turns each ``store.durability`` mode loses when
the Redis primary is killed (``kill -9``) under load, and what ``replicated`` costs per turn; with
``--topology cluster``, the same on a Redis Cluster (3 primaries, a replica each, the rollouts'
keys spread over the slots by their hash tags), one primary killed.

Per mode, a fresh primary + 2 replicas + 3 sentinels on 127.0.0.1 (``LocalSentinelGroup``) and
the store the service uses (``RedisRolloutStore`` through the ``redis+sentinel://`` URL, the
service's deadlines). Writers append the turns of their rollouts as fast as they can, as the
service's replicas do; an append that fails is resolved as an agent's retry would be (the stored
turn read back: there, it counts as acknowledged and is replayed; missing, it is appended again).
``--before`` seconds in (``--replica-lag-s``: after the replicas were stopped that long, as a
lagging replica would be), the primary gets SIGKILL; the sentinels promote a replica; writing goes on
for ``--after`` seconds. Then every rollout is read from the new primary: an acknowledged turn not
there is lost.

    .venv/bin/python scripts/drill_sentinel.py [--writers 16] [--before 4] [--after 8] [--replica-lag-s 0.5]
        [--modes local,replicated] [--rounds 2]
    .venv/bin/python scripts/drill_sentinel.py --topology cluster --modes local [--writers 48]

On the cluster, ``--down-after-ms`` is the nodes' ``cluster-node-timeout`` and only ``local`` runs
(``replicated`` is refused there: WAIT would have to follow each write on its own node's connection).

Everything runs on 127.0.0.1, is bounded in time, and stops every process it started.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the suite's synthetic rollouts
from rollout_service.config import StoreConfig  # noqa: E402
from rollout_service.store import RedisRolloutStore, StoreError, StoreUnavailable  # noqa: E402
from rollout_service.store.cluster_group import LocalRedisCluster  # noqa: E402
from rollout_service.store.sentinel_group import LocalSentinelGroup  # noqa: E402
from synthetic_rollouts import synthetic_delta  # noqa: E402


class Turns:
    """A rollout's turns, made as they are needed (one segment, 64 prompt + 64 generated ids each)."""

    def __init__(self, seed: int):
        self.rng, self.deltas, self.seg_len = random.Random(seed), [], 0

    def __getitem__(self, i: int):
        while len(self.deltas) <= i:
            n = len(self.deltas)
            d = synthetic_delta(self.rng, turn=n + 1, segment_index=0, new_segment=n == 0, segment_len=self.seg_len,
                                prompt_tokens=64, gen_tokens=64)
            self.seg_len += len(d.token_ids)
            self.deltas.append(d)
        return self.deltas[i]


async def writer(store, rid: str, deltas: Turns, acked: dict, stats: dict, stop: asyncio.Event, killed: dict) -> None:
    turn = 0
    while not stop.is_set():
        t0 = time.perf_counter()
        try:
            await store.append_turn(rid, deltas[turn], expected_turn=turn)
            took = time.perf_counter() - t0
            if "at" not in killed:
                stats["latency"].append(took)
            turn += 1
            acked[rid] = turn
            continue
        except StoreUnavailable:
            stats["unavailable"] += 1
        except StoreError as exc:  # a conflict: the stored rollout is not where this writer thinks
            stats["errors"].append(repr(exc)[:120])
        # Resolve as the agent's retry would: read the rollout back.
        while not stop.is_set():
            try:
                state = await store.load(rid)
                stored = state.turn if state is not None else 0
                if stored > turn:  # it landed: the retry replays it
                    turn = stored
                    acked[rid] = turn
                    stats["resolved_stored"] += 1
                elif stored < turn:  # acknowledged turns are gone (a failover to a replica that lacked them)
                    stats["lost"] += turn - stored
                    turn = stored  # the rollout goes on from what is stored (the service would fork)
                    acked[rid] = turn
                break
            except StoreUnavailable:
                await asyncio.sleep(0.1)


class ClusterTopology:
    """The drill's view of a LocalRedisCluster: the primary it kills is the first one."""

    def __init__(self, directory: str, args):
        self.cluster = LocalRedisCluster(directory, primaries=3, replicas=1, node_timeout_ms=args.down_after_ms)

    def __enter__(self):
        self.cluster.__enter__()
        self.url = self.cluster.url
        return self

    def __exit__(self, *exc):
        self.cluster.__exit__(*exc)

    def primary_port(self) -> int:
        return self.cluster.primaries()[0]

    def primary_pid(self) -> int:
        return self.cluster.pid_of(self.primary_port())

    @property
    def replicas(self):
        primaries = set(self.cluster.primaries())
        return [n for n in self.cluster.nodes if n.port not in primaries]

    def wait_for_failover(self, old_port: int, timeout: float) -> float:
        return self.cluster.wait_for_failover(old_port, timeout)


async def run_mode(mode: str, args) -> dict:
    with tempfile.TemporaryDirectory(prefix=f"drill-store-{mode}-") as d, \
            (ClusterTopology(d, args) if args.topology == "cluster" else
             LocalSentinelGroup(d, replicas=2, sentinels=3, down_after_ms=args.down_after_ms)) as group:
        config = StoreConfig.model_validate({"redis_url": group.url, "key_prefix": "drill", "durability": mode})
        store = RedisRolloutStore.from_config(config)
        rollouts = {f"{mode}-{i}": Turns(i) for i in range(args.writers)}
        acked: dict[str, int] = {}
        stats = {"latency": [], "unavailable": 0, "resolved_stored": 0, "errors": [], "lost": 0}
        stop, killed = asyncio.Event(), {}
        tasks = [asyncio.create_task(writer(store, rid, deltas, acked, stats, stop, killed))
                 for rid, deltas in rollouts.items()]
        await asyncio.sleep(args.before)
        old_port = group.primary_port()
        replicas = [r.pid for r in group.replicas]
        if args.replica_lag_s > 0:  # the replicas fall behind (a slow network, a busy replica)
            for pid in replicas:
                os.kill(pid, signal.SIGSTOP)
            await asyncio.sleep(args.replica_lag_s)
        acked_at_kill = sum(acked.values())
        spread = sorted(group.cluster.keys_per_primary().values()) if args.topology == "cluster" else None
        os.kill(group.primary_pid(), signal.SIGKILL)
        killed["at"] = time.monotonic()
        for pid in replicas if args.replica_lag_s > 0 else []:
            os.kill(pid, signal.SIGCONT)
        failover_s = await asyncio.to_thread(group.wait_for_failover, old_port, 60)
        await asyncio.sleep(args.after)
        stop.set()
        await asyncio.gather(*tasks)
        lost = stats["lost"]  # found by the writers as they went on
        for rid in rollouts:
            for _ in range(100):
                try:
                    state = await store.load(rid)
                    break
                except StoreUnavailable:
                    await asyncio.sleep(0.1)
            stored = state.turn if state is not None else 0
            lost += max(0, acked.get(rid, 0) - stored)
        await store.close()
        lat = sorted(stats["latency"])
        return {"mode": mode, "topology": args.topology, "keys_per_primary": spread, "acked": sum(acked.values()), "acked_at_kill": acked_at_kill, "lost": lost,
                "failover_s": failover_s, "unavailable": stats["unavailable"],
                "resolved": stats["resolved_stored"], "errors": len(stats["errors"]),
                "p50_ms": 1000 * statistics.median(lat) if lat else float("nan"),
                "p99_ms": 1000 * lat[int(0.99 * (len(lat) - 1))] if lat else float("nan"),
                "appends_per_s": len(lat) / args.before}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--writers", type=int, default=16)
    ap.add_argument("--before", type=float, default=4.0, help="seconds of writing before the kill")
    ap.add_argument("--after", type=float, default=8.0, help="seconds of writing after the failover")
    ap.add_argument("--down-after-ms", type=int, default=1000, help="sentinels' down-after-milliseconds")
    ap.add_argument("--replica-lag-s", type=float, default=0.0,
                    help="stop the replicas (SIGSTOP) this long before the primary is killed: what a lagging "
                    "replica loses on failover")
    ap.add_argument("--topology", choices=("sentinel", "cluster"), default="sentinel",
                    help="a primary + 2 replicas + 3 sentinels, or a Redis Cluster of 3 primaries with a replica each")
    ap.add_argument("--modes", default="local,replicated")
    ap.add_argument("--rounds", type=int, default=1, help="runs per mode, alternating")
    args = ap.parse_args()
    if args.topology == "cluster" and "replicated" in args.modes.split(","):
        ap.error("--topology cluster runs only --modes local (replicated is refused on a Redis Cluster)")
    rows = []
    for _ in range(args.rounds):
        for mode in args.modes.split(","):
            rows.append(asyncio.run(run_mode(mode, args)))
            print(rows[-1], flush=True)
    print()
    print("| topology | durability | turns acked | acked at kill | lost | failover (s) | 503s (resolved as stored) | append p50 / p99 before the kill (ms) | appends/s |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['topology']}{' ' + str(r['keys_per_primary']) if r['keys_per_primary'] else ''} | {r['mode']} | {r['acked']} | {r['acked_at_kill']} | {r['lost']} | {r['failover_s']:.1f} | "
              f"{r['unavailable']} ({r['resolved']}) | {r['p50_ms']:.2f} / {r['p99_ms']:.2f} | {r['appends_per_s']:.0f} |")


if __name__ == "__main__":
    main()
