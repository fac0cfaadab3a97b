"""Multi-node, for real: two Ray nodes (a separate cluster, in a subprocess), engines placed on the
worker node by ``bundle_resources``, a gloo refit group spanning both nodes, an engine killed on the
worker node healed there on the current weights (tests/multinode_cluster.py does the work, on a
simulated engine: the placement, the group and the heal are the fleet's and the controller's)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


HERE = Path(__file__).resolve().parent


@pytest.mark.cluster
def test_engine_on_the_worker_node_refits_across_nodes_and_heals_there():
    env = {**os.environ, "PYTHONPATH": str(HERE)}
    proc = subprocess.run([sys.executable, str(HERE / "multinode_cluster.py")], capture_output=True, text=True,
                          timeout=900, env=env, start_new_session=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    print(json.dumps({k: out[k] for k in ("start_s", "heal_s", "refit_1")}))
    worker = out["nodes"]["worker"]
    assert out["nodes"]["head"] != worker
    assert out["before"]["slots"] == [[0, 0, worker, "healthy"]]
    assert out["refit_1"]["ok"] and out["after_refit"]["version"] == "mn-1"
    assert out["after_refit"]["checksum"] != out["before"]["checksum"]
    # Healed on the worker node (the slot's placement group), on the current weights.
    assert out["healed"]["slots"] == [[0, 1, worker, "healthy"]]
    assert out["healed"]["pid"] != out["after_refit"]["pid"]
    assert out["healed"]["version"] == "mn-1" and out["healed"]["checksum"] == out["after_refit"]["checksum"]
    assert out["refit_2"]["ok"] and out["after_refit_2"]["version"] == "mn-2"
    assert out["after_refit_2"]["checksum"] != out["healed"]["checksum"]


@pytest.mark.cluster
def test_haproxy_ingress_on_two_nodes_keeps_affinity_and_exact_rollouts_through_a_worker_replica_kill():
    """The ingress of deployments/ and k8s/ (Serve's HAProxy mode) on two nodes: replicas on both,
    a rollout's turns on one replica, a worker-node replica SIGKILLed under agents, nothing lost
    (scripts/drill_two_node.py does the work and prints its result as JSON last)."""
    script = HERE.parent / "scripts" / "drill_two_node.py"
    # Two replicas (one per node: the fewest that put one on each) and 8 x 4 turns: what the drill
    # checks needs no more, and each replica more is a process start (~25 s of the drill's 151 s).
    proc = subprocess.run([sys.executable, str(script), "--json", "--rollouts", "8", "--turns", "4", "--replicas", "2"],
                          capture_output=True, text=True, timeout=600, start_new_session=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    print(json.dumps({k: out[k] for k in ("outcomes", "longest_call_s", "replaced_s", "turns_by_node", "victim",
                                          "victim_rollouts", "moves") if k in out}))
    assert set(out["replicas"].values()) == {"head", "worker"} and out["engines"] == ["worker", "worker"]
    assert out["turns_by_node"]["worker"] > 0 and out["turns_by_node"]["head"] > 0
    assert out["acked"] == 2 * 8 * 4 and out["lost"] == 0 and out["forks"] == 0
    # The victim owned rollouts; each moved once, to a replica that kept it; no rollout moved twice.
    assert out["victim"] and out["replicas"][out["victim"]] == "worker" and out["victim_rollouts"]
    assert all(out["moves"][rid] == 1 for rid in out["victim_rollouts"])
    assert max(out["moves"].values()) == 1
    # Serve replaced the victim; afterwards every rollout stays on one replica.
    assert out["replacement"] and out["replaced_s"] is not None and out["wave2_moves"] == 0
