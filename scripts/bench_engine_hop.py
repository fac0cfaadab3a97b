"""What the hop from a data-plane process to an engine actor costs in CPU: a Ray actor call per
generation (``engine.data_channel: ray``) against the engine's data channel (``tcp``).

    .venv/bin/python scripts/bench_engine_hop.py [--concurrency 1,8,32] [--calls 400] [--rounds 3]

No model: the actor's "generation" sleeps 30 ms and returns a 16-token GenerationChunk with
logprobs, so what is measured is the hop alone, both sides, through the real code paths
(``FleetClient.generate`` over a Ray actor call, and over ``engine.channel``'s ``ChannelServer`` /
``EngineChannel``). Per block: this process's CPU (the caller) and the actor process's CPU, per
call; blocks alternate between the two paths; the table gives medians over the rounds.
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

GEN_S = 0.03
TOKENS = 16


def _actor_class():
    import ray

    @ray.remote
    class FakeEngine:
        """An engine actor's data-plane surface without an engine: generate / generate_all."""

        def __init__(self):
            self._channel = None

        async def _one(self, request):
            from rollout_service.engine.types import GenerationChunk

            await asyncio.sleep(GEN_S)
            return GenerationChunk(token_ids=list(range(1000, 1000 + TOKENS)), logprobs=[-0.5] * TOKENS,
                                   finish_reason="length", weight_version="0", weight_versions=[("0", 0, TOKENS)],
                                   num_prompt_tokens=len(request.prompt_ids))

        async def generate_all(self, request):
            return await self._one(request)

        async def generate(self, request):
            yield await self._one(request)

        async def open_channel(self):
            from rollout_service.engine.channel import ChannelServer

            self._channel = ChannelServer(self.generate, self.generate_all)
            return await self._channel.start("127.0.0.1")

        def cpu(self) -> float:
            return time.process_time()

    return FakeEngine


async def block(client, member, actor, n: int, concurrency: int, stream: bool) -> tuple[float, float]:
    from rollout_service.engine.types import GenerateRequest
    from rollout_service.engine.sampling import SamplingOptions

    sem = asyncio.Semaphore(concurrency)
    prompt = list(range(200))

    async def one(i: int):
        req = GenerateRequest(prompt_ids=prompt, sampling=SamplingOptions.validated(seed=i), max_tokens=TOKENS)
        async with sem:
            chunks = [c async for c in client.generate(member, req, stream)]
        assert len(chunks[-1].token_ids) == TOKENS

    a0, c0 = await actor.cpu.remote(), time.process_time()
    await asyncio.gather(*(one(i) for i in range(n)))
    c1, a1 = time.process_time(), await actor.cpu.remote()
    return (c1 - c0) / n * 1e3, (a1 - a0) / n * 1e3


async def main(args) -> list[tuple]:
    from rollout_service.fleet.client import FleetClient
    from rollout_service.fleet.types import FleetView, Member

    actor = _actor_class().options(max_concurrency=10_000, enable_task_events=False).remote()
    address = await actor.open_channel.remote()
    paths = {"ray": Member(0, 0, actor, 0, None), "tcp": Member(0, 0, actor, 0, address)}
    client = FleetClient(None, FleetView(1, "0", tuple(paths.values())))
    rows = []
    try:
        for stream in (False, True):
            for c in [int(x) for x in args.concurrency.split(",") if x]:
                for name in paths:  # warm-up
                    await block(client, paths[name], actor, 2 * c, c, stream)
                per = {name: [] for name in paths}
                for r in range(args.rounds):
                    for name in (("ray", "tcp") if r % 2 == 0 else ("tcp", "ray")):
                        per[name].append(await block(client, paths[name], actor, args.calls, c, stream))
                med = {name: (statistics.median(x[0] for x in v), statistics.median(x[1] for x in v))
                       for name, v in per.items()}
                rows.append((stream, c, med))
                print(f"stream={stream} C={c}: {med}", flush=True)
    finally:
        client.close_channels()
    return rows


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--concurrency", default="1,8,32")
    p.add_argument("--calls", type=int, default=400)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    import ray

    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR")
    try:
        rows = asyncio.run(main(args))
    finally:
        ray.shutdown()
    print(f"\nmachine: {os.cpu_count()} cpus, Python {platform.python_version()}; {args.calls} calls per block, "
          f"{args.rounds} rounds, alternating; medians; a {GEN_S * 1e3:.0f} ms fake generation of {TOKENS} tokens")
    print("\n| call | C | caller CPU ms/call: Ray call | channel | actor CPU ms/call: Ray call | channel | saved, both sides |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for stream, c, med in rows:
        (rc, ra), (tc, ta) = med["ray"], med["tcp"]
        print(f"| {'streaming' if stream else 'whole'} | {c} | {rc:.3f} | {tc:.3f} | {ra:.3f} | {ta:.3f} | "
              f"{rc + ra - tc - ta:.3f} |")
