"""One placement group per engine: every engine (and every TP worker) gets its own GPUs.

GPU placement is tested without CUDA: Ray schedules declared GPUs (a node started with
``num_gpus=8``) like real ones and sets ``CUDA_VISIBLE_DEVICES`` / ``ray.get_gpu_ids()`` per bundle
(FIELD-NOTES, "Declared GPUs on a CPU machine"). That Ray runs in a subprocess (this session has its
own GPU-less Ray, and a process can ray.init only once): one node with 8 GPUs, later joined by a
second node with a custom resource for the pinning test. The real ``reserve_engine_placement`` and
``create_engine_actor`` start a probe class in place of ``EngineReplica`` (so with the engine's exact
actor options: resources, scheduling strategy, runtime_env, name); for TP > 1 the probe places one
worker per GPU bundle of its *current* placement group with the options vLLM 0.32's
``RayExecutorV2`` gives its workers (num_cpus=0, num_gpus=1, bundle i,
RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES). vLLM itself is not started.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from rollout_service.config import EngineConfig
from rollout_service.fleet.placement import (
    EnginePlacement,
    engine_actor_options,
    engine_bundles,
    reserve_engine_placement,
)

REPO = Path(__file__).resolve().parents[1]

# --------------------------------------------------------------------------- pure: bundles, options


def _gpu(tp: int, **kw) -> EngineConfig:
    return EngineConfig(model="/models/x", device="cuda", tensor_parallel_size=tp, **kw)


def test_gpu_bundles_one_gpu_per_tp_worker_cpus_and_pins_in_bundle_0():
    cfg = _gpu(4, num_cpus_per_engine=2, bundle_resources={"engine_node": 0.01})
    assert engine_bundles(cfg) == [
        {"GPU": 1.0, "CPU": 2.0, "engine_node": 0.01},
        {"GPU": 1.0},
        {"GPU": 1.0},
        {"GPU": 1.0},
    ]
    assert engine_bundles(_gpu(1)) == [{"GPU": 1.0, "CPU": 1.0}]
    assert engine_bundles(_gpu(2, num_cpus_per_engine=0)) == [{"GPU": 1.0}, {"GPU": 1.0}]


def test_cpu_bundle_is_the_engine_cpus_and_nothing_when_there_is_nothing_to_reserve():
    assert engine_bundles(EngineConfig()) == [{"CPU": 1.0}]
    assert engine_bundles(EngineConfig(num_cpus_per_engine=0.5, bundle_resources={"a": 1})) == [{"CPU": 0.5, "a": 1.0}]
    # Ray rejects an all-zero bundle: 0 CPUs and no pins reserve nothing (no placement group).
    assert engine_bundles(EngineConfig(num_cpus_per_engine=0)) == []
    assert engine_bundles(EngineConfig(num_cpus_per_engine=0, bundle_resources={"a": 0.01})) == [{"a": 0.01}]


def test_bundle_resources_and_strategy_are_validated():
    with pytest.raises(ValueError, match="num_cpus_per_engine"):
        EngineConfig(bundle_resources={"CPU": 1})
    with pytest.raises(ValueError, match="> 0"):
        EngineConfig(bundle_resources={"engine_node": 0})
    with pytest.raises(ValueError):
        EngineConfig(placement_strategy="SPREAD")
    assert EngineConfig().placement_strategy == "STRICT_PACK"


def test_cpu_engine_without_pins_keeps_plain_actor_options_and_no_group():
    """The default CPU path is unchanged: no placement group, num_cpus_per_engine CPUs (Ray not touched)."""
    for cfg in (EngineConfig(), EngineConfig(num_cpus_per_engine=0)):
        placement = reserve_engine_placement(cfg, 0, timeout_s=1)
        assert placement.placement_group is None
        assert placement.actor_options == {"num_cpus": cfg.num_cpus_per_engine}
    assert engine_actor_options(_gpu(1)) == {"num_cpus": 1.0, "num_gpus": 1}
    assert engine_actor_options(_gpu(2)) == {"num_cpus": 1.0, "num_gpus": 0}


def test_create_engine_actor_uses_the_placement_options_and_keeps_its_own(monkeypatch):
    import ray

    from rollout_service.engine import replica

    seen: list[dict] = []

    class _Fake:
        def __init__(self, cls):
            self.cls = cls

        def options(self, **opts):
            seen.append(opts)
            return self

        def remote(self, *args):
            return args

    monkeypatch.setattr(ray, "remote", _Fake)
    cfg = _gpu(2)
    strategy = object()
    placement = EnginePlacement("pg", 0, {"num_cpus": 1.0, "num_gpus": 0, "scheduling_strategy": strategy})
    args = replica.create_engine_actor(cfg, 3, placement=placement, name="e3", namespace="ns", lifetime="detached",
                                       initial_weight_version="7")
    assert args == (cfg, 3, "7")
    assert seen[-1] == {
        "num_cpus": 1.0, "num_gpus": 0, "scheduling_strategy": strategy, "runtime_env": replica.engine_runtime_env(cfg),
        "max_concurrency": 10_000, "max_restarts": 0, "enable_task_events": False, "name": "e3", "namespace": "ns",
        "lifetime": "detached",
    }
    replica.create_engine_actor(EngineConfig(), 0)  # no placement: exactly the options it always had
    assert seen[-1] == {"num_cpus": 1.0, "runtime_env": replica.engine_runtime_env(EngineConfig()),
                        "max_concurrency": 10_000, "max_restarts": 0, "enable_task_events": False}


def test_engine_args_use_the_ray_executor_for_tensor_parallel_gpu_engines():
    from rollout_service.engine.replica import EngineReplica

    assert EngineReplica(_gpu(2)).engine_args().distributed_executor_backend == "ray"
    assert EngineReplica(_gpu(1)).engine_args().distributed_executor_backend is None
    assert EngineReplica(EngineConfig(model="/models/x")).engine_args().distributed_executor_backend is None


# --------------------------------------------------------------------------- Ray with declared GPUs

_PROBE = r'''
import json, os, sys, tempfile, time, traceback

from rollout_service.runtime import RAY_ENV, apply_ray_env

apply_ray_env()
import ray
from ray.cluster_utils import Cluster
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rollout_service.config import EngineConfig
from rollout_service.engine import replica
from rollout_service.fleet.placement import PlacementUnavailable, release_engine_placement, reserve_engine_placement

NOSET = "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"


def where():
    ctx = ray.get_runtime_context()
    pg = ray.util.get_current_placement_group()
    return {
        "node": ctx.get_node_id(),
        "gpus": sorted(str(g) for g in ray.get_gpu_ids()),
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "pg": pg.id.hex() if pg else None,
    }


@ray.remote
def worker_where():
    return where()


class EngineProbe:
    """Stands in for EngineReplica: create_engine_actor starts it with the engine's exact options.

    Async methods, as EngineReplica has (max_concurrency=10000 on a threaded actor would mean 10000 threads).
    """

    def __init__(self, config, index, initial_weight_version):
        self.config = config

    async def where(self):
        return where()

    async def probe_tp_workers(self):
        # vllm/v1/executor/ray_executor_v2.py RayExecutorV2._init_executor, on one node: the current
        # placement group (ray_utils.initialize_ray_cluster), its bundles with a GPU in index order
        # (ray_utils.get_bundles_sorted_by_node), the first world_size of them, one worker in each with
        # num_cpus=0, num_gpus=1 and RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES. vLLM's workers are
        # actors; tasks with the same options land in the same bundles and reuse worker processes.
        pg = ray.util.get_current_placement_group()
        gpu_bundles = [i for i, b in enumerate(pg.bundle_specs) if b.get("GPU")]
        refs = [
            worker_where.options(
                num_cpus=0, num_gpus=1, runtime_env={"env_vars": {NOSET: "1"}},
                scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=i),
            ).remote()
            for i in gpu_bundles[: self.config.tensor_parallel_size]
        ]
        return [await r for r in refs]


replica.EngineReplica = EngineProbe  # create_engine_actor looks the class up at call time


def start_engines(config, timeout_s=30.0):
    """What the fleet does: reserve each engine's placement, start the engine actor in it."""
    placements, engines = [], []
    try:
        for i in range(config.num_engines):
            placements.append(reserve_engine_placement(config, i, timeout_s=timeout_s))
        for i, p in enumerate(placements):
            engines.append(replica.create_engine_actor(config, i, placement=p, name=f"probe-engine-{i}-{time.monotonic_ns()}"))
        out = [{"engine": w, "own_pg": p.placement_group.id.hex()}
               for w, p in zip(ray.get([e.where.remote() for e in engines], timeout=90), placements)]
        if config.tensor_parallel_size > 1:
            for o, e in zip(out, engines):  # engine by engine: the worker processes are reused
                o["workers"] = ray.get(e.probe_tp_workers.remote(), timeout=60)
        return out, placements, engines
    except BaseException:
        stop(placements, engines)
        raise


