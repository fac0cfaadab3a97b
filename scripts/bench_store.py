#!/usr/bin/env python
"""Benchmark the append-only Redis rollout store against stores that rewrite the history per turn,
and the per-turn store cost of a long rollout with and without the replica-local cache.

``appends``: every store does the same conditional (turn-counter-checked) write in one Lua call; they
differ only in what they write. The naive stores are given the rollout state in memory (as an
affinity replica has it after its load), so they pay only for serialising and sending the whole
history each turn.

``cache``: what the data plane pays the store per call (load before it, append after it) along one
rollout of 120 calls growing to ~3,200 tokens (the shape of issue 11's measurement), for
``RedisRolloutStore`` alone (every load transfers and decodes the whole history) and behind
``CachedRolloutStore`` (a load is one O(1) check of the turn counter).

``index``: what the recent-rollouts index (store/recent.py) costs a turn's acknowledgement, on one
Redis and on a local Redis Cluster (3 primaries, a replica each), the modes alternated round by round:
the index write awaited before the append answers (the code before 2026-11-28), written in the
background to one set (the code until 2026-11-29, still the default on one Redis), in the
background to the Cluster's hash-tagged shards (the Cluster default since), and no index. On the
Cluster it also counts each primary's ZADD calls (INFO commandstats): where the index's writes land.

    .venv/bin/python scripts/bench_store.py                 # starts its own redis-server (AOF everysec)
    .venv/bin/python scripts/bench_store.py --section cache
    .venv/bin/python scripts/bench_store.py --section index --index-rounds 3
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
from pathlib import Path
import uuid

import numpy as np
import redis.asyncio as aioredis

from rollout_service.onpolicy.types import RolloutState, Segment, TurnDelta, TurnRecord
from rollout_service.store import EmbeddedRedis, RedisRolloutStore, StoreUnavailable, TurnConflict
from rollout_service.store.cache import CachedRolloutStore
from rollout_service.store.cluster_group import LocalRedisCluster
from rollout_service.store.recent import CLUSTER_SHARDS
from rollout_service.store.codec import IDS_DTYPE, LOGPROBS_DTYPE, MASK_DTYPE
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the suite's synthetic rollouts
from synthetic_rollouts import synthetic_delta, synthetic_rollout  # noqa: E402

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


def long_rollout_deltas(rng: random.Random, turns: int, first_prompt: int, tail: int, gen: int) -> list[TurnDelta]:
    """One segment: a ``first_prompt``-token first call, then ``tail`` + ``gen`` tokens per call; each
    record carries the answer the data plane stores for replay (so loads pay for it too)."""
    deltas, seg_len = [], 0
    for turn in range(1, turns + 1):
        d = synthetic_delta(rng, turn=turn, segment_index=0, new_segment=turn == 1, segment_len=seg_len,
                            prompt_tokens=first_prompt if turn == 1 else tail, gen_tokens=gen)
        d.record.answer = {"message": {"role": "assistant", "content": f"answer {turn} " * 6, "reasoning_content": None,
                                       "tool_calls": [{"id": f"chatcmpl-tool-{turn:016x}", "type": "function",
                                                       "function": {"name": "search", "arguments": '{"q": "x"}'}}]},
                           "stop_reason": None}
        d.record.request_digest = f"{turn:064x}"
        seg_len += len(d.token_ids)
        deltas.append(d)
    return deltas


async def per_turn_costs(store, deltas: list[TurnDelta], rid: str) -> dict[int, tuple[float, float]]:
    """(load ms, append ms) per turn, as the data plane pays them: load the state, then append."""
    costs = {}
    for d in deltas:
        t0 = time.perf_counter()
        state = await store.load(rid)
        t1 = time.perf_counter()
        assert (state.turn if state else 0) == d.turn - 1
        await store.append_turn(rid, d, expected_turn=d.turn - 1)
        costs[d.turn] = ((t1 - t0) * 1000, (time.perf_counter() - t1) * 1000)
    return costs


async def cache_section(args: argparse.Namespace, url: str) -> None:
    deltas = long_rollout_deltas(random.Random(0), args.cache_turns, args.first_prompt, args.tail, args.gen)
    tokens = sum(len(d.token_ids) for d in deltas)
    tag = uuid.uuid4().hex[:6]
    plain = RedisRolloutStore.from_url(url, ttl_seconds=3600, key_prefix=f"bp{tag}")
    cached = CachedRolloutStore(RedisRolloutStore.from_url(url, ttl_seconds=3600, key_prefix=f"bc{tag}"))
    info = await plain.client.info("server")
    marks = sorted({2, args.cache_turns // 4, args.cache_turns // 2, args.cache_turns})

    # Per-turn cost along whole rollouts (median over rollouts), plain and cached interleaved.
    cycles: dict[str, dict[int, list[tuple[float, float]]]] = {"plain": {}, "cached": {}}
    for i in range(args.cache_rollouts):
        for name, store in (("plain", plain), ("cached", cached)):
            for turn, c in (await per_turn_costs(store, deltas, f"roll-{i}")).items():
                cycles[name].setdefault(turn, []).append(c)

    # Load alone at a given turn, many repeats: replay the rollout up to that turn, then time loads.
    async def load_ms(store, rid: str, repeats: int) -> float:
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            await store.load(rid)
            times.append(time.perf_counter() - t0)
        return statistics.median(times) * 1000

    async def out_bytes() -> int:
        return (await plain.client.info("stats"))["total_net_output_bytes"]

    async def bytes_per_load(store, rid: str, n: int = 20) -> float:
        """Bytes Redis sends per load (server-side counter; the embedded server has no other client)."""
        b0 = await out_bytes()
        b1 = await out_bytes()  # the cost of one INFO reply, to subtract
        for _ in range(n):
            await store.load(rid)
        b2 = await out_bytes()
        return (b2 - b1 - (b1 - b0)) / n

    loads = {}
    for mark in marks:
        rid = f"load-{mark}"
        for store in (plain, cached):
            for d in deltas[:mark]:
                await store.append_turn(rid, d, expected_turn=d.turn - 1)
        await cached.load(rid)  # cached from here on (the cache keeps what it loads)
        loads[mark] = {
            "tokens": sum(len(d.token_ids) for d in deltas[:mark]),
            "plain": await load_ms(plain, rid, args.load_repeats),
            "cached": await load_ms(cached, rid, args.load_repeats),
            "plain_bytes": await bytes_per_load(plain, rid),
            "cached_bytes": await bytes_per_load(cached, rid),
        }
    stats = cached.stats()
    for prefix in (f"bp{tag}", f"bc{tag}"):
        async for k in plain.client.scan_iter(match=f"{prefix}:*", count=1000):
            await plain.client.delete(k)
    await plain.close()
    await cached.close()

    print(f"\nOne rollout of {args.cache_turns} calls growing to {tokens:,} tokens ({args.first_prompt}-token first "
          f"prompt, then {args.tail} + {args.gen} tokens per call, each record with its stored answer); "
          f"Redis {info['redis_version']}; {machine()}\n")
    print(f"Load alone (p50 of {args.load_repeats}):\n")
    print("| at turn | history tokens | RedisRolloutStore.load ms | bytes sent | CachedRolloutStore.load ms (hit) "
          "| bytes sent | speed-up |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for mark in marks:
        r = loads[mark]
        print(f"| {mark} | {r['tokens']:,} | {r['plain']:.3f} | {r['plain_bytes']:,.0f} | {r['cached']:.3f} "
              f"| {r['cached_bytes']:,.0f} | {r['plain'] / r['cached']:.1f}x |")
    print(f"\nPer call as the data plane pays it (load + append; p50 over {args.cache_rollouts} rollouts; "
          "the cached run's first load of a rollout is a miss):\n")
    print("| turn | plain load ms | plain append ms | plain total ms | cached load ms | cached append ms | cached total ms |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for mark in marks:
        row = []
        for name in ("plain", "cached"):
            samples = cycles[name][mark]
            ld = statistics.median(s[0] for s in samples)
            ap = statistics.median(s[1] for s in samples)
            tot = statistics.median(s[0] + s[1] for s in samples)
            row += [ld, ap, tot]
        print(f"| {mark} | " + " | ".join(f"{x:.3f}" for x in row) + " |")
    print(f"\ncache counters: {stats}")


class _AwaitedIndex:
    """The append as it was before 2026-11-28: the turn answers only once its index write is done."""

    def __init__(self, store: RedisRolloutStore):
        self.store = store

    async def append_turn(self, rid, delta, expected_turn):
        await self.store.append_turn(rid, delta, expected_turn=expected_turn)
        await self.store.recent.settled()

    async def close(self):
        await self.store.close()


INDEX_MODES = (("awaited, one set", 1, True), ("background, one set", 1, False),
               (f"background, {CLUSTER_SHARDS} shards", CLUSTER_SHARDS, False), ("no index", 0, False))


async def zadd_calls(ports: list[int]) -> dict[int, int]:
    out = {}
    for port in ports:
        c = aioredis.Redis(host="127.0.0.1", port=port)
        stats = await c.info("commandstats")
        out[port] = int(stats.get("cmdstat_zadd", {}).get("calls", 0))
        await c.aclose()
    return out


async def appends_retried(writer, store: RedisRolloutStore, deltas: list[TurnDelta], rollouts: int,
                          concurrency: int) -> dict:
    """As ``run_appends``, with a 503's retry as an agent does it (the turn read back: landed or not);
    ``unavailable`` counts them. A turn's latency is its successful append's."""
    queue: asyncio.Queue[str] = asyncio.Queue()
    for i in range(rollouts):
        queue.put_nowait(f"bench-{i}")
    latencies: list[float] = []
    unavailable = 0

    async def worker() -> None:
        nonlocal unavailable
        while not queue.empty():
            rid = queue.get_nowait()
            for d in deltas:
                while True:
                    t0 = time.perf_counter()
                    try:
                        await writer.append_turn(rid, d, expected_turn=d.turn - 1)
                        latencies.append(time.perf_counter() - t0)
                        break
                    except StoreUnavailable:
                        unavailable += 1
                        await asyncio.sleep(0.05)
                        state = await store.load(rid)
                        if state is not None and state.turn >= d.turn:
                            break  # it had landed

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.perf_counter() - t0
    lat = np.asarray(latencies) * 1000
    return {"ops": len(latencies), "ops_s": len(latencies) / wall, "p50": float(np.percentile(lat, 50)),
            "p99": float(np.percentile(lat, 99)), "unavailable": unavailable}


async def index_section(args: argparse.Namespace, targets: dict[str, tuple[str, list[int]]]) -> None:
    """Per-turn append latency and where the index's writes land, each mode alternated per round."""
    gen = args.tokens * 9 // 10
    deltas, _ = synthetic_rollout(random.Random(0), [args.turns], prompt_tokens=args.tokens - gen, gen_tokens=gen)
    results: dict[tuple[str, str], list[dict]] = {}
    for rnd in range(args.index_rounds):
        modes = INDEX_MODES if rnd % 2 == 0 else INDEX_MODES[::-1]
        for target, (url, primaries) in targets.items():
            for name, shards, awaited in modes:
                if shards == CLUSTER_SHARDS and not primaries:
                    continue  # the shards are the Cluster's layout
                print(f"round {rnd + 1}: {target}, {name} ...", file=sys.stderr, flush=True)
                store = RedisRolloutStore.from_url(url, ttl_seconds=600, key_prefix=f"ix{uuid.uuid4().hex[:6]}",
                                                   recent_size=10_000 if shards else 0, recent_shards=shards or None,
                                                   max_connections=64)
                before = await zadd_calls(primaries)
                r = await appends_retried(_AwaitedIndex(store) if awaited else store, store, deltas, args.rollouts,
                                          args.concurrency)
                await store.recent.settled()
                after = await zadd_calls(primaries)
                r["zadd"] = sorted(after[p] - before[p] for p in primaries)
                await store.close()
                results.setdefault((target, name), []).append(r)
    print(f"\nPer-turn append latency with the recent-rollouts index: {args.rollouts} rollouts x {args.turns} turns "
          f"of {args.tokens} tokens, {args.concurrency} concurrent, medians of {args.index_rounds} rounds (modes "
          f"alternated); {machine()}\n")
    print("| Redis | index | p50 ms | p99 ms | turns/s | 503s (retried) | index ZADDs per primary (last round) |")
    print("|---|---|---:|---:|---:|---:|---|")
    for (target, name), rs in results.items():
        med = {k: statistics.median(r[k] for r in rs) for k in ("p50", "p99", "ops_s")}
        spread = " / ".join(str(n) for n in rs[-1]["zadd"]) if rs[-1]["zadd"] else "—"
        print(f"| {target} | {name} | {med['p50']:.2f} | {med['p99']:.2f} | {med['ops_s']:,.0f} "
              f"| {sum(r['unavailable'] for r in rs)} | {spread} |")


