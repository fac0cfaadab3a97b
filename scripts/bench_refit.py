"""Refit wall time vs bytes on gloo (CPU), against a raw gloo broadcast of the same bytes.

For each model (the tiny one, then random ~50M and ~200M-parameter Qwen3 models built with
``build_tiny_model(config_overrides=...)``): start one engine behind a RefitController, form the
gloo group with a TrainerClient in this process (rank 0), then, ``--repeats`` times:

- raw: broadcast the same bytes as one buffer in bucket-size chunks from preallocated, touched
  buffers into preallocated, touched buffers on the worker, over the same group, every message
  posted at once on both sides, timed on the trainer after a handshake (the ceiling: no packing,
  no per-tensor messages, no RPCs) and on the worker from its handshake;
- right after it, a collective refit (``TrainerClient.refit``, state dict perturbed each time):
  *send* = the trainer's handshake -> END (the same window as raw), *stage step* = the
  controller's transfer step (adds the stage RPC's round trip), each compared to the raw broadcast
  of its own pair; the median over pairs is reported;
- object store and checkpoint path: the same refit through the other transports.

One engine at a time (2-core machine). Usage::

    .venv/bin/python scripts/bench_refit.py [--sizes tiny,50m,200m] [--repeats 5] [--transports ...] [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from rollout_service.ops.runtime import apply_local_env  # noqa: E402

apply_local_env()

MODELS = {
    "tiny": None,  # hidden 64, 2 layers: ~20M params
    "50m": {"hidden_size": 160, "intermediate_size": 640},
    "200m": {"hidden_size": 640, "intermediate_size": 2560},
    "1.5g": {"hidden_size": 1024, "intermediate_size": 4096},  # ~1.4 GB of float32 (bench_staging.py)
}


def model_dir(size: str, root: Path) -> Path:
    from rollout_service.models.tiny_model import build_tiny_model, ensure_tiny_model

    if MODELS[size] is None:
        return ensure_tiny_model()
    return build_tiny_model(root / f"qwen3-{size}", config_overrides=MODELS[size])


def raw_chunks(nbytes: int, chunk: int) -> list[int]:
    """The baseline's message sizes: the same bytes as one buffer, in chunks of the bucket size."""
    return [min(chunk, nbytes - off) for off in range(0, nbytes, chunk)]


def raw_broadcast_s(client, engine, bucket_sizes: list[int]) -> tuple[float, float]:
    """Seconds to broadcast these buffers to the engine's worker: timed on the trainer after a
    handshake (the ceiling), and on the worker from its handshake on (the window of the refit's
    ``worker_receive_s``)."""
    import ray
    import torch

    group = client._group
    bufs = [torch.ones(n, dtype=torch.uint8) for n in bucket_sizes]
    ref = engine.collective_rpc.remote("rs_bench_raw_receive", args=(bucket_sizes,))
    group.broadcast(torch.zeros(2, dtype=torch.int64))  # handshake: the worker is receiving
    t0 = time.perf_counter()
    for w in [group.broadcast_async(b) for b in bufs]:  # all posted at once, as the refit does
        w.wait()
    dt = time.perf_counter() - t0
    worker = ray.get(ref)[0]
    return dt, worker["with_handshake_s"]


