#!/usr/bin/env python
"""Benchmark the append-only Redis rollout store against stores that rewrite the history per turn.

Every store does the same conditional (turn-counter-checked) write in one Lua call; they differ only
in what they write. The naive stores are given the rollout state in memory (as an affinity replica
has it after its load), so they pay only for serialising and sending the whole history each turn.

    .venv/bin/python scripts/bench_store.py                 # starts its own redis-server (AOF everysec)
    .venv/bin/python scripts/bench_store.py --url redis://127.0.0.1:6379/0 --rollouts 64 --turns 60
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import statistics
import sys
import tempfile
import time
import uuid

import numpy as np
import redis.asyncio as aioredis

from rollout_service.onpolicy.types import RolloutState, Segment, TurnDelta, TurnRecord
from rollout_service.store import EmbeddedRedis, RedisRolloutStore, TurnConflict
from rollout_service.store.codec import IDS_DTYPE, LOGPROBS_DTYPE, MASK_DTYPE
from rollout_service.store.testing import synthetic_rollout

_CAS_SET = """
if (redis.call('GET', KEYS[1]) or '0') ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[1], ARGV[2], 'EX', ARGV[3])
for i = 2, #KEYS do redis.call('SET', KEYS[i], ARGV[i + 2], 'EX', ARGV[3]) end
return 1
"""


class _RewriteStore:
    """Rewrites a rollout's whole history on every turn (what the append-only layout avoids)."""

    name = "rewrite"
    fields: tuple[str, ...] = ()

    def __init__(self, client: aioredis.Redis, prefix: str, ttl: int = 3600):
        self.client, self.prefix, self.ttl = client, prefix, ttl
        self._cas = client.register_script(_CAS_SET)
        self._states: dict[str, RolloutState] = {}

    def _keys(self, rid: str) -> list[str]:
        return [f"{self.prefix}:{{{rid}}}:turn"] + [f"{self.prefix}:{{{rid}}}:{f}" for f in self.fields]

    async def append_turn(self, rid: str, delta: TurnDelta, *, expected_turn: int) -> None:
        state = self._states.setdefault(rid, RolloutState(rid))
        delta.apply(state)  # the benchmark has no conflicts, so no rollback of the cached state is needed
        ok = await self._cas(keys=self._keys(rid), args=[expected_turn, delta.turn, self.ttl, *self.encode(state)])
        if not ok:
            raise TurnConflict(rid, expected_turn, -1)

    async def close(self) -> None:
        await self.client.aclose()


class RewriteJsonStore(_RewriteStore):
    """The obvious implementation: the whole RolloutState as one JSON document."""

    name = "rewrite whole history (JSON)"
    fields = ("state",)

    def encode(self, s: RolloutState) -> list[bytes | str]:
        return [json.dumps({"turn": s.turn, "segments": [_seg_dict(seg) for seg in s.segments]})]

    async def load(self, rid: str) -> RolloutState:
        doc = json.loads(await self.client.get(self._keys(rid)[1]))
        segs = [Segment(d["token_ids"], d["loss_mask"], d["logprobs"], [TurnRecord.from_dict(t) for t in d["turns"]],
                        d["messages"], d["render_context"]) for d in doc["segments"]]
        return RolloutState(rid, doc["turn"], segs)


class RewritePackedStore(_RewriteStore):
    """Same packed int32/float32/uint8 arrays as the real store, but SET in full every turn."""

    name = "rewrite whole history (packed)"
    fields = ("ids", "lp", "mask", "meta")

    def encode(self, s: RolloutState) -> list[bytes | str]:
        seg = s.segments[-1]  # the benchmark rollouts have one segment
        meta = json.dumps({"turns": [t.to_dict() for t in seg.turns], "messages": seg.messages,
                           "render_context": seg.render_context})
        return [np.asarray(seg.token_ids, IDS_DTYPE).tobytes(), np.asarray(seg.logprobs, LOGPROBS_DTYPE).tobytes(),
                np.asarray(seg.loss_mask, MASK_DTYPE).tobytes(), meta]

    async def load(self, rid: str) -> RolloutState:
        turn, ids, lp, mask, meta = await self.client.mget(self._keys(rid))
        m = json.loads(meta)
        seg = Segment(np.frombuffer(ids, IDS_DTYPE).tolist(), np.frombuffer(mask, MASK_DTYPE).tolist(),
                      np.frombuffer(lp, LOGPROBS_DTYPE).tolist(), [TurnRecord.from_dict(t) for t in m["turns"]],
                      m["messages"], m["render_context"])
        return RolloutState(rid, int(turn), [seg])


def _seg_dict(seg: Segment) -> dict:
    return {"token_ids": seg.token_ids, "loss_mask": seg.loss_mask, "logprobs": seg.logprobs,
            "turns": [t.to_dict() for t in seg.turns], "messages": seg.messages, "render_context": seg.render_context}


