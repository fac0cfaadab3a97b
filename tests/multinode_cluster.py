"""Two Ray nodes on one machine: engines placed on the worker node by ``engine.bundle_resources``
(the placement option deployments/multi-node-gpu.yaml uses), a gloo refit group spanning both
nodes (trainer on the head), an engine killed on the worker node healed there on the current
weights. The engine is simulated (``engine.backend: simulated``): a real actor process on the
worker node that joins the gloo group and receives every byte, without a model to load them into
(the real engine's gloo refit is tests/test_refit.py's). Run as its own process (``python tests/multinode_cluster.py``; it starts and stops its
own cluster): tests/test_fleet_multinode.py runs it and checks the JSON it prints last.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

from rollout_service.ops.runtime import LOCAL_RAY_ENV, apply_local_env

apply_local_env()
os.environ.update(LOCAL_RAY_ENV)  # no idle workers prestarted on either node

import ray  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402


def main() -> dict:
    from safetensors.torch import load_file

    from rollout_service.config import RolloutServiceConfig
    from rollout_service.fleet.fleet import EngineFleet
    from rollout_service.refit.client import TrainerClient
    from rollout_service.refit.controller import RefitController
    from rollout_service.models.tiny_model import ensure_tiny_model

    sys.path.insert(0, str(Path(__file__).parent))
    from refit_helpers import perturbed

    out: dict = {}
    model = ensure_tiny_model()
    env = {"env_vars": {k: os.environ[k] for k in ("RAY_AUTH_MODE", "RAY_USAGE_STATS_ENABLED",
                                                    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER") if k in os.environ}}
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 4, "include_dashboard": False,
                                                            "node_ip_address": "127.0.0.1"})
    try:
        worker = cluster.add_node(num_cpus=4, resources={"engine_node": 1}, node_ip_address="127.0.0.1")
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, namespace="rollout-service", runtime_env=env, logging_level="WARNING")
        head_id = ray.get_runtime_context().get_node_id()
        out["nodes"] = {"head": head_id, "worker": worker.node_id}
        cfg = RolloutServiceConfig.model_validate({
            "engine": {"model": str(model), "num_engines": 1, "num_cpus_per_engine": 1, "backend": "simulated",
                       "bundle_resources": {"engine_node": 0.5}},
            "refit": {"step_timeout_s": 60},
            "fleet": {"probe_interval_s": 0.5, "probe_timeout_s": 3, "unresponsive_after_s": 6},
        })
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        on_head = NodeAffinitySchedulingStrategy(head_id, soft=False)
        fleet = ray.remote(EngineFleet).options(num_cpus=0, max_concurrency=1000, scheduling_strategy=on_head).remote(
            cfg.model_dump())
        controller = ray.remote(RefitController).options(num_cpus=0, max_concurrency=1000,
                                                         scheduling_strategy=on_head).remote(cfg.model_dump(), fleet)
        t0 = time.monotonic()
        ray.get(controller.start.remote(), timeout=600)
        out["start_s"] = time.monotonic() - t0

        def engine_info():
            view = ray.get(fleet.view.remote())
            stats = ray.get(fleet.stats.remote())
            health = ray.get(view.members[0].handle.health.remote())
            return {"slots": [(s["slot"], s["generation"], s["node_id"], s["state"]) for s in stats["slots"]],
                    "pid": health["pid"], "version": view.version,
                    "checksum": ray.get(view.members[0].handle.collective_rpc.remote("rs_weights_checksum"))[0]}

        out["before"] = engine_info()
        trainer = TrainerClient(controller, timeout_s=60)
        trainer.init_weight_sync()  # trainer (rank 0) on the head node, the engine's worker on the worker node
        base = load_file(str(model / "model.safetensors"))
        report = trainer.refit("mn-1", perturbed(base, seed=31))
        out["refit_1"] = {"ok": report["ok"], "bytes": report["bytes"], "transfer_s": report["transfer_s"]}
        out["after_refit"] = engine_info()

        os.kill(out["after_refit"]["pid"], signal.SIGKILL)
        t0 = time.monotonic()
        while True:
            view = ray.get(fleet.view.remote())
            if view.members and ray.get(fleet.stats.remote())["slots"][0]["generation"] > 0:
                break
            assert time.monotonic() - t0 < 300, "not healed"
            time.sleep(0.25)
        out["heal_s"] = time.monotonic() - t0
        out["healed"] = engine_info()
        trainer.init_weight_sync()
        report = trainer.refit("mn-2", perturbed(base, seed=32))
        out["refit_2"] = {"ok": report["ok"]}
        out["after_refit_2"] = engine_info()
        ray.get(fleet.shutdown.remote(), timeout=60)
        return out
    finally:
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    print(json.dumps(main()), flush=True)