def bench_one(size: str, root: Path, repeats: int, bucket_bytes: int, transports: tuple[str, ...]) -> dict:
    import ray
    import torch
    from safetensors.torch import load_file, save_file

    from rollout_service.config import RolloutServiceConfig
    from rollout_service.refit.client import TrainerClient
    from rollout_service.weights.collective import bucket_size, plan_for_state_dict
    from rollout_service.fleet.fleet import EngineFleet
    from rollout_service.refit.controller import RefitController

    mdir = model_dir(size, root)
    weights = load_file(str(mdir / "model.safetensors"))
    nparams = sum(t.numel() for t in weights.values())
    # The transfer inside the pause (refit.staging: inside), as every earlier row of this table:
    # pause→resume is then the whole refit. scripts/bench_staging.py compares the two modes.
    cfg = RolloutServiceConfig.model_validate({"engine": {"model": str(mdir), "max_num_seqs": 8},
                                               "refit": {"staging": "inside"}})
    # A fleet of its own per model (not the instance's named one, which the next model would reuse).
    fleet = ray.remote(EngineFleet).options(num_cpus=0, max_concurrency=1000).remote(cfg.model_dump())
    ctl = ray.remote(RefitController).options(num_cpus=0, max_concurrency=100).remote(cfg.model_dump(), fleet)
    try:
        t0 = time.perf_counter()
        ray.get(ctl.start.remote(), timeout=600)
        start_s = time.perf_counter() - t0
        engine = ray.get(ctl.get_engines.remote())[0]
        client = TrainerClient(ctl, bucket_bytes=bucket_bytes, timeout_s=300)
        client.init_weight_sync()
        plan = plan_for_state_dict(weights, bucket_bytes)
        sizes = raw_chunks(sum(bucket_size(b) for b in plan.buckets), bucket_bytes)

        version = 0

        def refit(transport, params):
            nonlocal version
            version += 1
            return client.refit(str(version), params, transport=transport)

        def perturbed(step):
            return {k: v + 1e-3 * step for k, v in weights.items()}

        raw_s = []
        raw_worker_s = []
        reports: dict[str, list[dict]] = {t: [] for t in ("collective", "object_store", "path")}
        refit("collective", perturbed(0))  # warm-up: first-touch of every buffer on both sides
        refit("collective", perturbed(0))  # (the worker alternates two sets of receive buffers)
        raw_broadcast_s(client, engine, sizes)
        ckpt = root / f"ckpt-{size}"
        ckpt.mkdir(exist_ok=True)
        shutil.copy(mdir / "config.json", ckpt / "config.json")
        for i in range(repeats):
            # Each collective refit right after its raw baseline: the ratio is taken per pair.
            trainer_s, worker_s = raw_broadcast_s(client, engine, sizes)
            raw_s.append(trainer_s)
            raw_worker_s.append(worker_s)
            reports["collective"].append(refit("collective", perturbed(i + 1)))
            if "object_store" in transports:
                reports["object_store"].append(refit("object_store", perturbed(i + 1)))
            if "path" in transports:
                save_file(perturbed(i + 1), str(ckpt / "model.safetensors"))
                reports["path"].append(refit("path", str(ckpt)))
        assert all(r["ok"] and r["requests_aborted"] == 0 for rs in reports.values() for r in rs)
        nbytes = plan.total_bytes
        med = lambda xs: statistics.median(xs)  # noqa: E731
        col = reports["collective"]
        out = {
            "model": size,
            "params": nparams,
            "bytes": nbytes,
            "buckets": len(plan.buckets),
            "raw_messages": len(sizes),
            "engine_start_s": start_s,
            "raw_s": med(raw_s),
            "raw_gbps": nbytes / med(raw_s) / 1e9,
            "raw_worker_s": med(raw_worker_s),
            # Per pair (raw, then the refit right after it), then the median over the pairs.
            "send_vs_raw": med([r / c["trainer_send_s"] for r, c in zip(raw_s, col)]),
            "send_vs_raw_all": [round(r / c["trainer_send_s"], 3) for r, c in zip(raw_s, col)],
            "transfer_vs_raw": med([r / c["transfer_s"] for r, c in zip(raw_s, col)]),
            "receive_vs_raw_worker": med([r / c["worker_receive_s"] for r, c in zip(raw_worker_s, col)]),
        }
        keys = ("pause_s", "transfer_s", "trainer_send_s", "worker_receive_s", "load_s", "resume_s", "total_s")
        for name, rs in reports.items():
            if not rs:
                continue
            out[name] = {k: med([r[k] for r in rs]) for k in keys if rs[0].get(k) is not None}
            out[name]["e2e_gbps"] = nbytes / out[name]["total_s"] / 1e9
        out["collective_e2e_vs_raw"] = out["collective"]["e2e_gbps"] / out["raw_gbps"]
        return out
    finally:
        try:
            ray.get(fleet.shutdown.remote(), timeout=120)
        finally:
            ray.kill(ctl)
            ray.kill(fleet)


def table(results: list[dict]) -> str:
    rows = [
        "| model | params | MB | messages (refit / raw) | raw gloo GB/s | refit send s | send / raw | "
        "stage step s | stage / raw | worker receive / raw worker | load s | pause s | resume s | "
        "pause→resume s | e2e / raw | object store pause→resume s | path pause→resume s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        c = r["collective"]
        other = lambda t: f"{r[t]['total_s']:.3f}" if t in r else "–"  # noqa: E731
        rows.append(
            f"| {r['model']} | {r['params'] / 1e6:.0f}M | {r['bytes'] / 1e6:.0f} | {r['buckets']} / {r['raw_messages']} | "
            f"{r['raw_gbps']:.2f} | {c['trainer_send_s']:.3f} | {r['send_vs_raw']:.2f} | "
            f"{c['transfer_s']:.3f} | {r['transfer_vs_raw']:.2f} | {r['receive_vs_raw_worker']:.2f} | "
            f"{c['load_s']:.3f} | {c['pause_s']:.3f} | {c['resume_s']:.3f} | {c['total_s']:.3f} | "
            f"{r['collective_e2e_vs_raw']:.2f} | {other('object_store')} | {other('path')} |"
        )
    return "\n".join(rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="tiny,50m,200m")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--transports", default="collective,object_store,path",
                    help="collective always runs; object_store / path refits run between collective ones")
    ap.add_argument("--bucket-mb", type=int, default=256)
    ap.add_argument("--models-dir", default=None, help="keep the built models here (default: a temp dir)")
    ap.add_argument("--out", default=None, help="write the raw results as JSON here")
    args = ap.parse_args(argv)

    transports = tuple(t.strip() for t in args.transports.split(","))
    run_over_models(args, "bench-refit-", lambda size, root: bench_one(
        size, root, args.repeats, args.bucket_mb * 1024 * 1024, transports), table)
    return 0


def run_over_models(args, prefix: str, bench, table) -> list[dict]:
    """Local Ray, then ``bench(size, root)`` for each of ``args.sizes`` (models built under
    ``args.models_dir``, or a temporary directory removed after); each result printed as JSON,
    then the machine and ``table(results)``; the results written to ``args.out`` if given."""
    from rollout_service.ops.runtime import start_local_ray

    start_local_ray()
    root = Path(args.models_dir) if args.models_dir else Path(tempfile.mkdtemp(prefix=prefix))
    root.mkdir(parents=True, exist_ok=True)
    results = []
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    try:
        for size in args.sizes.split(","):
            r = bench(size.strip(), root)
            print(json.dumps(r), flush=True)
            results.append(r)
    finally:
        if not args.models_dir:
            shutil.rmtree(root, ignore_errors=True)
    print()
    print(f"started {started}; machine: {platform.machine()}, {os.cpu_count()} cores, python "
          f"{sys.version.split()[0]}; load average {os.getloadavg()}")
    print(table(results))
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    sys.exit(main())
