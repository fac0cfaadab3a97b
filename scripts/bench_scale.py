"""The service around the engines at fleet scale, on simulated engines (``engine.backend: simulated``).

For each engine count: the whole service (``LocalService``: Ray Serve behind HAProxy, the affinity
replicas, an embedded redis-server, the fleet and the refit controller) over N simulated engines;
multi-turn rollouts with heavy-tailed lengths over HTTP from this process; then refits (the stall,
pause to resume, and its control part: the stall less the weights' transfer and load), the fleet's
probing CPU while idle, a heal of 1 and of 8 engines killed with SIGKILL. CPU per turn is read from
/proc for each of the service's processes.

    python scripts/bench_scale.py --engines 8 32 64 --rollouts 300 --turns 3
    python scripts/bench_scale.py --routing --engines 8    # the routing table, prefix caching on
    python scripts/bench_scale.py --routing --engines 8 --observation-words 50 --turns 6   # long histories

Runs only against 127.0.0.1, bounded in count and time; everything it starts is stopped, also on
Ctrl-C. On 2 cores the load generator (this process) shares the CPU with the service: turns/s is
a floor, the CPU per turn of each process is the figure to read.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TICK = os.sysconf("SC_CLK_TCK")
ROLES = {  # /proc/<pid>/cmdline fragment -> role
    "ray::ServeReplica": "replicas",
    "haproxy": "haproxy",
    "ray::ProxyActor": "proxy",
    "redis-server": "redis",
    "ray::EngineFleet": "fleet",
    "ray::RefitController": "controller",
    "ray::SimulatedEngine": "engines",
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def processes() -> dict[str, list[int]]:
    out: dict[str, list[int]] = {role: [] for role in set(ROLES.values())}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{name}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        for fragment, role in ROLES.items():
            if fragment in cmd:
                out[role].append(int(name))
                break
    return out


def cpu_s(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])
        except (OSError, IndexError):
            pass
    return total / TICK


def rss_mb(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def cpu_by_role() -> dict[str, float]:
    return {role: cpu_s(pids) for role, pids in processes().items()}


def lengths(rng: random.Random, cap: int) -> int:
    """Heavy-tailed generation lengths: Pareto (alpha 1.5) from 8 tokens, capped."""
    return min(cap, int(8 * rng.paretovariate(1.5)))


async def load(url: str, rollouts: int, turns: int, concurrency: int, cap: int, seed: int, shared_prefix: int,
               observation_words: int = 0):
    """Multi-turn rollouts; each rollout's first prompt starts with one of a few shared system
    prompts of ``shared_prefix`` words (GRPO-like groups sharing a prefix); each turn's observation
    (the tool output an agent appends) is ``observation {turn}`` plus ``observation_words`` words
    unique to the rollout and turn (~8 tokens each), so a rollout's history grows by them every turn
    and only the engine that served its last turn caches it."""
    rng = random.Random(seed)
    sem = asyncio.Semaphore(concurrency)
    latencies: list[float] = []
    failures: list = []
    moved = 0
    systems = [" ".join(f"rule{g}-{i}" for i in range(shared_prefix)) for g in range(8)]

    async def one(client, i):
        nonlocal moved
        async with sem:
            rid = f"bench-{seed}-{i}"
            messages = [{"role": "system", "content": systems[i % len(systems)]},
                        {"role": "user", "content": f"task {i}"}]
            for turn in range(turns):
                t0 = time.perf_counter()
                r = await client.post(f"{url}/v1/chat/completions", headers={"X-Rollout-Id": rid}, json={
                    "model": "tiny-qwen3", "messages": messages, "max_tokens": lengths(rng, cap), "seed": i})
                latencies.append(time.perf_counter() - t0)
                if r.status_code != 200:
                    failures.append((rid, turn, r.status_code, r.text[:200]))
                    return
                msg = r.json()["choices"][0]["message"]
                moved += int(bool(msg.get("rollout", {}).get("engine_moved")))
                observation = " ".join([f"observation {turn}"] + [f"r{i}t{turn}w{k}" for k in range(observation_words)])
                messages += [{"role": "assistant", "content": msg["content"] or ""},
                             {"role": "user", "content": observation}]

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=300, limits=limits) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*[one(client, i) for i in range(rollouts)])
        wall = time.perf_counter() - t0
    return wall, latencies, failures, moved


def redis_primaries(url: str) -> list:
    """A client per Redis primary the store writes to (one, or each primary of a cluster)."""
    import redis as redis_py

    from rollout_service.store.urls import parse_redis_url

    clean, cluster = parse_redis_url(url)
    u = httpx.URL(clean)
    if not cluster:
        return [redis_py.Redis(host=u.host, port=u.port)]
    seed = redis_py.Redis(host=u.host, port=u.port)
    ports = [int(line.split()[1].split(":")[1].split("@")[0])
             for line in seed.execute_command("CLUSTER", "NODES").decode().splitlines()
             if "master" in line.split()[2] and len(line.split()) > 8]
    return [redis_py.Redis(host=u.host, port=p) for p in sorted(ports)]


def redis_totals(nodes: list) -> tuple[int, int]:
    """(bytes used, commands processed) summed over the primaries."""
    return (sum(n.info("memory")["used_memory"] for n in nodes),
            sum(n.info("stats")["total_commands_processed"] for n in nodes))


def config(n: int, args, policy: str | None = None):
    from rollout_service.config import RolloutServiceConfig

    sim = {"decode_step_s": args.decode_step_s, "decode_step_s_per_seq": args.decode_step_s_per_seq,
           "prefill_s_per_token": args.prefill_s_per_token, "kv_capacity_tokens": args.kv_capacity_tokens}
    return RolloutServiceConfig.model_validate({
        "engine": {"backend": "simulated", "num_engines": n, "num_cpus_per_engine": 0, "max_num_seqs": args.max_num_seqs,
                   "enable_prefix_caching": True, "max_model_len": 4096, "sim": sim},
        "service": {"num_affinity_replicas": args.replicas, "default_max_tokens": 64},
        "fleet": {"probe_interval_s": 2.0},
        "routing": {"policy": policy or "sticky_least_loaded", "load_margin": args.load_margin},
        # an external store (--redis-cluster) is shared by every run: each run its own keys
        "store": {**({"redis_url": args.redis_url,
                      "key_prefix": f"bench-{n}-{policy or 'default'}-{getattr(args, 'round', 0)}"}
                     if args.redis_url else {}),
                  **({"max_connections": args.store_max_connections} if args.store_max_connections else {})},
    })


def engine_stats(fleet) -> list[dict]:
    import ray

    view = ray.get(fleet.view.remote(), timeout=120)
    return ray.get([m.handle.health.remote() for m in view.members], timeout=120)


def wait_healthy(fleet, n: int, timeout: float = 180, replaced: dict[int, int] | None = None) -> float:
    """Seconds until every slot is healthy (and each slot in ``replaced`` past that generation)."""
    import ray

    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout:
        slots = ray.get(fleet.stats.remote(), timeout=120)["slots"]
        if sum(s["state"] == "healthy" for s in slots) == n and all(
                slots[i]["generation"] > g for i, g in (replaced or {}).items()):
            return time.perf_counter() - t0
        time.sleep(0.05)
    raise TimeoutError(f"fleet not healthy after {timeout}s: "
                       f"{[(s['slot'], s['state'], s['generation'], s['last_error']) for s in slots]}")


def run_one(n: int, args, policy: str | None = None) -> dict:
    import ray

    from rollout_service.ops.launcher import LocalService
    from rollout_service.refit.client import TrainerClient
    from rollout_service.store.embedded import EmbeddedRedis  # noqa: F401 - the service starts it

    cfg = config(n, args, policy)
    svc = LocalService(cfg, port=args.port, log=lambda *_: None, proxy="haproxy")  # one port: Serve keeps its first
    row: dict = {"engines": n, "replicas": args.replicas, "policy": policy or "sticky_least_loaded",
                 "round": getattr(args, "round", 0),
                 "workload": {k: getattr(args, k) for k in (
                     "rollouts", "turns", "concurrency", "cap", "shared_prefix", "observation_words", "load_margin",
                     "max_num_seqs", "decode_step_s", "decode_step_s_per_seq", "prefill_s_per_token",
                     "kv_capacity_tokens")}}
    cleanup: list = []
    t0 = time.perf_counter()
    svc.start()
    try:
        row["start_s"] = time.perf_counter() - t0
        wait_healthy(svc.fleet, n)
        procs = processes()
        row["engine_rss_mb"] = statistics.mean(rss_mb(p) for p in procs["engines"]) if procs["engines"] else None
        nodes = redis_primaries(svc.config.store.redis_url)
        mem0, ops0 = redis_totals(nodes)

        # warm-up (the replicas' first calls), then the measured run
        asyncio.run(load(svc.url, 8, 1, 8, 16, seed=99, shared_prefix=args.shared_prefix))
        cpu0 = cpu_by_role()
        wall, lat, failures, moved = asyncio.run(load(svc.url, args.rollouts, args.turns, args.concurrency, args.cap,
                                                      seed=n, shared_prefix=args.shared_prefix,
                                                      observation_words=args.observation_words))
        cpu1 = cpu_by_role()
        turns = len(lat)
        row.update(turns=turns, failures=len(failures), turns_per_s=turns / wall, p50_ms=1e3 * statistics.median(lat),
                   p99_ms=1e3 * sorted(lat)[int(0.99 * (turns - 1))], pin_moves=moved)
        row["cpu_ms_per_turn"] = {role: 1e3 * (cpu1[role] - cpu0.get(role, 0.0)) / max(1, turns) for role in cpu1}
        mem1, ops1 = redis_totals(nodes)
        if len(nodes) > 1:
            row["redis_keys_per_primary"] = [n.dbsize() for n in nodes]
        row["redis_kb_per_1k_rollouts"] = (mem1 - mem0) / 1024 / (args.rollouts + 8) * 1000
        row["redis_ops_per_turn"] = (ops1 - ops0) / (turns + 8)
        stats = engine_stats(svc.fleet)
        prompt = sum(s["prompt_tokens"] for s in stats)
        row["prefix_hit"] = sum(s["cached_tokens"] for s in stats) / prompt if prompt else 0.0
        kv = [s["prompt_tokens"] + s["generated_tokens"] for s in stats]
        row["load_max_over_mean"] = max(kv) / statistics.mean(kv) if kv and statistics.mean(kv) else None
        if failures:
            row["first_failure"] = failures[0]
        if args.routing:
            return row

        # refits: the stall against N (path transport: the bytes are a digest on simulated engines)
        ckpt = Path(tempfile.mkdtemp(prefix="bench-scale-ckpt-"))
        shutil.copy(Path(cfg.engine.resolved_model()) / "model.safetensors", ckpt / "model.safetensors")
        trainer = TrainerClient(svc.controller, timeout_s=120)
        cleanup.append(lambda: shutil.rmtree(ckpt, ignore_errors=True))  # replacements load from it
        # alternated, same service: refit.control modes, and "staging:<mode>" for refit.staging ones
        modes = list(dict.fromkeys([cfg.refit.control, *args.compare_control,
                                    *[f"staging:{m}" for m in args.compare_staging]]))
        reports: dict[str, list] = {mode: [] for mode in modes}
        controller_cpu: dict[str, list] = {mode: [] for mode in modes}  # the controller's own CPU per refit
        for i in range(args.refits):
            for mode in modes:
                if len(modes) > 1:
                    field = {"staging": mode.split(":")[-1]} if mode.startswith("staging:") else {"control": mode}
                    ray.get(svc.controller.update_config.remote(
                        cfg.model_copy(update={"refit": cfg.refit.model_copy(update=field)}).model_dump()))
                c0 = cpu_by_role().get("controller", 0.0)
                reports[mode].append(trainer.refit(f"s{n}-{mode.replace(':', '-')}-{i}", str(ckpt), transport="path"))
                controller_cpu[mode].append(cpu_by_role().get("controller", 0.0) - c0)
        row["refit_controller_cpu_ms_by_control"] = {m: 1e3 * statistics.median(v) for m, v in controller_cpu.items()}
        row["refit_stall_ms"] = 1e3 * statistics.median(r["stall_s"] for r in reports[modes[0]])
        row["refit_control_ms"] = 1e3 * statistics.median(r["control_s"] for r in reports[modes[0]])
        row["refit_phases_ms"] = {k: 1e3 * statistics.median(r[k] for r in reports[modes[0]])
                                  for k in ("stage_s", "pause_s", "transfer_s", "load_s", "resume_s")}
        row["refit_stall_ms_by_control"] = {m: 1e3 * statistics.median(r["stall_s"] for r in reports[m]) for m in modes}
        if len(modes) > 1:
            print(f"  refit stall at {n} engines, median of {args.refits} (alternated): "
                  + ", ".join(f"{m} {v:.0f} ms (controller CPU {row['refit_controller_cpu_ms_by_control'][m]:.0f} ms)"
                              for m, v in row["refit_stall_ms_by_control"].items()), flush=True)

        # the fleet's probing while idle
        fleet_pids = processes()["fleet"]
        c0 = cpu_s(fleet_pids)
        time.sleep(args.idle_s)
        row["fleet_idle_cpu_pct"] = 100 * (cpu_s(fleet_pids) - c0) / args.idle_s

        # heal: 1, then 8 engines killed at once
        for k in (1, min(8, n)):
            slots = ray.get(svc.fleet.stats.remote(), timeout=120)["slots"]
            victims = [(s["index"], s["pid"]) for s in engine_stats(svc.fleet)][:k]
            for _, pid in victims:
                os.kill(pid, signal.SIGKILL)
            row[f"heal_{k}_s"] = wait_healthy(svc.fleet, n, replaced={i: slots[i]["generation"] for i, _ in victims})
        return row
    finally:
        svc.stop()
        for step in cleanup:
            step()


def table(rows: list[dict], routing: bool) -> str:
    if routing:
        head = ["policy", "engines", "turns/s", "p50 ms", "p99 ms", "prefix hit", "max/mean load", "pin moves", "failures"]
        lines = [head] + [[r["policy"], r["engines"], f"{r['turns_per_s']:.0f}", f"{r['p50_ms']:.0f}", f"{r['p99_ms']:.0f}",
                           f"{r['prefix_hit']:.1%}", f"{r['load_max_over_mean']:.2f}", r["pin_moves"], r["failures"]]
                          for r in rows]
    else:
        head = ["engines", "start s", "turns/s", "p50 ms", "p99 ms", "CPU ms/turn: replicas", "haproxy", "redis", "fleet",
                "engines", "refit stall ms", "control ms", "fleet idle CPU %", "heal 1 s", "heal 8 s", "engine RSS MB",
                "Redis KB/1k rollouts", "Redis ops/turn", "failures"]
        lines = [head]
        for r in rows:
            c = r["cpu_ms_per_turn"]
            lines.append([r["engines"], f"{r['start_s']:.0f}", f"{r['turns_per_s']:.0f}", f"{r['p50_ms']:.0f}",
                          f"{r['p99_ms']:.0f}", f"{c['replicas']:.1f}", f"{c['haproxy']:.2f}", f"{c['redis']:.2f}",
                          f"{c['fleet']:.2f}", f"{c['engines']:.1f}", f"{r['refit_stall_ms']:.0f}",
                          f"{r['refit_control_ms']:.0f}", f"{r['fleet_idle_cpu_pct']:.1f}", f"{r['heal_1_s']:.1f}",
                          f"{r['heal_8_s']:.1f}", f"{r['engine_rss_mb']:.0f}", f"{r['redis_kb_per_1k_rollouts']:.0f}",
                          f"{r['redis_ops_per_turn']:.1f}", r["failures"]])
    return "\n".join("| " + " | ".join(str(c) for c in line) + " |" + ("\n|" + "---|" * len(head) if i == 0 else "")
                     for i, line in enumerate(lines))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engines", type=int, nargs="+", default=[8, 32, 64])
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--rollouts", type=int, default=300)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--store-max-connections", type=int, default=0, help="store.max_connections (0: the default)")
    p.add_argument("--cap", type=int, default=256, help="max_tokens cap of the heavy-tailed lengths")
    p.add_argument("--shared-prefix", type=int, default=200, help="words of the shared system prompts")
    p.add_argument("--observation-words", type=int, default=0,
                   help="words (~8 tokens each) unique to each turn's observation, after 'observation N': long "
                   "per-rollout histories, where affinity pays")
    p.add_argument("--refits", type=int, default=3)
    p.add_argument("--compare-control", nargs="*", default=[], choices=["channel", "ray"],
                   help="also refit with these refit.control modes, alternating on the same service")
    p.add_argument("--compare-staging", nargs="*", default=[], choices=["overlap", "inside"],
                   help="also refit with these refit.staging modes (rows 'staging:<mode>'), alternating on the "
                   "same service")
    p.add_argument("--idle-s", type=float, default=10.0)
    p.add_argument("--routing", action="store_true", help="the routing table: each policy on the same workload")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--load-margin", type=int, default=16, help="routing.load_margin (sticky_least_loaded)")
    p.add_argument("--repeat", type=int, default=1, help="--routing: rounds of the three policies, alternating (the order rotates each round)")
    p.add_argument("--decode-step-s", type=float, default=0.006)
    p.add_argument("--decode-step-s-per-seq", type=float, default=6e-5)
    p.add_argument("--prefill-s-per-token", type=float, default=5e-5)
    p.add_argument("--kv-capacity-tokens", type=int, default=350_000)
    p.add_argument("--redis-cluster", action="store_true",
                   help="store on a Redis Cluster of 3 primaries with a replica each (LocalRedisCluster) instead of "
                   "the embedded redis-server")
    p.add_argument("--json", help="also write the rows to this file")
    args = p.parse_args(argv)
    args.port = free_port()
    args.redis_url = None

    from rollout_service.ops.runtime import apply_local_env, shutdown_local_ray

    apply_local_env()
    rows = []
    cluster = None
    if args.redis_cluster:
        from rollout_service.store.cluster_group import LocalRedisCluster

        cluster = LocalRedisCluster(tempfile.mkdtemp(prefix="bench-scale-cluster-"))
    try:
        if cluster is not None:
            args.redis_url = cluster.start()
        if args.routing:
            for n in args.engines:
                policies = ("sticky", "least_loaded", "sticky_least_loaded")
                for args.round in range(args.repeat):  # the policies alternate, the order rotating each round
                    for policy in policies[args.round % 3:] + policies[:args.round % 3]:
                        rows.append(run_one(n, args, policy))
                        print(json.dumps(rows[-1]), flush=True)
        else:
            for n in args.engines:
                rows.append(run_one(n, args))
                print(json.dumps(rows[-1]), flush=True)
    finally:
        shutdown_local_ray()
        if cluster is not None:
            cluster.stop()
            shutil.rmtree(cluster.directory, ignore_errors=True)
    print(table(rows, args.routing))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
