"""Two-node drill of the HAProxy ingress: the service on a two-node Ray cluster (both nodes on this
machine), HAProxy in front, a Serve replica killed on the worker node under agent traffic.

The multi-node deployment files and the KubeRay manifests run Serve's HAProxy ingress
(``RAY_SERVE_ENABLE_HA_PROXY=1``, ``RAY_SERVE_HAPROXY_BALANCE_ALGORITHM=hdr(x-rollout-id)`` on every
node): HAProxy hashes ``X-Rollout-Id`` to a replica, on whatever node it runs, and that replica
serves the HTTP call itself. This drill checks that on two nodes:

- placement: affinity replicas on both nodes, the engines on the worker node (``bundle_resources``);
- affinity: every turn of a rollout answered by one replica, on either node, until that replica dies;
- exact continuation: every acknowledged turn's prompt + generated ids are in the stored trajectory,
  in order, in one segment (no fork);
- a replica on the worker node SIGKILLed mid-run: its rollouts move to one other replica each and
  go on, retried calls only (Idempotency-Key), nothing lost; Serve starts a replacement.

Both nodes share 127.0.0.1, so only the head runs the ingress (``proxy_location: HeadOnly``: two
HAProxies cannot both bind one port on one address); on a real cluster every node runs one with the
same replica list (deployments/multi-node-gpu.yaml). The engines are simulated
(``engine.backend: simulated``): routing and failover are the app's and Serve's, not the engine's.

    .venv/bin/python scripts/drill_two_node.py [--rollouts 12] [--turns 6] [--replicas 4] [--json]

Traffic goes to 127.0.0.1 only, is bounded, and the drill stops the cluster it started.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from rollout_service.ops.runtime import LOCAL_RAY_ENV, apply_local_env, apply_proxy_env, free_port  # noqa: E402

apply_local_env()
os.environ.update(LOCAL_RAY_ENV)
apply_proxy_env("haproxy")  # before the nodes start: their Serve controller and proxy read it

REPLICA_CLASS = "ServeReplica:rollout-service:RolloutService"


def replicas_by_node() -> dict[str, dict]:
    """Live replicas of the app: Serve's replica id -> {node_id, pid}."""
    from ray.util.state import list_actors

    import ray

    out = {}
    address = ray.get_runtime_context().gcs_address
    for a in list_actors(address=address, filters=[("class_name", "=", REPLICA_CLASS), ("state", "=", "ALIVE")], detail=True):
        out[a.name.rsplit("#", 1)[-1]] = {"node_id": a.node_id, "pid": a.pid}
    return out


def running_replicas() -> int:
    """Replicas Serve reports RUNNING (started and passing their health check)."""
    from ray import serve

    app = serve.status().applications.get("rollout-service")
    if app is None or "RolloutService" not in app.deployments:
        return 0
    return app.deployments["RolloutService"].replica_states.get("RUNNING", 0)


