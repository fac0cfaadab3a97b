"""Engine replica: start-up time and generated tokens/s of the tiny model, through the Ray actor.

    .venv/bin/python scripts/bench_engine.py [--tokens 256] [--concurrency 1,8,32]

Prints a markdown table: per concurrency, total generated tokens, wall seconds, tokens/s, and the
per-request time to first token (p50). Start-up is measured from actor creation to a finished
``start()`` (engine built and warmed up).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import sys
import time

from rollout_service.runtime import apply_local_env

apply_local_env()


async def run_level(actor, n: int, tokens: int) -> dict:
    from rollout_service.engine.replica import GenerateRequest
    from rollout_service.engine.sampling import SamplingOptions

    async def one(i: int):
        req = GenerateRequest(prompt_ids=[151644, 872, 198, 1000 + i, 2000 + i, 151645, 198, 151644, 77091, 198],
                              sampling=SamplingOptions.validated(seed=i, ignore_eos=True), max_tokens=tokens)
        t0 = time.perf_counter()
        first = None
        count = 0
        async for ref in actor.generate.options(num_returns="streaming").remote(req):
            chunk = await ref
            if first is None and chunk.token_ids:
                first = time.perf_counter() - t0
            count += len(chunk.token_ids)
        return count, first

    t0 = time.perf_counter()
    results = await asyncio.gather(*[one(i) for i in range(n)])
    wall = time.perf_counter() - t0
    total = sum(c for c, _ in results)
    return {"n": n, "tokens": total, "wall": wall, "tps": total / wall,
            "ttft_p50": statistics.median(f for _, f in results)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--concurrency", default="1,8,32")
    args = ap.parse_args(argv)

    import ray

    from rollout_service.config import EngineConfig
    from rollout_service.engine.replica import create_engine_actor
    from rollout_service.runtime import start_local_ray
    from rollout_service.tiny_model import ensure_tiny_model

    model = ensure_tiny_model()
    start_local_ray()
    t0 = time.perf_counter()
    actor = create_engine_actor(EngineConfig(model=str(model)), 0)
    inside = ray.get(actor.start.remote(), timeout=600)
    startup = time.perf_counter() - t0
    try:
        levels = [asyncio.run(run_level(actor, int(n), args.tokens)) for n in args.concurrency.split(",")]
    finally:
        ray.get(actor.shutdown.remote(), timeout=60)
        ray.kill(actor)
        ray.shutdown()
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, python {sys.version.split()[0]}; "
          f"load average {os.getloadavg()[0]:.2f}")
    print(f"engine start-up: {startup:.1f} s from actor creation ({inside:.1f} s inside the actor: AsyncLLM + warm-up)")
    print(f"\n| concurrent requests | generated tokens | wall s | tokens/s | time to first token p50 s |")
    print("|---:|---:|---:|---:|---:|")
    for r in levels:
        print(f"| {r['n']} | {r['tokens']} | {r['wall']:.2f} | {r['tps']:.0f} | {r['ttft_p50']:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
