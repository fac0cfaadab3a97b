"""What vLLM's detokenizer costs the engine's front end, which the data plane never reads.

    .venv/bin/python scripts/bench_detokenize.py [--concurrency 1,8,32] [--tokens 16] [--calls 64] [--rounds 4]

The engine replica asks vLLM for text only when a call has stop strings (``SamplingOptions.to_vllm``:
``detokenize=bool(stop)``); the service parses the generated ids itself. This runs one
``EngineReplica`` in this process with vLLM's engine core in a child process (so this process's CPU
is the engine actor's share: ``AsyncLLM``'s front end, output processing, detokenizer, logprob token
strings) and alternates blocks of non-streaming generations (``generate_all``, as the data plane
calls it: ``max_tokens`` tokens, ``ignore_eos``, the sampled token's logprob) with vLLM's text on
(``detokenize=True``, as before) and off (as now). Per block: front-end CPU ms per call and wall
ms per call; the table gives medians over the rounds. Ids and logprobs are checked equal between
the two (same seeds).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import time

from rollout_service.ops.runtime import apply_local_env

apply_local_env()
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"  # the engine core in a child: this process = the front end
TEXT_ON = [False]  # the variant the current block runs (blocks run one at a time)


async def block(replica, n_calls: int, concurrency: int, tokens: int, detokenize: bool, seed0: int):
    from rollout_service.engine.types import GenerateRequest
    from rollout_service.engine.sampling import SamplingOptions

    TEXT_ON[0] = detokenize
    sem = asyncio.Semaphore(concurrency)
    results = {}

    async def one(i: int):
        opts = SamplingOptions.validated(seed=seed0 + i, ignore_eos=True)
        req = GenerateRequest(prompt_ids=[151644, 872, 198, 1000 + i, 2000 + i, 151645, 198, 151644, 77091, 198],
                              sampling=opts, max_tokens=tokens)
        async with sem:
            chunk = await replica.generate_all(req)
        results[i] = (chunk.token_ids, chunk.logprobs)

    t0, c0 = time.perf_counter(), time.process_time()
    await asyncio.gather(*(one(i) for i in range(n_calls)))
    return (time.process_time() - c0) / n_calls * 1e3, (time.perf_counter() - t0) / n_calls * 1e3, results


async def main(args) -> None:
    from rollout_service.config import EngineConfig
    from rollout_service.engine import sampling
    from rollout_service.engine.replica import EngineReplica
    from rollout_service.models.tiny_model import ensure_tiny_model

    to_vllm = sampling.SamplingOptions.to_vllm

    def patched(self, **kw):
        params = to_vllm(self, **kw)
        if TEXT_ON[0]:
            params.detokenize = True  # what every call asked for before
        return params

    sampling.SamplingOptions.to_vllm = patched
    replica = EngineReplica(EngineConfig(model=str(ensure_tiny_model()), cpu_kvcache_space_gib=args.kv_gib))
    try:
        print(f"engine started in {await replica.start():.1f}s")
        rows = await measure(replica, args)
    finally:
        replica.shutdown()  # vLLM's engine-core child process goes with it
    print(f"\nmachine: {os.cpu_count()} cpus, Python {platform.python_version()}; {args.calls} calls x "
          f"{args.tokens} tokens per block, {args.rounds} rounds, alternating; medians")
    print("\n| C | front-end CPU ms/call, text on | text off | saved | wall ms/call, on | off |")
    print("|---:|---:|---:|---:|---:|---:|")
    for c, on_cpu, off_cpu, on_wall, off_wall in rows:
        print(f"| {c} | {on_cpu:.2f} | {off_cpu:.2f} | {on_cpu - off_cpu:+.2f} ({(on_cpu - off_cpu) / on_cpu:.0%}) | "
              f"{on_wall:.1f} | {off_wall:.1f} |")


async def measure(replica, args) -> list[tuple]:
    levels = [int(c) for c in args.concurrency.split(",") if c]
    rows = []
    for c in levels:
        await block(replica, c, c, args.tokens, False, 0)  # warm-up
        per = {True: [], False: []}
        for r in range(args.rounds):
            for detok in ((True, False) if r % 2 == 0 else (False, True)):
                cpu, wall, res = await block(replica, args.calls, c, args.tokens, detok, 10_000 * r)
                per[detok].append((cpu, wall, res))
        for r in range(args.rounds):  # same seeds within a round: identical generations
            a, b = per[True][r][2], per[False][r][2]
            assert a == b, f"detokenize changed the ids or logprobs at C={c}, round {r}"
        on_cpu = statistics.median(x[0] for x in per[True])
        off_cpu = statistics.median(x[0] for x in per[False])
        rows.append((c, on_cpu, off_cpu, statistics.median(x[1] for x in per[True]),
                     statistics.median(x[1] for x in per[False])))
    return rows


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--concurrency", default="1,8,32")
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--calls", type=int, default=64)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--kv-gib", type=float, default=0.25)
    args = p.parse_args()
    asyncio.run(main(args))