async def drill(args) -> dict:
    import httpx
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster

    from drill_replica_kill import Agents
    from rollout_service.config import RolloutServiceConfig
    from rollout_service.ops.launcher import LocalService
    from rollout_service.ops.runtime import shutdown_local_ray

    port = free_port()
    env = {"env_vars": {k: os.environ[k] for k in ("RAY_AUTH_MODE", "RAY_USAGE_STATS_ENABLED") if k in os.environ}}
    # The dashboard serves Ray's state API, which says on which node each replica runs.
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 4, "include_dashboard": True,
                                                            "dashboard_port": free_port(),
                                                            "node_ip_address": "127.0.0.1"})
    svc = None
    try:
        worker = cluster.add_node(num_cpus=4, resources={"engine_node": 1}, node_ip_address="127.0.0.1")
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, namespace="rollout-service", runtime_env=env, logging_level="WARNING")
        head_id = ray.get_runtime_context().get_node_id()
        serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
        cfg = RolloutServiceConfig.model_validate({
            "engine": {"num_engines": 2, "backend": "simulated", "bundle_resources": {"engine_node": 0.5}},
            # Serve's spread is best effort (it once put all four on the head): at most half on a node.
            "service": {"num_affinity_replicas": args.replicas, "max_replicas_per_node": (args.replicas + 1) // 2},
            "fleet": {"probe_interval_s": 0.5},
        })
        svc = LocalService(cfg, port=port, proxy=None, log=lambda *a: print(*a, file=sys.stderr, flush=True))
        await asyncio.to_thread(svc.start)
        placed = replicas_by_node()
        engines = ray.get(svc.fleet.stats.remote())["slots"]
        model = httpx.get(f"{svc.url}/v1/models", timeout=60).json()["data"][0]["id"]
        agents = Agents(svc.url, model, args.rollouts, args.turns, args.call_timeout)
        rids = [f"two-node-{uuid.uuid4().hex[:6]}-{i}" for i in range(args.rollouts)]
        t_start = time.monotonic()
        tasks = [asyncio.create_task(agents.agent(rid, 1000 * i)) for i, rid in enumerate(rids)]
        on_worker = [(rid, info) for rid, info in placed.items() if info["node_id"] == worker.node_id]
        # The victim: the worker-node replica that answered the most turns so far (one that owns rollouts).
        worker_ids = {replica for replica, _ in on_worker}
        while not worker_ids & {r for seq in agents.replicas.values() for r in seq} and not all(t.done() for t in tasks):
            await asyncio.sleep(0.05)
        answered = {replica: sum(seq.count(replica) for seq in agents.replicas.values()) for replica, _ in on_worker}
        victim, info = max(on_worker, key=lambda ri: answered[ri[0]]) if on_worker else (None, None)
        t_kill = None
        if victim is not None:
            os.kill(info["pid"], signal.SIGKILL)
            t_kill = time.monotonic()
            print(f"[drill] SIGKILL replica {victim} (pid {info['pid']}, worker node) at "
                  f"t={t_kill - t_start:.1f}s", file=sys.stderr, flush=True)
        results = await asyncio.gather(*tasks)
        run_s = time.monotonic() - t_start
        checks = [await agents.check(rid, acked) for rid, acked in zip(rids, results)]
        # Serve replaces the victim; HAProxy takes the new replica into its hash, and new rollouts reach it.
        deadline = time.monotonic() + args.replace_timeout
        def replaced() -> bool:
            return bool(set(replicas_by_node()) - set(placed)) and running_replicas() >= args.replicas

        while t_kill is not None and not replaced() and time.monotonic() < deadline:
            await asyncio.sleep(0.5)
        replaced_s = time.monotonic() - t_kill if t_kill is not None and replaced() else None
        after = replicas_by_node()
        await asyncio.sleep(2)  # HAProxy reloads with the new server list
        rids2 = [f"two-node-{uuid.uuid4().hex[:6]}-w2-{i}" for i in range(args.rollouts)]
        results2 = await asyncio.gather(*(agents.agent(rid, 5000 + 1000 * i) for i, rid in enumerate(rids2)))
        checks += [await agents.check(rid, acked) for rid, acked in zip(rids2, results2)]
        await agents.http.aclose()
        replacement = sorted(set(after) - set(placed))

        def moves(seq: list[str]) -> int:
            return sum(a != b for a, b in zip(seq, seq[1:]))

        served = {rid: agents.replicas.get(rid, []) for rid in rids}
        wave2 = [agents.replicas.get(rid, []) for rid in rids2]
        return {
            "nodes": {"head": head_id, "worker": worker.node_id},
            "replicas": {rid: ("worker" if i["node_id"] == worker.node_id else "head") for rid, i in placed.items()},
            "engines": [("worker" if s["node_id"] == worker.node_id else "head") for s in engines],
            "rollouts": args.rollouts, "turns": args.turns, "acked": sum(len(r) for r in results + results2),
            "outcomes": dict(agents.outcomes), "longest_call_s": agents.longest, "run_s": run_s,
            "turns_by_node": {node: sum(1 for seq in served.values() for r in seq
                                        if placed.get(r, {}).get("node_id") == nid)
                              for node, nid in (("head", head_id), ("worker", worker.node_id))},
            "victim": victim, "victim_rollouts": sorted(rid for rid, seq in served.items() if victim in seq),
            # Affinity: a rollout changes replica only when its replica died, and then once.
            "moves": {rid: moves(seq) for rid, seq in served.items()},
            "moved_off_other": sorted(rid for rid, seq in served.items() if moves(seq) and victim not in seq[:-1]),
            "replacement": replacement, "replaced_s": replaced_s,
            "replacement_node": [("worker" if after[r]["node_id"] == worker.node_id else "head") for r in replacement],
            # The second wave, after the replacement: the replicas that answered it, and its moves.
            "wave2_replicas": sorted({r for seq in wave2 for r in seq}), "wave2_moves": sum(moves(seq) for seq in wave2),
            "lost": sum(c[0] for c in checks), "forks": sum(c[1] for c in checks),
            "failures": [f for _, f in agents.failures][:6],
        }
    finally:
        if svc is not None:
            await asyncio.to_thread(svc.stop)
        try:
            serve.shutdown()
        except Exception:
            pass
        shutdown_local_ray()
        cluster.shutdown()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rollouts", type=int, default=12)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--replicas", type=int, default=4, help="affinity replicas (at most half of them on one node)")
    p.add_argument("--replace-timeout", type=float, default=60.0, help="longest wait for Serve's replacement replica")
    p.add_argument("--call-timeout", type=float, default=30.0, help="client timeout per call (then it retries)")
    p.add_argument("--json", action="store_true", help="print the result as one JSON line last (the test reads it)")
    args = p.parse_args()
    row = asyncio.run(drill(args))
    if args.json:
        print(json.dumps(row))
    else:
        print(f"\n{row}\n")
        print("| replicas head / worker | rollouts x turns (2 waves) | wave 1 turns head / worker | call outcomes | "
              "longest call (s) | acked | lost | forks | rollouts moved: victim's / others | replaced in (s) | "
              "wave 2: replicas, moves |")
        print("|---|---|---|---|---:|---:|---:|---:|---|---:|---|")
        rep = list(row["replicas"].values())
        moved = sum(1 for v in row["moves"].values() if v)
        replaced = f"{row['replaced_s']:.1f}" if row["replaced_s"] is not None else "-"
        print(f"| {rep.count('head')} / {rep.count('worker')} | {row['rollouts']} x {row['turns']} | "
              f"{row['turns_by_node']['head']} / {row['turns_by_node']['worker']} | "
              f"{', '.join(f'{k}: {v}' for k, v in sorted(row['outcomes'].items()))} | {row['longest_call_s']:.1f} | "
              f"{row['acked']} | {row['lost']} | {row['forks']} | {moved - len(row['moved_off_other'])} / "
              f"{len(row['moved_off_other'])} | {replaced} | {len(row['wave2_replicas'])}, {row['wave2_moves']} |")
    return 0 if row["lost"] == 0 and row["forks"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