def stop(placements, engines):
    for e in engines:
        ray.kill(e)
    for p in placements:
        release_engine_placement(p)


def expect_unavailable(config, timeout_s):
    t0 = time.monotonic()
    try:
        p = reserve_engine_placement(config, 99, timeout_s=timeout_s)
    except PlacementUnavailable as e:
        return {"error": str(e), "seconds": time.monotonic() - t0}
    release_engine_placement(p)
    return {"error": None, "seconds": time.monotonic() - t0}


def scenario(name, fn):
    t0 = time.monotonic()
    try:
        results[name] = fn()
    except BaseException:
        results[name] = {"traceback": traceback.format_exc()}
    results["seconds"][name] = round(time.monotonic() - t0, 2)


def gpu_config(num_engines, tp, **kw):
    return EngineConfig(model="/models/probe", device="cuda", num_engines=num_engines, tensor_parallel_size=tp, **kw)


def tp2():
    config = gpu_config(4, 2)
    out, placements, engines = start_engines(config)
    try:
        # A fifth engine does not fit while the four hold all 8 GPUs.
        return {"engines": out, "fifth": expect_unavailable(config, 1.5)}
    finally:
        stop(placements, engines)


def tp1():
    out, placements, engines = start_engines(gpu_config(8, 1))
    stop(placements, engines)
    return {"engines": out}


