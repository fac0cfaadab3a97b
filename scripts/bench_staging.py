"""Staged refits (``refit.staging: overlap``) against transfers inside the pause (``inside``): the
engines' stall, the whole refit, and generation during the staging window.

For each model (the tiny one; ``1.5g``: its architecture widened to ~1.4 GB of float32 weights,
built locally like the tiny one) one real vLLM engine runs behind a RefitController, ``--streams``
streaming generations run against it the whole time, and for each transport the two modes
alternate ``--repeats`` times (overlap, inside, overlap, ...; the state dict perturbed each time).
Per refit: ``stall_s`` (pause start to resume done: what every request of every engine waits),
``stage_s`` (overlap: the transfer while the engine generates), ``total_s`` and ``load_s``; and the
streams' tokens/s inside the refit call's window up to the pause (the staging window, overlap) or
in the pause (inside), against the same streams in the ``--idle-s`` seconds just before the
refit (idle: no refit). The median over the repeats is printed as a table.

One engine at a time (2-core machine: the gloo receive, the file read and the generation share
the two cores; that slowdown is what the tokens/s column shows). Usage::

    .venv/bin/python scripts/bench_staging.py [--sizes tiny,1.5g] [--repeats 3] [--transports collective,path,object_store] [--out r.json]
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import sys
import threading
import time
from pathlib import Path

from rollout_service.ops.runtime import apply_local_env  # noqa: E402

apply_local_env()

# The models (tiny, 1.5g) and the run over them are bench_refit.py's (this folder).
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_refit import model_dir, run_over_models  # noqa: E402


class Streams:
    """``n`` streaming generations kept running against the engine; every token's arrival time."""

    def __init__(self, engine, n: int, max_tokens: int = 256):
        self.engine, self.n, self.max_tokens = engine, n, max_tokens
        self.arrivals: list[float] = []
        self.stop = threading.Event()
        self.errors: list[str] = []
        self.thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    async def _one(self, i: int) -> None:
        from rollout_service.engine.types import GenerateRequest, SamplingOptions

        seed = i
        while not self.stop.is_set():
            seed += self.n
            req = GenerateRequest(prompt_ids=[9707, 11, 1879, 0, 220 + i], max_tokens=self.max_tokens,
                                  sampling=SamplingOptions.validated(seed=seed, temperature=1.0, ignore_eos=True))
            try:
                async for ref in self.engine.generate.options(num_returns="streaming").remote(req):
                    chunk = await ref
                    now = time.perf_counter()
                    self.arrivals += [now] * len(chunk.token_ids)
                    if self.stop.is_set():
                        break
            except Exception as exc:  # noqa: BLE001 - reported in the results
                self.errors.append(f"{type(exc).__name__}: {exc}"[:200])
                await asyncio.sleep(0.1)

    async def _run(self) -> None:
        await asyncio.gather(*[self._one(i) for i in range(self.n)])

    def rate(self, t0: float, t1: float) -> float:
        if t1 <= t0:
            return float("nan")
        return sum(1 for t in self.arrivals if t0 <= t < t1) / (t1 - t0)


