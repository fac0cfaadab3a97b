"""Chaos drill: agents and a refitting trainer run for ``--minutes`` while random faults hit every
part of the service; then the RL invariants are checked on every rollout.

The whole service as ``up`` runs it (``LocalService``: Ray Serve behind HAProxy, the engine fleet,
the refit controller, a supervised embedded redis-server). Agents run multi-turn rollouts over HTTP
with ``X-Rollout-Id`` and an ``Idempotency-Key`` per turn, retrying any failure (error status,
connection error, timeout) as an agent harness does. A trainer *process* (this script with
``--trainer-child``, a Ray driver of the same cluster) refits in flight through ``TrainerClient``
(object-store transport, new weights every time) and logs every version label before it refits.

Every ``--fault-every`` seconds one fault, chosen at random: ``kill -9`` an engine, SIGSTOP an
engine (the fleet declares it hung and kills it), ``kill -9`` a Serve replica, ``kill -9`` the
redis-server (restarted on its AOF), ``kill -9`` the fleet actor, ``kill -9`` the refit controller,
``kill -9`` the trainer process (then started again). Then, per rollout (``GET /v1/rollouts/{id}``):

- no acknowledged turn lost, no fork (one segment);
- the stored ids and logprobs of every turn equal what its 200 answer said;
- prompt continuity: each acknowledged prompt extends the previous turn's prompt + generation;
- every token's weight version is the initial one or one the trainer labelled, and versions never
  go backwards along a rollout (in the order the trainer labelled them);

and at the end every engine is healthy, unpaused and on the last committed version.

    .venv/bin/python scripts/drill_chaos.py [--minutes 5] [--rollouts 12] [--fault-every 20]
        [--backend vllm|simulated] [--engines 2] [--seed 0]

Traffic goes to 127.0.0.1 only, everything is bounded in time, and the drill stops every process
it started (the trainer child included), also on Ctrl-C.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import struct
import subprocess
import sys
import time
import uuid
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from rollout_service.ops.runtime import apply_local_env, free_port  # noqa: E402

apply_local_env()

from drill_replica_kill import replica_pids  # noqa: E402  (this directory: the Serve replicas' processes)

FLEET = {"probe_interval_s": 0.5, "probe_timeout_s": 3.0, "dead_after_failures": 3, "unresponsive_after_s": 6.0,
         "backoff_initial_s": 1.0, "resume_unbracketed_pause_s": 10.0}
FAULTS = ("engine kill", "engine hang", "replica kill", "redis kill", "fleet kill", "controller kill", "trainer kill")


# ------------------------------------------------------------------------------ trainer child
def trainer_child(args) -> None:
    """Refit forever with new weights; log each label (flushed) before its refit starts."""
    import ray
    import torch
    from safetensors.torch import load_file

    from rollout_service.config import RolloutServiceConfig
    from rollout_service.refit.client import TrainerClient
    from rollout_service.refit.controller import controller_name, get_controller

    ray.init(address=os.environ["RAY_ADDRESS"], namespace="drill-trainer", log_to_driver=False)
    model = RolloutServiceConfig().engine.resolved_model()
    base = load_file(os.path.join(model, "model.safetensors"))
    log = open(args.trainer_log, "a", buffering=1)
    k = 0
    while True:
        k += 1
        version = f"t{os.getpid()}-{k}"
        g = torch.Generator().manual_seed(hash(version) % (2**31))
        weights = {n: t + 0.02 * torch.randn(t.shape, generator=g) for n, t in base.items()}
        log.write(json.dumps({"version": version, "t": time.time()}) + "\n")
        try:
            trainer = TrainerClient(get_controller(controller_name("rollout-service")), timeout_s=60)
            report = trainer.refit(version, weights, transport="object_store")
            log.write(json.dumps({"committed": version, "stall_s": report["stall_s"]}) + "\n")
        except Exception as exc:  # the controller restarting, a refit failed: the next one gets a new label
            log.write(json.dumps({"failed": version, "error": f"{type(exc).__name__}: {exc}"[:300]}) + "\n")
            time.sleep(1.0)
        time.sleep(args.refit_every)


# ------------------------------------------------------------------------------ agents
class Agents:
    def __init__(self, url: str, model: str, call_timeout: float, deadline: float):
        import httpx

        self.http = httpx.AsyncClient(base_url=url, timeout=call_timeout)
        self.model, self.deadline = model, deadline
        self.outcomes: Counter = Counter()
        self.retried = 0
        self.longest = 0.0
        self.failures: Counter = Counter()  # "status: message" of every failed call

    async def _call(self, rid: str, key: str, body: dict, stream: bool):
        """One call; (status, the answer's message with our fields) or (status, error text)."""
        headers = {"X-Rollout-Id": rid, "Idempotency-Key": key}
        if not stream:
            r = await self.http.post("/v1/chat/completions", headers=headers, json=body)
            return r.status_code, (r.json()["choices"][0]["message"] if r.status_code == 200 else r.text[:200])
        async with self.http.stream("POST", "/v1/chat/completions", headers=headers, json={**body, "stream": True}) as r:
            if r.status_code != 200:
                return r.status_code, (await r.aread()).decode(errors="replace")[:200]
            last, content = None, []
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:  # a stream that ended with an error event
                    return 503, json.dumps(event)[:200]
                delta = event["choices"][0]["delta"] if event.get("choices") else {}
                content.append(delta.get("content") or "")
                if "generation_token_ids" in delta:
                    last = delta
            if last is None:
                return 599, "stream ended without its final chunk"
            return 200, {**last, "content": "".join(content)}

    async def rollout(self, rid: str, seed: int, turns: int, stream: bool = False) -> list[dict]:
        messages = [{"role": "user", "content": f"{rid}: count the stars"}]
        acked: list[dict] = []
        for turn in range(turns):
            key = f"{rid}-turn-{turn}"
            while True:
                if time.monotonic() > self.deadline + 300:
                    raise RuntimeError(f"{rid} turn {turn}: no answer 5 minutes after the drill's end")
                t0 = time.monotonic()
                try:
                    status, msg = await self._call(rid, key, {"model": self.model, "messages": messages,
                                                              "max_tokens": 16, "seed": seed + turn,
                                                              "ignore_eos": True}, stream)
                    outcome = str(status)
                except Exception as exc:
                    status, msg, outcome = None, f"{type(exc).__name__}: {exc}"[:200], type(exc).__name__
                self.longest = max(self.longest, time.monotonic() - t0)
                self.outcomes[outcome] += 1
                if status == 200:
                    break
                self.failures[f"{outcome}: {msg}"[:240]] += 1
                if status is not None and 400 <= status < 500 and status not in (408, 409, 429):
                    raise RuntimeError(f"{rid} turn {turn}: client error {status}: {msg}")
                self.retried += 1
                await asyncio.sleep(0.5)
            acked.append(msg)
            messages += [{"role": "assistant", "content": msg["content"], "reasoning_content": msg.get("reasoning_content")},
                         {"role": "user", "content": f"turn {turn}"}]
        return acked

    async def trajectory(self, rid: str) -> dict:
        for attempt in range(20):
            try:
                r = await self.http.get(f"/v1/rollouts/{rid}", headers={"X-Rollout-Id": rid})
                if r.status_code == 200:
                    return r.json()
            except Exception:
                pass
            await asyncio.sleep(0.5)
        raise RuntimeError(f"{rid}: trajectory unavailable")


def f32(values) -> bytes:
    return struct.pack(f"<{len(values)}f", *values)


def check(traj: dict, acked: list[dict], order: dict[str, int]) -> Counter:
    """The RL invariants of one rollout against what its agent was told."""
    bad: Counter = Counter()
    bad["forks"] += len(traj["segments"]) - 1
    seg = traj["segments"][-1]
    turns = seg["turns"]
    bad["lost"] += max(0, len(acked) - traj["turns"])
    last_rank = -1
    for i, msg in enumerate(acked):
        prompt, gen = msg["prompt_token_ids"], msg["generation_token_ids"]
        if i:
            prev = acked[i - 1]
            if prompt[: len(prev["prompt_token_ids"]) + len(prev["generation_token_ids"])] != \
                    prev["prompt_token_ids"] + prev["generation_token_ids"]:
                bad["continuity"] += 1
        if i >= len(turns):
            continue
        t = turns[i]
        if seg["token_ids"][: t["gen_end"]] != prompt + gen or t["gen_start"] != len(prompt):
            bad["ids"] += 1
        if f32(seg["logprobs"][t["gen_start"]: t["gen_end"]]) != f32(msg["generation_log_probs"]):
            bad["logprobs"] += 1  # the store keeps float32, the engine's precision
        for span in t["weight_versions"]:
            rank = order.get(span["version"])
            if rank is None:
                bad["unlabelled_version"] += 1
            elif rank < last_rank:
                bad["version_backwards"] += 1
            else:
                last_rank = rank
        bad["migrated_turns"] += 1 if t.get("migrations") else 0
    return bad


# ------------------------------------------------------------------------------ faults
class Chaos:
    def __init__(self, svc, args, trainer_log: str, ray_address: str):
        self.svc, self.args = svc, args
        self.trainer_log, self.ray_address = trainer_log, ray_address
        self.trainer: subprocess.Popen | None = None
        self.trainers = 0
        self.events: list[dict] = []

    def start_trainer(self) -> None:
        env = {**os.environ, "RAY_ADDRESS": self.ray_address}
        self.trainer = subprocess.Popen(
            [sys.executable, __file__, "--trainer-child", "--trainer-log", self.trainer_log,
             "--refit-every", str(self.args.refit_every)], env=env, stdout=subprocess.DEVNULL,
            stderr=open(self.trainer_log + ".stderr", "ab"), start_new_session=True)
        self.trainers += 1

    def stop_trainer(self) -> None:
        if self.trainer is not None and self.trainer.poll() is None:
            self.trainer.kill()
            self.trainer.wait(10)

    async def engine_pids(self) -> dict[int, int]:
        view = await self.svc.fleet.view.remote()
        infos = await asyncio.gather(*[asyncio.wait_for(m.handle.health.remote(), 10) for m in view.members],
                                     return_exceptions=True)
        return {m.slot: i["pid"] for m, i in zip(view.members, infos) if isinstance(i, dict)}

    async def actor_pid(self, actor) -> int:
        return await asyncio.wait_for(actor.__ray_call__.remote(lambda self: os.getpid()), 30)

    async def hit(self, kind: str) -> str:
        """Inflict ``kind``; return once the service has noticed it (the faulty part is out or
        replaced), so the heal time that follows is the service's, not the drill's."""
        if kind in ("engine kill", "engine hang"):
            pids = await self.engine_pids()
            if not pids:
                return "no engine serving: skipped"
            slot = random.choice(sorted(pids))
            view = await self.svc.fleet.view.remote()
            key = next(m.key for m in view.members if m.slot == slot)
            os.kill(pids[slot], signal.SIGKILL if kind == "engine kill" else signal.SIGSTOP)
            await self._until(lambda: self._left(key), 120)
            return f"slot {slot} pid {pids[slot]}"
        if kind == "replica kill":
            pids = replica_pids()
            if not pids:
                return "no replica: skipped"
            pid = random.choice(pids)
            os.kill(pid, signal.SIGKILL)
            await self._until(lambda: _async(bool(set(replica_pids()) - set(pids))), 120)
            return f"pid {pid}"
        if kind == "redis kill":
            pid = self.svc.redis.pid
            os.kill(pid, signal.SIGKILL)
            await self._until(lambda: _async(self.svc.redis.pid not in (None, pid)), 60)
            return f"pid {pid}"
        if kind in ("fleet kill", "controller kill"):
            actor = self.svc.fleet if kind == "fleet kill" else self.svc.controller
            pid = await self.actor_pid(actor)
            os.kill(pid, signal.SIGKILL)
            await self._until(lambda: self._restarted(actor, pid), 120)
            return f"pid {pid}"
        if kind == "trainer kill":
            pid = self.trainer.pid if self.trainer else None
            self.stop_trainer()
            await asyncio.sleep(1.0)
            self.start_trainer()
            return f"pid {pid}, started again"
        raise ValueError(kind)

    async def _left(self, key) -> bool:
        try:
            view = await asyncio.wait_for(self.svc.fleet.view.remote(), 10)
        except Exception:
            return False
        return key not in {m.key for m in view.members}

    async def _restarted(self, actor, pid: int) -> bool:
        try:
            return await self.actor_pid(actor) != pid
        except Exception:
            return False

    @staticmethod
    async def _until(cond, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not await cond():
            if time.monotonic() > deadline:
                raise TimeoutError("the service did not notice the fault")
            await asyncio.sleep(0.1)

    async def healthy(self) -> float:
        """Seconds until /health answers 200 and every engine serves."""
        import httpx

        t0 = time.monotonic()
        async with httpx.AsyncClient(base_url=self.svc.url, timeout=10) as http:
            while time.monotonic() - t0 < 600:
                try:
                    ok = (await http.get("/health")).status_code == 200
                    view = await asyncio.wait_for(self.svc.fleet.view.remote(), 10)
                    if ok and len(view.members) == self.args.engines:
                        return time.monotonic() - t0
                except Exception:
                    pass
                await asyncio.sleep(0.5)
        return float("nan")


async def _async(value):
    return value


def labels(trainer_log: str) -> tuple[dict[str, int], int, int]:
    """Every version the trainer labelled, in order (the initial "0" first); committed, failed."""
    order, committed, failed = {"0": 0}, 0, 0
    try:
        lines = Path(trainer_log).read_text().splitlines()
    except FileNotFoundError:
        lines = []
    for line in lines:
        try:
            e = json.loads(line)
        except json.JSONDecodeError:  # a line cut by the kill
            continue
        if "version" in e:
            order.setdefault(e["version"], len(order))
        committed += "committed" in e
        failed += "failed" in e
    return order, committed, failed


async def drill(svc, chaos: "Chaos", args) -> dict:
    import httpx

    rng = random.Random(args.seed)
    random.seed(args.seed)
    trainer_log = chaos.trainer_log
    chaos.start_trainer()
    model = httpx.get(f"{svc.url}/v1/models", timeout=60).json()["data"][0]["id"]
    t_start = time.monotonic()
    end = t_start + 60 * args.minutes
    agents = Agents(svc.url, model, args.call_timeout, end)
    results: dict[str, list[dict]] = {}

    async def rollouts(worker: int) -> None:
        k = 0
        while time.monotonic() < end:
            rid = f"chaos-{worker}-{k}-{uuid.uuid4().hex[:4]}"
            results[rid] = []
            results[rid] = await agents.rollout(rid, 1000 * worker + 10 * k, args.turns, stream=worker % 2 == 1)
            k += 1

    workers = [asyncio.create_task(rollouts(w)) for w in range(args.rollouts)]
    faults = []
    await asyncio.sleep(args.fault_every)
    while time.monotonic() < end - 10:
        kind = rng.choice(FAULTS)
        t_fault = time.monotonic()
        what = await chaos.hit(kind)
        await chaos.healthy()
        heal = time.monotonic() - t_fault  # fault -> noticed -> /health 200 with every engine serving
        faults.append({"fault": kind, "at_s": t_fault - t_start, "what": what, "healed_s": heal})
        print(f"[chaos] t={t_fault - t_start:.0f}s {kind}: {what}; healthy again after {heal:.1f}s", flush=True)
        await asyncio.sleep(max(0.0, args.fault_every - (time.monotonic() - t_fault)))
    await asyncio.gather(*workers)
    chaos.stop_trainer()
    settle_s = await chaos.healthy()
    # Every engine healthy, unpaused, on the last committed version.
    view = await svc.fleet.view.remote()
    current = (await svc.controller.stats.remote())["weight_version"]
    healths = await asyncio.gather(*[m.handle.health.remote() for m in view.members])
    engines_ok = all(not h["paused"] and h["weight_version"] == current for h in healths) \
        and view.version == current and len(view.members) == args.engines
    order, committed, failed_refits = labels(trainer_log)
    bad: Counter = Counter()
    acked = 0
    for rid, turns in results.items():
        if not turns:
            continue
        acked += len(turns)
        bad += check(await agents.trajectory(rid), turns, order)
    await agents.http.aclose()
    return {"minutes": args.minutes, "backend": args.backend, "engines": args.engines, "faults": faults,
            "calls": sum(agents.outcomes.values()), "outcomes": dict(agents.outcomes), "retried": agents.retried,
            "longest_call_s": agents.longest, "rollouts": sum(1 for t in results.values() if t), "acked": acked,
            "refits_committed": committed, "refits_failed": failed_refits, "trainer_processes": chaos.trainers,
            "versions_labelled": len(order) - 1, "engines_ok_at_end": engines_ok, "settle_s": settle_s,
            "violations": {k: v for k, v in bad.items() if k != "migrated_turns"},
            "migrated_turns": bad["migrated_turns"], "failures": dict(agents.failures.most_common(12))}


def run(args) -> dict:
    """Start the service, run the drill, stop everything (also on Ctrl-C: the start is not in a
    thread an interrupt could leave running)."""
    import ray

    from rollout_service.config import RolloutServiceConfig
    from rollout_service.ops.launcher import LocalService
    from rollout_service.ops.runtime import shutdown_local_ray

    engine = {"num_engines": args.engines, "num_cpus_per_engine": 0}
    if args.backend == "simulated":
        engine.update(backend="simulated", sim={"decode_step_s": 0.01})
    cfg = RolloutServiceConfig.model_validate({"engine": engine, "service": {"num_affinity_replicas": 2},
                                               "fleet": FLEET, "refit": {"step_timeout_s": 30}})
    svc = LocalService(cfg, port=free_port(), log=lambda *a: print(*a, flush=True))
    trainer_log = str(Path(os.environ.get("TMPDIR", "/tmp")) / f"drill-chaos-{uuid.uuid4().hex[:6]}.jsonl")
    chaos = None
    try:
        svc.start()
        chaos = Chaos(svc, args, trainer_log, ray.get_runtime_context().gcs_address)
        return asyncio.run(drill(svc, chaos, args))
    finally:
        if chaos is not None:
            chaos.stop_trainer()
        svc.stop()
        shutdown_local_ray()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=5.0)
    p.add_argument("--rollouts", type=int, default=12, help="agents running rollouts concurrently")
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--fault-every", type=float, default=20.0)
    p.add_argument("--refit-every", type=float, default=3.0, help="trainer's pause between refits (s)")
    p.add_argument("--call-timeout", type=float, default=60.0)
    p.add_argument("--backend", choices=("vllm", "simulated"), default="vllm")
    p.add_argument("--engines", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--trainer-child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--trainer-log", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.trainer_child:
        trainer_child(args)
        return 0
    args.minutes = min(args.minutes, 60.0)
    r = run(args)
    kinds = Counter(f["fault"] for f in r["faults"])
    heals = [f["healed_s"] for f in r["faults"]]
    print(json.dumps(r, indent=1, default=str))
    print(f"\n{r['minutes']} min, {r['engines']} {r['backend']} engines, {r['rollouts']} rollouts x {args.turns} turns\n")
    print("| faults | calls | retried | longest call (s) | acked turns | lost | forks | ids / logprobs differ "
          "| continuity | unlabelled / backwards versions | refits ok / failed | heal (s, max) | engines ok at end |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    v = r["violations"]
    print(f"| {', '.join(f'{k} x{n}' for k, n in sorted(kinds.items()))} | {r['calls']} | {r['retried']} | "
          f"{r['longest_call_s']:.1f} | {r['acked']} | {v.get('lost', 0)} | {v.get('forks', 0)} | "
          f"{v.get('ids', 0)} / {v.get('logprobs', 0)} | {v.get('continuity', 0)} | "
          f"{v.get('unlabelled_version', 0)} / {v.get('version_backwards', 0)} | "
          f"{r['refits_committed']} / {r['refits_failed']} | {max(heals) if heals else 0:.1f} | {r['engines_ok_at_end']} |")
    return 0 if not any(v.values()) and r["engines_ok_at_end"] else 1


if __name__ == "__main__":
    sys.exit(main())