def tp16():
    res = expect_unavailable(gpu_config(1, 16), 1.5)
    res["pg_states"] = sorted({v["state"] for v in ray.util.placement_group_table().values()})
    res["free_gpus_after"] = ray.available_resources().get("GPU", 0)
    return res


def pinned():
    config = gpu_config(1, 2, bundle_resources={"engine_node": 0.01})
    out, placements, engines = start_engines(config)
    try:
        cpu = EngineConfig(model="/models/probe", bundle_resources={"engine_node": 0.01})
        cpu_out, cpu_placements, cpu_engines = start_engines(cpu)
        stop(cpu_placements, cpu_engines)
        # The labelled node's 2 GPUs are taken: a second pinned engine must not go to the head's 8.
        return {"engines": out, "cpu_engines": cpu_out, "second": expect_unavailable(config, 1.5)}
    finally:
        stop(placements, engines)


# One Ray for everything (a Ray start is most of the cost on 2 cores): first a single node with
# 8 declared GPUs, as ray.init(num_gpus=8, num_cpus=8) would start it; then a second node joins
# with 2 GPUs and the custom resource "engine_node" that pinned engines ask for.
results = {"seconds": {}}
node_args = dict(include_dashboard=False, temp_dir=os.environ["PROBE_RAY_TMP"], node_ip_address="127.0.0.1",
                 env_vars={k: os.environ[k] for k in RAY_ENV})
cluster = Cluster()
try:
    t0 = time.monotonic()
    cluster.add_node(num_cpus=8, num_gpus=8, **node_args)
    cluster.connect(namespace="placement-probe")
    results["seconds"]["ray_start"] = round(time.monotonic() - t0, 2)
    scenario("tp2", tp2)
    scenario("tp1", tp1)
    scenario("tp16", tp16)
    t0 = time.monotonic()
    results["labelled_node"] = cluster.add_node(num_cpus=2, num_gpus=2, resources={"engine_node": 1}, **node_args).node_id
    results["seconds"]["add_node"] = round(time.monotonic() - t0, 2)
    scenario("pinned", pinned)
finally:
    ray.shutdown()
    cluster.shutdown()