async def run_appends(store, deltas: list[TurnDelta], rollouts: int, concurrency: int) -> dict:
    """``concurrency`` workers; each drives whole rollouts turn by turn (a rollout's turns are sequential)."""
    queue: asyncio.Queue[str] = asyncio.Queue()
    for i in range(rollouts):
        queue.put_nowait(f"bench-{i}")
    latencies: list[float] = []
    by_turn: dict[int, list[float]] = {}

    async def worker() -> None:
        while not queue.empty():
            rid = queue.get_nowait()
            for d in deltas:
                t0 = time.perf_counter()
                await store.append_turn(rid, d, expected_turn=d.turn - 1)
                latencies.append(time.perf_counter() - t0)
                by_turn.setdefault(d.turn, []).append(latencies[-1])

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.perf_counter() - t0
    lat = np.asarray(latencies) * 1000
    tenth = max(1, len(deltas) // 10)
    first = [x for t in sorted(by_turn)[:tenth] for x in by_turn[t]]
    last = [x for t in sorted(by_turn)[-tenth:] for x in by_turn[t]]
    return {"ops": len(latencies), "ops_s": len(latencies) / wall, "p50": float(np.percentile(lat, 50)),
            "p99": float(np.percentile(lat, 99)), "wall": wall,
            "p50_first": 1000 * statistics.median(first), "p50_last": 1000 * statistics.median(last)}


async def time_load(store, rid: str, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        state = await store.load(rid)
        times.append(time.perf_counter() - t0)
    assert state is not None
    return statistics.median(times) * 1000


def machine() -> str:
    cpu = "unknown CPU"
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import os

    return f"{os.cpu_count()} cores ({cpu}), Python {platform.python_version()}, {platform.system()} {platform.release()}"


async def main_async(args: argparse.Namespace, url: str) -> None:
    gen = args.tokens * 9 // 10
    deltas, expected = synthetic_rollout(random.Random(0), [args.turns], prompt_tokens=args.tokens - gen, gen_tokens=gen)
    info = await aioredis.Redis.from_url(url).info("server")
    tag = uuid.uuid4().hex[:6]
    stores = [
        RedisRolloutStore.from_url(url, ttl_seconds=3600, key_prefix=f"bench{tag}", max_connections=64),
        RewritePackedStore(aioredis.Redis.from_url(url, max_connections=64), f"bpk{tag}"),
        RewriteJsonStore(aioredis.Redis.from_url(url, max_connections=64), f"bjs{tag}"),
    ]
    names = ["append-only (RedisRolloutStore)", RewritePackedStore.name, RewriteJsonStore.name]
    rows = []
    for name, store in zip(names, stores):
        print(f"running {name} ...", file=sys.stderr, flush=True)
        r = await run_appends(store, deltas, args.rollouts, args.concurrency)
        r["load_ms"] = await time_load(store, "bench-0", args.load_repeats)
        loaded = await store.load("bench-0")
        assert loaded.segments[0].token_ids == expected.segments[0].token_ids
        rows.append((name, r))
        await store.close()
    cleanup = aioredis.Redis.from_url(url)
    for prefix in (f"bench{tag}", f"bpk{tag}", f"bjs{tag}"):
        async for k in cleanup.scan_iter(match=f"{prefix}:*", count=1000):
            await cleanup.delete(k)
    await cleanup.aclose()

    total = args.turns * args.tokens
    print(f"\n{args.rollouts} rollouts x {args.turns} turns of {args.tokens} tokens, {args.concurrency} concurrent; "
          f"Redis {info['redis_version']} (AOF {'everysec' if args.embedded else 'as configured'}); {machine()}\n")
    tenth = max(1, args.turns // 10)
    print(f"| store | appends | ops/s | p50 ms | p99 ms | p50 ms, first / last {tenth} turns "
          f"| load {total // 1000}k-token history (p50 ms) |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, r in rows:
        print(f"| {name} | {r['ops']} | {r['ops_s']:,.0f} | {r['p50']:.2f} | {r['p99']:.2f} "
              f"| {r['p50_first']:.2f} / {r['p50_last']:.2f} | {r['load_ms']:.2f} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", help="existing Redis; default: start an embedded redis-server in a temp dir")
    p.add_argument("--rollouts", type=int, default=64)
    p.add_argument("--turns", type=int, default=60)
    p.add_argument("--tokens", type=int, default=1000, help="tokens appended per turn (10%% prompt tail, 90%% generated)")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--load-repeats", type=int, default=50)
    args = p.parse_args()
    args.embedded = args.url is None
    if args.url:
        asyncio.run(main_async(args, args.url))
        return
    with tempfile.TemporaryDirectory(prefix="bench-redis-") as d, EmbeddedRedis(d) as server:
        asyncio.run(main_async(args, server.url))


if __name__ == "__main__":
    main()