async def main_async(args: argparse.Namespace, url: str) -> None:
    if args.section in ("cache", "all"):
        await cache_section(args, url)
    if args.section == "cache":
        return
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
    p.add_argument("--section", choices=["appends", "cache", "index", "all"], default="all",
                   help="all: appends and cache (index starts a Redis Cluster of its own: ask for it)")
    p.add_argument("--index-rounds", type=int, default=3, help="index section: rounds, the modes alternated")
    p.add_argument("--cache-turns", type=int, default=120)
    p.add_argument("--cache-rollouts", type=int, default=20)
    p.add_argument("--first-prompt", type=int, default=300, help="cache section: tokens of the first prompt")
    p.add_argument("--tail", type=int, default=8, help="cache section: prompt tail tokens per later call")
    p.add_argument("--gen", type=int, default=16, help="cache section: generated tokens per call")
    args = p.parse_args()
    args.embedded = args.url is None
    if args.section == "index":
        with tempfile.TemporaryDirectory(prefix="bench-redis-") as d, EmbeddedRedis(Path(d) / "one") as server, \
                LocalRedisCluster(Path(d) / "cluster", primaries=3, replicas=1) as cluster:
            targets = {"one server": (args.url or server.url, []), "Cluster, 3 primaries": (cluster.url, cluster.primaries())}
            asyncio.run(index_section(args, targets))
        return
    if args.url:
        asyncio.run(main_async(args, args.url))
        return
    with tempfile.TemporaryDirectory(prefix="bench-redis-") as d, EmbeddedRedis(d) as server:
        asyncio.run(main_async(args, server.url))


if __name__ == "__main__":
    main()
