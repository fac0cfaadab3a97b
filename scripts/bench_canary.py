"""The parity canary's cost: engine throughput under the same load with the canary off, at a fraction,
and at 1.0 (every generation re-scored), in alternating blocks.

    .venv/bin/python scripts/bench_canary.py [--fractions 0,0.01,1.0] [--agents 16] [--rounds 2]
        [--prompt-tokens 512] [--tokens 64] [--repeats 5]

One real engine (the parity config, the tiny model on CPU) through its Ray actor; ``--agents``
concurrent agents each run ``--rounds`` generations per block (``--prompt-tokens`` of context,
``--tokens`` generated, ignore_eos), and every finished generation is offered to a real
:class:`~rollout_service.canary.canary.Canary` (its queue, worker, the engine's scoring path and the
recompute) at the block's fraction. A block ends when its generations are done *and* the canary has
finished re-scoring what it drew, so the re-scoring's engine time is in the block's wall time.
Blocks run fraction after fraction, ``--repeats`` times (load from elsewhere on the machine hits
every fraction alike). Prints a markdown table: per fraction, the median generated tokens/s, its
ratio to fraction 0, generations checked, the median re-scoring call, max |Δlogprob|.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import sys
import time

from rollout_service.ops.runtime import apply_local_env

apply_local_env()


class OneEngine:
    """The fleet view the canary reads (``members()``), over one engine actor; no fleet to report to."""

    fleet = None

    def __init__(self, actor):
        from rollout_service.fleet.types import Member

        self._members = (Member(slot=0, generation=0, handle=actor),)

    def members(self):
        return self._members


async def block(actor, canary, fraction: float, args, seed0: int) -> dict:
    from rollout_service.canary.canary import Generation
    from rollout_service.engine.sampling import SamplingOptions
    from rollout_service.engine.types import GenerateRequest

    canary.config.sample_fraction = fraction
    before = canary.figures()

    async def agent(i: int) -> int:
        n = 0
        for r in range(args.rounds):
            seed = seed0 + 1000 * i + r
            prompt = [(seed * 7919 + j * 104729) % 20000 + 1000 for j in range(args.prompt_tokens)]
            sampling = SamplingOptions.validated(seed=seed, ignore_eos=True)
            req = GenerateRequest(prompt_ids=prompt, sampling=sampling, max_tokens=args.tokens)
            ids, lps, last = [], [], None
            async for ref in actor.generate.options(num_returns="streaming").remote(req):
                last = await ref
                ids += last.token_ids
                lps += last.logprobs
            canary.offer(Generation(prompt_ids=prompt, token_ids=ids, logprobs=lps, sampling=sampling, slot=0,
                                    weight_versions=list(last.weight_versions or ())))
            n += len(ids)
        return n

    t0 = time.perf_counter()
    tokens = sum(await asyncio.gather(*[agent(i) for i in range(args.agents)]))
    while not canary.idle():
        await asyncio.sleep(0.005)
    wall = time.perf_counter() - t0
    after = canary.figures()
    checked = sum(e["stats"]["turns"] for e in after["entries"]) - sum(e["stats"]["turns"] for e in before["entries"])
    return {"fraction": fraction, "tokens": tokens, "wall": wall, "tps": tokens / wall, "checked": checked}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fractions", default="0,0.01,1.0")
    ap.add_argument("--agents", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2, help="generations per agent per block")
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)

    import ray

    from rollout_service.canary.canary import Canary
    from rollout_service.canary.stats import status_of
    from rollout_service.config import CanaryConfig, EngineConfig
    from rollout_service.engine.actor import create_engine_actor
    from rollout_service.ops.runtime import start_local_ray
    from rollout_service.models.tiny_model import ensure_tiny_model

    fractions = [float(f) for f in args.fractions.split(",")]
    model = ensure_tiny_model()
    start_local_ray()
    config = EngineConfig(model=str(model))
    actor = create_engine_actor(config, 0)
    ray.get(actor.start.remote(), timeout=600)
    rows: list[dict] = []
    calls: list[float] = []

    async def run() -> None:
        canary = Canary(CanaryConfig(sample_fraction=1.0, queue_size=4096, score_on="same"), OneEngine(actor), "bench",
                        max_top=config.max_logprobs)
        original = canary.check

        async def timed(gen, num_top):  # the re-scoring call's latency, as the canary's worker waits for it
            t0 = time.perf_counter()
            try:
                return await original(gen, num_top)
            finally:
                calls.append(time.perf_counter() - t0)

        canary.check = timed
        try:
            await block(actor, canary, 0.0, args, seed0=0)  # warm-up, not counted
            for rep in range(args.repeats):
                for f in fractions:
                    rows.append(await block(actor, canary, f, args, seed0=100_000 * (rep + 1)))
        finally:
            canary.close()
        rows.append({"status": status_of([canary.figures()], enabled=True, sample_fraction=1.0)})

    try:
        asyncio.run(run())
    finally:
        ray.get(actor.shutdown.remote(), timeout=60)
        ray.kill(actor)
        ray.shutdown()
    status = rows.pop()["status"]
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, python {sys.version.split()[0]}; load average "
          f"{os.getloadavg()[0]:.2f}; {args.agents} agents x {args.rounds} generations per block, "
          f"{args.prompt_tokens}-token context, {args.tokens} generated tokens, {args.repeats} blocks per fraction")
    base = statistics.median(r["tps"] for r in rows if r["fraction"] == fractions[0])
    print()
    print("| canary.sample_fraction | tokens/s (median) | ratio to first | min .. max tokens/s | generations checked |")
    print("|---|---|---|---|---|")
    for f in fractions:
        mine = [r for r in rows if r["fraction"] == f]
        tps = statistics.median(r["tps"] for r in mine)
        print(f"| {f:g} | {tps:.0f} | {tps / base:.3f} | {min(r['tps'] for r in mine):.0f} .. "
              f"{max(r['tps'] for r in mine):.0f} | {sum(r['checked'] for r in mine)} |")
    print()
    print(f"re-scoring (the canary worker's wait per drawn generation, median of {len(calls)}): "
          f"{statistics.median(calls) * 1000:.0f} ms; all checked: {status['checked']}, max |dlogprob| "
          f"{status['max_abs_diff']}, skipped {status['skipped']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
