"""Memory of one simulated engine actor against a bare Ray actor, on a local Ray of its own.

RSS counts every shared library page a process maps in full; PSS shares them out among the
processes that map them (what N actors on one node take together is about N × PSS); USS is the
process's own pages. With ``--without-pyarrow`` the actors' workers cannot import pyarrow (a
shadowing package on their PYTHONPATH), as in a venv without the ``train`` extra: Ray's serializer
imports pyarrow into every worker where it is installed.

    python scripts/sim_memory.py
    python scripts/sim_memory.py --without-pyarrow

Everything it starts (its local Ray) is stopped, also on Ctrl-C.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path


def memory_mb(pid: int) -> dict[str, float]:
    import psutil

    full = psutil.Process(pid).memory_full_info()
    return {"rss": full.rss / 2**20, "pss": full.pss / 2**20, "uss": full.uss / 2**20}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=os.environ.get("ROLLOUT_SERVICE_TINY_MODEL",
                                                     str(Path("~/.cache/rollout-service/tiny-qwen3").expanduser())))
    p.add_argument("--without-pyarrow", action="store_true", help="the workers cannot import pyarrow")
    args = p.parse_args(argv)

    import ray

    from rollout_service.config import EngineConfig
    from rollout_service.engine.replica import create_engine_actor

    with tempfile.TemporaryDirectory(prefix="sim-memory-") as shadow:
        runtime_env = {}
        if args.without_pyarrow:
            (Path(shadow) / "pyarrow").mkdir()
            (Path(shadow) / "pyarrow" / "__init__.py").write_text(
                'raise ModuleNotFoundError("no pyarrow in this worker", name="pyarrow")\n')
            runtime_env = {"env_vars": {"PYTHONPATH": shadow}}
        ray.init(num_cpus=2, include_dashboard=False, runtime_env=runtime_env, logging_level="ERROR")
        try:
            @ray.remote(num_cpus=0)
            class Bare:
                def info(self):
                    return os.getpid(), "pyarrow" in sys.modules

            bare = Bare.remote()
            bare_pid, _ = ray.get(bare.info.remote(), timeout=60)
            cfg = EngineConfig(model=args.model, backend="simulated", num_cpus_per_engine=0)
            sim = create_engine_actor(cfg, 0)
            ray.get(sim.start.remote(), timeout=60)
            sim_pid = ray.get(sim.health.remote(), timeout=60)["pid"]
            time.sleep(1)
            _, arrow = ray.get(bare.info.remote(), timeout=60)  # Ray imports it at a worker's first deserialization
            rows = [("bare Ray actor", memory_mb(bare_pid)), ("simulated engine", memory_mb(sim_pid))]
        finally:
            ray.shutdown()
    print(f"pyarrow in the workers: {arrow}")
    print("| process | RSS MB | PSS MB | USS MB |\n|---|---:|---:|---:|")
    for name, m in rows:
        print(f"| {name} | {m['rss']:.0f} | {m['pss']:.0f} | {m['uss']:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