def bench_one(size: str, root: Path, repeats: int, transports: tuple[str, ...], streams: int, idle_s: float) -> dict:
    import ray
    from safetensors.torch import load_file, save_file

    from rollout_service.config import RolloutServiceConfig
    from rollout_service.refit.client import TrainerClient
    from rollout_service.fleet.fleet import EngineFleet
    from rollout_service.refit.controller import RefitController

    mdir = model_dir(size, root)
    weights = load_file(str(mdir / "model.safetensors"))
    nbytes = sum(t.numel() * t.element_size() for t in weights.values())

    def config(staging: str) -> dict:
        return RolloutServiceConfig.model_validate({
            "engine": {"model": str(mdir), "max_num_seqs": 8},
            # No fleet copy of each refit's weights (an export per refit: 2-3 more copies of a 1.4 GB
            # model in memory at once, which the 24 GiB machine cannot hold beside the rest).
            "fleet": {"keep_weights_copy": False},
            "refit": {"staging": staging, "step_timeout_s": 300}}).model_dump()

    # A fleet of its own per model (not the instance's named one, which a second model would reuse).
    fleet = ray.remote(EngineFleet).options(num_cpus=0, max_concurrency=1000).remote(config("overlap"))
    ctl = ray.remote(RefitController).options(num_cpus=0, max_concurrency=100).remote(config("overlap"), fleet)
    load = None
    try:
        ray.get(ctl.start.remote(), timeout=900)
        engine = ray.get(ctl.get_engines.remote())[0]
        client = TrainerClient(ctl, timeout_s=600)
        client.init_weight_sync()
        ckpt = root / f"ckpt-{size}"
        ckpt.mkdir(exist_ok=True)
        shutil.copy(mdir / "config.json", ckpt / "config.json")
        version = 0

        def refit(transport: str, staging: str, step: int) -> dict:
            nonlocal version
            version += 1
            ray.get(ctl.update_config.remote(config(staging)), timeout=60)
            params = {k: v + 1e-3 * step for k, v in weights.items()}
            if transport == "path":
                save_file(params, str(ckpt / "model.safetensors"))
                source = str(ckpt)
            else:
                source = params
            idle_from = time.perf_counter()
            time.sleep(idle_s)  # the idle window before the refit (the engine streams its tokens in batches)
            t0 = time.perf_counter()
            report = client.refit(str(version), source, transport=transport)
            t_end = time.perf_counter()
            # The refit's stall is its last stall_s seconds (before: the stage, or nothing).
            t_pause = t_end - report["stall_s"]
            window = (t0, t_pause) if staging == "overlap" else (t_pause, t_end)
            span = window[1] - window[0]
            idle = (idle_from, t0)
            return {**report, "tok_s_window": load.rate(*window), "tok_s_idle": load.rate(*idle), "window_s": span}

        load = Streams(engine, streams)
        load.thread.start()
        refit("collective", "overlap", 0)  # warm-up: first touch of every buffer on both sides
        refit("collective", "inside", 0)
        rows: dict[str, dict[str, list[dict]]] = {t: {"overlap": [], "inside": []} for t in transports}
        for i in range(repeats):
            for transport in transports:
                for staging in (("overlap", "inside") if i % 2 == 0 else ("inside", "overlap")):
                    rows[transport][staging].append(refit(transport, staging, i + 1))
        bad = [r for t in rows.values() for rs in t.values() for r in rs if not r["ok"] or r["requests_aborted"]]
        assert not bad, bad[0]
        med = statistics.median
        out = {"model": size, "bytes": nbytes, "streams": streams, "repeats": repeats, "stream_errors": load.errors[:3]}
        for transport, by_mode in rows.items():
            for staging, rs in by_mode.items():
                out[f"{transport}/{staging}"] = {
                    k: med([r[k] for r in rs]) for k in ("stall_s", "stage_s", "total_s", "load_s", "pause_s",
                                                        "tok_s_window", "tok_s_idle", "window_s")}
                out[f"{transport}/{staging}"]["staging"] = sorted({r["staging"] for r in rs})
        return out
    finally:
        if load is not None:
            load.stop.set()
            load.thread.join(timeout=120)
        try:
            ray.get(fleet.shutdown.remote(), timeout=120)
        finally:
            ray.kill(ctl)
            ray.kill(fleet)


def table(results: list[dict]) -> str:
    rows = ["| model | MB | transport | staging | stall ms | stage s | load ms | total s | tok/s in window | "
            "tok/s idle | window / idle |",
            "|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        for key in [k for k in r if "/" in k]:
            c = r[key]
            transport, staging = key.split("/")
            ratio = c["tok_s_window"] / c["tok_s_idle"] if c["tok_s_idle"] else float("nan")
            rows.append(f"| {r['model']} | {r['bytes'] / 1e6:.0f} | {transport} | {staging} | {1e3 * c['stall_s']:.0f} | "
                        f"{c['stage_s']:.3f} | {1e3 * c['load_s']:.0f} | {c['total_s']:.3f} | {c['tok_s_window']:.0f} | "
                        f"{c['tok_s_idle']:.0f} | {ratio:.2f} |")
    return "\n".join(rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="tiny,1.5g")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--transports", default="collective,path,object_store")
    ap.add_argument("--streams", type=int, default=4, help="streaming generations running the whole time")
    ap.add_argument("--idle-s", type=float, default=2.0,
                    help="the idle window measured before each refit (the engine streams tokens in batches: "
                    "a larger model needs a longer window)")
    ap.add_argument("--models-dir", default=None, help="keep the built models here (default: a temp dir)")
    ap.add_argument("--out", default=None, help="write the raw results as JSON here")
    args = ap.parse_args(argv)

    transports = tuple(t.strip() for t in args.transports.split(","))
    run_over_models(args, "bench-staging-", lambda size, root: bench_one(
        size, root, args.repeats, transports, args.streams, args.idle_s), table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
