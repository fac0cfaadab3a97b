"""A GRPO group's cost: one call with ``n = G`` under a rollout id against G separate calls of the same
prompt, with prefix caching off (the parity default) and on, and the separate calls spread or placed
together (``routing.group_placement``), round after round (each round runs the three ways in a fixed
order, ``n`` first).

    .venv/bin/python scripts/bench_groups.py [--group 8] [--engines 2] [--prompt-words 170]
        [--tokens 32] [--rounds 3] [--settings off,on] [--show-members]

Per prefix-caching setting, a real fleet of ``--engines`` engines (the tiny model on CPU), the real
data plane over it (TurnRunner, FleetClient, the routing policy that setting gets) and an embedded
redis-server. A round runs each way once, one group at a time, every group a fresh prompt of
``--prompt-words`` words (~4.9 tokens each: 170 words are ~830 tokens; nothing cached from an
earlier round), ``--tokens`` generated per
sample (ignore_eos). Prints a markdown table: per setting and way, the prompt tokens the engines
computed per group (prompt tokens less those taken from the prefix cache, summed over the members:
``message.rollout.cached_prompt_tokens``), as a multiple of one prompt, and the median wall time of a
group (all G members done).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import platform
import statistics
import sys
import tempfile
import time
import uuid

from rollout_service.ops.runtime import apply_local_env

apply_local_env()

WAYS = ("n", "separate", "separate_together")


def words(seed: int, n: int) -> str:
    return " ".join(f"w{(seed * 7919 + i * 104729) % 9973}" for i in range(n))


async def one_group(runner, way: str, g: int, args, seed: int) -> dict:
    from rollout_service.serve.fanout import group_turns
    from rollout_service.serve.turn_types import TurnRequest

    rid = f"bench-{way}-{uuid.uuid4().hex[:8]}"
    messages = [{"role": "user", "content": words(seed, args.prompt_words)}]
    base = TurnRequest(messages=messages, max_tokens=args.tokens, rollout_id=rid, sampling={"seed": seed, "ignore_eos": True})
    if way == "n":
        turns = group_turns(base, g)
    else:  # G calls of their own; together: named as one group (routing.group_placement together)
        turns = [dataclasses.replace(base, rollout_id=f"{rid}-{j}", sampling={"seed": seed + j, "ignore_eos": True},
                                     rollout_group=rid if way == "separate_together" else None) for j in range(g)]

    async def run(turn):
        result = None
        async for event in runner.run_turn(turn):
            result = event
        return result

    t0 = time.perf_counter()
    results = await asyncio.gather(*(run(t) for t in turns))
    wall = time.perf_counter() - t0
    prompt = len(results[0].prompt_token_ids)
    cached = [r.rollout.get("cached_prompt_tokens", 0) for r in results]
    slots = {r.engine_index for r in results}
    if args.show_members:
        print(f"  {way}: prompt {prompt}, cached per member {cached}, engines {sorted(slots)}, {wall:.2f} s", flush=True)
    return {"way": way, "wall": wall, "prompt": prompt, "computed": sum(prompt - c for c in cached), "engines": len(slots)}


async def bench_setting(caching: bool, args, redis_url: str, tokenizer) -> list[dict]:
    import ray

    from rollout_service.config import RolloutServiceConfig
    from rollout_service.fleet.client import connect
    from rollout_service.fleet.fleet import EngineFleet
    from rollout_service.fleet.routing import make_policy
    from rollout_service.models.tiny_model import ensure_tiny_model
    from rollout_service.serve.turns import TurnRunner
    from rollout_service.store.redis_store import RedisRolloutStore

    cfg = RolloutServiceConfig.model_validate({
        "engine": {"model": str(ensure_tiny_model()), "num_engines": args.engines, "num_cpus_per_engine": 0,
                   "enable_prefix_caching": caching},
        "store": {"redis_url": redis_url, "key_prefix": f"bench-groups-{int(caching)}"}})
    fleet = ray.remote(EngineFleet).options(num_cpus=0, max_concurrency=1000).remote(cfg.model_dump())
    rows: list[dict] = []
    try:
        ray.get(fleet.start.remote(), timeout=900)
        ways = {}
        for way in WAYS:
            c = cfg.model_copy(deep=True)
            c.routing.group_placement = "together" if way == "separate_together" else "spread"
            policy = make_policy(c.routing.policy, load_margin=c.routing.load_margin, prefix_caching=caching)
            client = await connect(fleet, policy=policy)
            ways[way] = (client, TurnRunner(c, client, RedisRolloutStore.from_config(c.store), tokenizer))
        await one_group(ways["n"][1], "n", args.group, args, seed=1)  # warm-up, not counted
        for r in range(args.rounds):
            for i, way in enumerate(WAYS):
                row = await one_group(ways[way][1], way, args.group, args, seed=1000 * (r + 1) + 100 * i)
                rows.append({**row, "caching": caching})
        for client, runner in ways.values():
            client.stop_watching()
            client.close_channels()
            await runner.store.close()
    finally:
        ray.get(fleet.shutdown.remote(), timeout=120)
        ray.kill(fleet)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--engines", type=int, default=2)
    ap.add_argument("--prompt-words", type=int, default=170, help="words per prompt (~4.9 tokens each)")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--settings", default="off,on", help="prefix caching settings to run, in order")
    ap.add_argument("--show-members", action="store_true", help="print each group's per-member cache hits")
    args = ap.parse_args(argv)

    import ray
    from transformers import AutoTokenizer

    from rollout_service.models.tiny_model import ensure_tiny_model
    from rollout_service.ops.runtime import start_local_ray
    from rollout_service.store.embedded import embedded_redis

    tokenizer = AutoTokenizer.from_pretrained(str(ensure_tiny_model()))
    start_local_ray()
    rows: list[dict] = []
    try:
        with tempfile.TemporaryDirectory() as tmp, embedded_redis(tmp) as redis:
            for setting in args.settings.split(","):
                rows += asyncio.run(bench_setting(setting == "on", args, redis.url, tokenizer))
    finally:
        ray.shutdown()
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, python {sys.version.split()[0]}; load average "
          f"{os.getloadavg()[0]:.2f}; {args.engines} engines, groups of {args.group}, {args.prompt_words}-word prompts "
          f"(~{args.prompt_words * 4.9:.0f} tokens), {args.tokens} tokens per sample, {args.rounds} rounds")
    print()
    print("| prefix caching | way | prompt tokens computed per group | x one prompt | engines used | wall per group (median) |")
    print("|---|---|---:|---:|---:|---:|")
    for caching in (False, True):
        for way in WAYS:
            mine = [r for r in rows if r["caching"] == caching and r["way"] == way]
            if not mine:
                continue
            computed = statistics.median(r["computed"] for r in mine)
            prompt = statistics.median(r["prompt"] for r in mine)
            print(f"| {'on' if caching else 'off'} | {way} | {computed:.0f} | {computed / prompt:.2f} | "
                  f"{max(r['engines'] for r in mine)} | {statistics.median(r['wall'] for r in mine):.2f} s |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
