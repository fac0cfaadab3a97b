"""Engine replica: start-up time, generated tokens/s and the cost of streaming, through the Ray actor.

    .venv/bin/python scripts/bench_engine.py [--tokens 256] [--concurrency 1,8,32]
    .venv/bin/python scripts/bench_engine.py --concurrency "" --windows 0,0.01,0.02,0.05,0.1 --calls 12

Prints markdown tables. Throughput: per batch window (``--throughput-windows``) and concurrency,
total generated tokens, wall seconds, tokens/s, chunks (Ray objects) per request, the consumer's
CPU seconds (this driver process) and the per-request time to first token (p50).

Stream cost (``--windows``): sequential ``--tokens``-token generations, one per variant in turn (so
load from elsewhere on the machine hits every variant alike): streamed with ``stream_batch_window_s``
= each given window (``default``: the engine config's; an older engine without the parameter is
called without it), with Ray task events off (the engine actor's setting) or on (``+events``), and
``generate_all`` (one round trip). Per call (medians): chunks, wall ms, first chunk ms, the
consumer's CPU ms (this driver process, Ray's threads included: receiving and deserializing the
chunks), the engine actor's CPU ms (its own process: AsyncLLM's front end and Ray's side of the
stream) and its EngineCore child's (the model itself). Every variant's ids and logprobs are checked
equal to ``generate_all``'s.

Task events (``--trivial-calls N``): N sequential calls of a trivial actor method with Ray task
events off and N with them on, in alternating blocks; wall, consumer CPU and engine actor CPU per call.

Start-up is measured from actor creation to a finished ``start()`` (engine built and warmed up).
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


async def run_level(actor, n: int, tokens: int, window: float | None = None) -> dict:
    from rollout_service.engine.types import GenerateRequest
    from rollout_service.engine.sampling import SamplingOptions

    async def one(i: int):
        req = GenerateRequest(prompt_ids=[151644, 872, 198, 1000 + i, 2000 + i, 151645, 198, 151644, 77091, 198],
                              sampling=SamplingOptions.validated(seed=i, ignore_eos=True), max_tokens=tokens)
        t0 = time.perf_counter()
        first = None
        count = chunks = 0
        gen = actor.generate.options(num_returns="streaming")
        async for ref in (gen.remote(req) if window is None else gen.remote(req, window)):
            chunk = await ref
            if first is None and chunk.token_ids:
                first = time.perf_counter() - t0
            count += len(chunk.token_ids)
            chunks += 1
        return count, first, chunks

    t0, cpu0 = time.perf_counter(), time.process_time()
    results = await asyncio.gather(*[one(i) for i in range(n)])
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    total = sum(c for c, _, _ in results)
    return {"n": n, "window": "default" if window is None else window, "tokens": total, "wall": wall,
            "tps": total / wall, "consumer_cpu": cpu,
            "ttft_p50": statistics.median(f for _, f, _ in results),
            "chunks": statistics.mean(k for _, _, k in results)}


def _process_cpu_s(pids: list[int]) -> float:
    import psutil

    total = 0.0
    for pid in pids:
        t = psutil.Process(pid).cpu_times()
        total += t.user + t.system
    return total


async def stream_cost(actor, windows: list[str], tokens: int, calls: int) -> list[dict]:
    """Per variant, the medians over ``calls`` sequential calls (variants interleaved call by call)."""
    from rollout_service.engine.types import GenerateRequest
    from rollout_service.engine.sampling import SamplingOptions

    info = await actor.process_info.remote()
    actor_pid, *core_pids = [pid for pid, _ in info["processes"]]  # the actor first, then vLLM's EngineCore
    variants: list[tuple[str, float | None, bool]] = [(f"stream, window {w}", None if w == "default" else float(w), False)
                                                      for w in windows]
    variants += [(f"stream, window {w} +events", None if w == "default" else float(w), True)
                 for w in dict.fromkeys([windows[0], windows[-1]])]
    variants += [("generate_all", None, False), ("generate_all +events", None, True)]
    rows: dict[str, dict[str, list[float]]] = {name: {} for name, _, _ in variants}
    got_of: dict[str, list[tuple[list[int], list[float]]]] = {name: [] for name, _, _ in variants}

    async def one(name: str, window: float | None, events: bool, i: int) -> dict[str, float]:
        req = GenerateRequest(prompt_ids=[151644, 872, 198, 3000 + i, 151645, 198, 151644, 77091, 198],
                              sampling=SamplingOptions.validated(seed=i, ignore_eos=True), max_tokens=tokens)
        ids: list[int] = []
        lps: list[float] = []
        chunks = 0
        first = None
        cpu0, act0, core0, t0 = time.process_time(), _process_cpu_s([actor_pid]), _process_cpu_s(core_pids), time.perf_counter()
        if name.startswith("generate_all"):
            whole = await actor.generate_all.options(**({"enable_task_events": True} if events else {})).remote(req)
            ids, lps = list(whole.token_ids), list(whole.logprobs)
            chunks = 1
        else:
            opts = {"num_returns": "streaming"} | ({"enable_task_events": True} if events else {})
            gen = actor.generate.options(**opts)
            async for ref in (gen.remote(req) if window is None else gen.remote(req, window)):
                chunk = await ref
                if first is None:
                    first = time.perf_counter() - t0
                ids += chunk.token_ids
                lps += chunk.logprobs
                chunks += 1
        wall = time.perf_counter() - t0
        cpu = time.process_time() - cpu0
        await asyncio.sleep(0.05)  # let the actor's trailing work for this call land in its CPU count
        act = _process_cpu_s([actor_pid]) - act0
        core = _process_cpu_s(core_pids) - core0
        assert len(ids) == tokens, (name, len(ids))
        got_of[name].append((ids, lps))
        return {"chunks": chunks, "wall_ms": wall * 1e3, "ttft_ms": (first or wall) * 1e3,
                "consumer_cpu_ms": cpu * 1e3, "actor_cpu_ms": act * 1e3, "core_cpu_ms": core * 1e3}

    for name, window, events in variants:  # warm every path once
        await one(name, window, events, 10_000)
    for got in got_of.values():
        got.clear()
    for i in range(calls):
        for name, window, events in variants:
            for k, v in (await one(name, window, events, i)).items():
                rows[name].setdefault(k, []).append(v)
    for name, got in got_of.items():
        assert got == got_of["generate_all"], f"{name}: ids or logprobs differ from generate_all's"
    return [{"variant": name, **{k: statistics.median(v) for k, v in rows[name].items()}} for name, _, _ in variants]


async def call_overhead(actor, calls: int, blocks: int = 8) -> list[dict]:
    """Cost of one trivial actor call (``weight_version``) with Ray task events off and on: sequential
    calls in alternating blocks; consumer (this process) and engine actor CPU per call."""
    info = await actor.process_info.remote()
    actor_pid = info["processes"][0][0]
    totals = {False: [0.0, 0.0, 0.0, 0], True: [0.0, 0.0, 0.0, 0]}  # wall, consumer cpu, actor cpu, n
    per_block = max(1, calls // blocks)
    for b in range(2 * blocks):
        events = bool(b % 2)
        method = actor.weight_version.options(enable_task_events=events)
        cpu0, act0, t0 = time.process_time(), _process_cpu_s([actor_pid]), time.perf_counter()
        for _ in range(per_block):
            await method.remote()
        t = totals[events]
        t[0] += time.perf_counter() - t0
        t[1] += time.process_time() - cpu0
        t[2] += _process_cpu_s([actor_pid]) - act0
        t[3] += per_block
    return [{"events": "on" if ev else "off", "n": t[3], "wall_us": t[0] / t[3] * 1e6,
             "consumer_cpu_us": t[1] / t[3] * 1e6, "actor_cpu_us": t[2] / t[3] * 1e6} for ev, t in totals.items()]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--concurrency", default="1,8,32", help="throughput levels; empty: skip the throughput table")
    ap.add_argument("--throughput-windows", default="default",
                    help="throughput table: stream_batch_window_s per row set (comma-separated; 'default': the config's)")
    ap.add_argument("--windows", default="", help="stream cost table: comma-separated batch windows (s) or 'default'")
    ap.add_argument("--calls", type=int, default=20, help="calls per variant in the stream cost table")
    ap.add_argument("--trivial-calls", type=int, default=0,
                    help="per-call cost of Ray task events: this many trivial actor calls with events off, as many on")
    args = ap.parse_args(argv)

    import ray

    from rollout_service.config import EngineConfig
    from rollout_service.engine.actor import create_engine_actor
    from rollout_service.ops.runtime import start_local_ray
    from rollout_service.models.tiny_model import ensure_tiny_model

    model = ensure_tiny_model()
    start_local_ray()
    t0 = time.perf_counter()
    actor = create_engine_actor(EngineConfig(model=str(model)), 0)
    inside = ray.get(actor.start.remote(), timeout=600)
    startup = time.perf_counter() - t0
    try:
        levels = [asyncio.run(run_level(actor, int(n), args.tokens, None if w == "default" else float(w)))
                  for w in args.throughput_windows.split(",") for n in args.concurrency.split(",") if n]
        windows = [w for w in args.windows.split(",") if w]
        cost = asyncio.run(stream_cost(actor, windows, args.tokens, args.calls)) if windows else []
        overhead = asyncio.run(call_overhead(actor, args.trivial_calls)) if args.trivial_calls else []
    finally:
        ray.get(actor.shutdown.remote(), timeout=60)
        ray.kill(actor)
        ray.shutdown()
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, python {sys.version.split()[0]}; "
          f"load average {os.getloadavg()[0]:.2f}")
    print(f"engine start-up: {startup:.1f} s from actor creation ({inside:.1f} s inside the actor: AsyncLLM + warm-up)")
    if levels:
        print("\n| window s | concurrent requests | generated tokens | wall s | tokens/s | chunks per request | "
              "consumer CPU s | time to first token p50 s |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|")
        for r in levels:
            print(f"| {r['window']} | {r['n']} | {r['tokens']} | {r['wall']:.2f} | {r['tps']:.0f} | {r['chunks']:.0f} | "
                  f"{r['consumer_cpu']:.2f} | {r['ttft_p50']:.3f} |")
    if cost:
        print(f"\n{args.tokens}-token streamed generations, {args.calls} calls per variant, medians per call; "
              "ids and logprobs identical to generate_all's in every call")
        print("\n| variant | chunks | wall ms | first chunk ms | consumer CPU ms | engine actor CPU ms | EngineCore CPU ms |")
        print("|---|---:|---:|---:|---:|---:|---:|")
        for r in cost:
            print(f"| {r['variant']} | {r['chunks']:.0f} | {r['wall_ms']:.0f} | {r['ttft_ms']:.1f} | "
                  f"{r['consumer_cpu_ms']:.1f} | {r['actor_cpu_ms']:.1f} | {r['core_cpu_ms']:.0f} |")
    if overhead:
        print("\nTrivial actor call (weight_version), sequential, per call:")
        print("\n| Ray task events | calls | wall µs | consumer CPU µs | engine actor CPU µs |")
        print("|---|---:|---:|---:|---:|")
        for r in overhead:
            print(f"| {r['events']} | {r['n']} | {r['wall_us']:.0f} | {r['consumer_cpu_us']:.0f} | {r['actor_cpu_us']:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