print("RESULT " + json.dumps(results))
'''


def _start_probe(script: str, directory: Path) -> subprocess.Popen:
    """Run ``script`` in a fresh interpreter with its own Ray (the script stops it, even on failure)."""
    import tempfile

    tmp = tempfile.mkdtemp(prefix="rp", dir="/tmp")  # short: Ray's socket paths must stay < 108 bytes
    os.makedirs(os.path.join(tmp, "ray"))
    path = directory / "probe.py"
    path.write_text(script)
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    # RAY_TMPDIR: Cluster writes ray_current_cluster there, not in /tmp/ray where `ray.init("auto")` looks.
    env.update(PROBE_RAY_TMP=tmp, RAY_TMPDIR=tmp, PYTHONPATH=str(REPO))
    proc = subprocess.Popen([sys.executable, str(path)], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    proc.ray_tmp = tmp  # type: ignore[attr-defined]
    return proc


def _probe_result(proc: subprocess.Popen, timeout_s: float = 150.0) -> dict:
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGINT)  # lets the script's finally stop Ray
        try:
            out, err = proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
        pytest.fail(f"placement probe timed out after {timeout_s}s\n{err[-4000:]}")
    lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, (
        f"probe failed ({proc.returncode}; Ray logs in {proc.ray_tmp})\n{out[-2000:]}\n{err[-6000:]}"
    )
    shutil.rmtree(proc.ray_tmp, ignore_errors=True)
    return json.loads(lines[-1][len("RESULT "):])


@pytest.fixture(scope="module")
def probe(tmp_path_factory):
    return _probe_result(_start_probe(_PROBE, tmp_path_factory.mktemp("placement")))


def _scenario(results: dict, name: str):
    res = results[name]
    assert "traceback" not in res, res["traceback"]
    return res


def test_tp2_engines_get_disjoint_gpu_pairs_and_their_workers_stay_in_their_group(probe):
    res = _scenario(probe, "tp2")
    engines = res["engines"]
    assert len(engines) == 4
    used: list[str] = []
    for e in engines:
        me, workers = e["engine"], e["workers"]
        assert me["pg"] == e["own_pg"]  # vLLM finds the group through get_current_placement_group()
        assert me["gpus"] == []  # the engine actor holds no GPU itself (num_gpus=0)
        assert len(workers) == 2
        assert all(len(w["gpus"]) == 1 and w["pg"] == e["own_pg"] and w["node"] == me["node"] for w in workers)
        assert all(w["cuda_visible_devices"] is None for w in workers)  # NOSET, as vLLM's workers
        pair = [w["gpus"][0] for w in workers]
        assert len(set(pair)) == 2, pair
        used += pair
    assert sorted(used) == [str(i) for i in range(8)]  # no GPU twice, TP groups disjoint


def test_tp1_engines_each_see_exactly_their_own_gpu(probe):
    engines = _scenario(probe, "tp1")["engines"]
    assert len(engines) == 8
    gpus = []
    for e in engines:
        me = e["engine"]
        assert me["pg"] == e["own_pg"] and len(me["gpus"]) == 1
        assert me["cuda_visible_devices"] == me["gpus"][0]
        gpus += me["gpus"]
    assert sorted(gpus) == [str(i) for i in range(8)]


def test_engine_that_does_not_fit_fails_within_the_timeout_naming_its_bundles(probe):
    fifth = _scenario(probe, "tp2")["fifth"]
    assert fifth["error"] and 1.4 <= fifth["seconds"] < 1.5 + 5
    assert "2 bundles" in fifth["error"] and "STRICT_PACK" in fifth["error"]
    res = _scenario(probe, "tp16")
    assert res["error"] and 1.4 <= res["seconds"] < 1.5 + 5, res
    assert "engine 99" in res["error"] and "16 bundles" in res["error"] and "{'GPU': 1.0" in res["error"]
    assert "tensor_parallel_size 16" in res["error"]
    assert res["pg_states"] == ["REMOVED"]  # the pending group is not left behind
    assert res["free_gpus_after"] == 8


def test_bundle_resources_pin_the_engine_group_to_the_labelled_node(probe):
    res = _scenario(probe, "pinned")
    node = probe["labelled_node"]
    (engine,) = res["engines"]
    assert engine["engine"]["node"] == node
    assert [w["node"] for w in engine["workers"]] == [node, node]
    assert sorted(w["gpus"][0] for w in engine["workers"]) == ["0", "1"]
    (cpu_engine,) = res["cpu_engines"]
    assert cpu_engine["engine"]["node"] == node and cpu_engine["engine"]["pg"] == cpu_engine["own_pg"]
    assert res["second"]["error"] and "engine_node" in res["second"]["error"], res["second"]


def test_probe_timings_are_reported(probe):
    """Not a check of speed: the timings land in the test log (-rA / -s) for the record."""
    print("placement probe seconds:", probe["seconds"])
    assert set(probe["seconds"]) >= {"ray_start", "tp2", "tp1", "tp16", "add_node", "pinned"}
