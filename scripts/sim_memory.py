"""Memory of one simulated engine actor against a bare Ray actor, on a local Ray of its own.

RSS counts every shared library page a process maps in full; PSS shares them out among the
processes that map them (what N actors on one node take together is about N × PSS); USS is the
process's own pages. With ``--without-pyarrow`` the actors' workers cannot import pyarrow (a
shadowing package on their PYTHONPATH), as in a venv without the ``train`` extra: Ray's serializer
imports pyarrow into every worker where it is installed.

    python scripts/sim_memory.py
    python scripts/sim_memory.py --without-pyarrow

Measured idle (after start, before any generation or refit). Everything it starts (its local Ray)
is stopped, also on Ctrl-C.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

from rollout_service.ops.runtime import LOCAL_RAY_ENV, apply_local_env, shutdown_local_ray

apply_local_env()
for _k, _v in LOCAL_RAY_ENV.items():  # no prestarted idle workers sharing (and lowering) the PSS
    os.environ.setdefault(_k, _v)


def memory_mb(pid: int) -> dict[str, float]:
    import psutil

    full = psutil.Process(pid).memory_full_info()
    return {"rss": full.rss / 2**20, "pss": full.pss / 2**20, "uss": full.uss / 2**20}


def arrow_mapped(pid: int) -> bool:
    """Whether the process has pyarrow's library mapped (Ray imports it at a worker's first
    deserialization wherever it is installed)."""
    return "libarrow" in Path(f"/proc/{pid}/maps").read_text()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=os.environ.get("ROLLOUT_SERVICE_TINY_MODEL",
                                                     str(Path("~/.cache/rollout-service/tiny-qwen3").expanduser())))
    p.add_argument("--without-pyarrow", action="store_true", help="the workers cannot import pyarrow")
    args = p.parse_args(argv)

    import ray

    from rollout_service.config import EngineConfig
    from rollout_service.engine.actor import create_engine_actor

    with tempfile.TemporaryDirectory(prefix="sim-memory-") as shadow:
        runtime_env = {}
        if args.without_pyarrow:
            (Path(shadow) / "pyarrow").mkdir()
            (Path(shadow) / "pyarrow" / "__init__.py").write_text(
                'raise ModuleNotFoundError("no pyarrow in this worker", name="pyarrow")\n')
            path = os.pathsep.join(filter(None, [shadow, os.environ.get("PYTHONPATH")]))
            runtime_env = {"env_vars": {"PYTHONPATH": path}}
        ray.init(address="local", num_cpus=2, include_dashboard=False, runtime_env=runtime_env, logging_level="ERROR")
        try:
            @ray.remote(num_cpus=0)
            class Bare:
                def pid(self):
                    return os.getpid()

            bare = Bare.remote()
            bare_pid = ray.get(bare.pid.remote(), timeout=60)
            cfg = EngineConfig(model=args.model, backend="simulated", num_cpus_per_engine=0)
            sim = create_engine_actor(cfg, 0)
            ray.get(sim.start.remote(), timeout=60)
            sim_pid = ray.get(sim.health.remote(), timeout=60)["pid"]
            time.sleep(1)
            rows = [("bare Ray actor", bare_pid), ("simulated engine", sim_pid)]
            rows = [(name, memory_mb(pid), arrow_mapped(pid)) for name, pid in rows]
        finally:
            shutdown_local_ray()
    print("measured idle: after start, before any generation or refit; MB = MiB")
    print("| process | pyarrow loaded | RSS MB | PSS MB | USS MB |\n|---|---|---:|---:|---:|")
    for name, m, arrow in rows:
        print(f"| {name} | {'yes' if arrow else 'no'} | {m['rss']:.0f} | {m['pss']:.0f} | {m['uss']:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
