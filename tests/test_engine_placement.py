"""One placement group per engine: every engine (and every TP worker) gets its own GPUs.

GPU placement is tested without CUDA: Ray schedules declared GPUs (a node started with
``num_gpus=8``) like real ones and sets ``CUDA_VISIBLE_DEVICES`` / ``ray.get_gpu_ids()`` per bundle
(FIELD-NOTES, "Declared GPUs on a CPU machine"). That Ray runs in a subprocess (this session has its
own GPU-less Ray, and a process can ray.init only once): two nodes with 8 GPUs each, later joined
by a third node (2 GPUs and a custom resource) for the pinning test. The real ``EngineFleet`` (in
the probe's driver) starts 6 engines x TP 2 and 3 engines x TP 4 through the real
``reserve_engine_placement`` and ``create_engine_actor``, with a probe class in place of
``EngineReplica`` (so with the engine's exact actor options: resources, scheduling strategy,
runtime_env, name); for TP > 1 the probe starts one worker actor per GPU bundle of its *current*
placement group with the options vLLM 0.32's ``RayExecutorV2`` gives its ``RayWorkerProc`` workers
(num_cpus=0, num_gpus=1, bundle i, RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES), each reporting its
node, GPU ids and ``CUDA_VISIBLE_DEVICES``. One engine of each fleet is killed and replaced by the
fleet; then the fleet stops. vLLM itself is not started.
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

    from rollout_service.engine import actor

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
    args = actor.create_engine_actor(cfg, 3, placement=placement, name="e3", namespace="ns", lifetime="detached",
                                       initial_weight_version="7")
    assert args == (cfg, 3, "7")
    assert seen[-1] == {
        "num_cpus": 1.0, "num_gpus": 0, "scheduling_strategy": strategy, "runtime_env": actor.engine_runtime_env(cfg),
        "max_concurrency": 10_000, "max_restarts": 0, "enable_task_events": False, "name": "e3", "namespace": "ns",
        "lifetime": "detached",
    }
    actor.create_engine_actor(EngineConfig(), 0)  # no placement: exactly the options it always had
    assert seen[-1] == {"num_cpus": 1.0, "runtime_env": actor.engine_runtime_env(EngineConfig()),
                        "max_concurrency": 10_000, "max_restarts": 0, "enable_task_events": False}


def test_engine_args_use_the_ray_executor_for_tensor_parallel_gpu_engines():
    from rollout_service.engine.replica import EngineReplica

    assert EngineReplica(_gpu(2)).engine_args().distributed_executor_backend == "ray"
    assert EngineReplica(_gpu(1)).engine_args().distributed_executor_backend is None
    assert EngineReplica(EngineConfig(model="/models/x")).engine_args().distributed_executor_backend is None


# --------------------------------------------------------------------------- Ray with declared GPUs

_PROBE = r'''
import asyncio, json, os, sys, tempfile, time, traceback

from rollout_service.ops.runtime import LOCAL_RAY_ENV, RAY_ENV, apply_ray_env

apply_ray_env()
os.environ.update(LOCAL_RAY_ENV)  # no idle workers prestarted on the nodes: the probe starts its actors
import ray
from ray.cluster_utils import Cluster
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rollout_service.config import EngineConfig, RolloutServiceConfig
from rollout_service.engine import actor
from rollout_service.fleet.fleet import EngineFleet
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
class WorkerProbe:
    """Stands in for vLLM's RayWorkerProc: an actor holding its bundle's GPU for as long as it lives."""

    def where(self):
        return where()


class EngineProbe:
    """Stands in for EngineReplica: create_engine_actor starts it with the engine's exact options, the
    fleet drives it (start, process_info, weight_version, health, shutdown) as it drives an engine.

    Async methods, as EngineReplica has (max_concurrency=10000 on a threaded actor would mean 10000 threads).
    """

    def __init__(self, config, index, initial_weight_version):
        self.config, self.index, self.version = config, index, initial_weight_version
        self.workers = []

    async def start(self):
        # vllm/v1/executor/ray_executor_v2.py RayExecutorV2._init_executor, on one node: the current
        # placement group (ray_utils.initialize_ray_cluster), its bundles with a GPU in index order
        # (ray_utils.get_bundles_sorted_by_node), one RayWorkerProc actor per bundle with num_cpus=0,
        # num_gpus=1, PlacementGroupSchedulingStrategy(pg, bundle i) and
        # RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES. TP 1: the uni executor, no worker actor.
        if self.config.device == "cuda" and self.config.tensor_parallel_size > 1:
            pg = ray.util.get_current_placement_group()
            gpu_bundles = [i for i, b in enumerate(pg.bundle_specs) if b.get("GPU")]
            self.workers = [
                WorkerProbe.options(
                    num_cpus=0, num_gpus=1, runtime_env={"env_vars": {NOSET: "1"}},
                    scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=i),
                ).remote()
                for i in gpu_bundles[: self.config.tensor_parallel_size]
            ]
            await asyncio.gather(*[w.where.remote() for w in self.workers])
        return 0.0

    async def where(self):
        out = where()
        out["workers"] = list(await asyncio.gather(*[w.where.remote() for w in self.workers]))
        return out

    async def process_info(self):
        return {"node_id": ray.get_runtime_context().get_node_id(), "processes": []}

    async def open_channel(self):
        return None  # no engine, no data channel: the fleet's members then have none (Ray calls)

    async def weight_version(self):
        return self.version

    async def health(self):
        return {"index": self.index, "in_flight": 0, "pid": os.getpid()}

    def shutdown(self):
        pass


actor.EngineReplica = EngineProbe  # create_engine_actor looks the class up at call time

# Small thresholds: a killed engine is seen and replaced in a second or two.
FLEET = {"probe_interval_s": 0.3, "probe_timeout_s": 5.0, "dead_after_failures": 3, "unresponsive_after_s": 30.0,
         "backoff_initial_s": 0.2, "max_replacements": 20, "replacement_window_s": 3600}


def fleet_config(num_engines, tp, start_timeout_s=120.0):
    return RolloutServiceConfig.model_validate({
        "engine": {"model": "/models/probe", "device": "cuda", "num_engines": num_engines, "tensor_parallel_size": tp},
        "fleet": {**FLEET, "start_timeout_s": start_timeout_s},
    })


def free_gpus():
    return ray.available_resources().get("GPU", 0)


def group_states(ids):
    table = ray.util.placement_group_table()
    return sorted({table[i]["state"] for i in ids if i in table})


async def engines_where(fleet):
    return [await s.actor.where.remote() for s in fleet.slots]


async def wait_for(cond, timeout_s, what):
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout_s:
            raise TimeoutError(what)
        await asyncio.sleep(0.1)


async def fleet_scenario(num_engines, tp, replace_slot=None):
    """The real EngineFleet (in this driver) starts num_engines x TP engines; optionally one is killed
    and the fleet replaces it; then the fleet stops. Placement, GPUs and the groups' fate at each step."""
    fleet = EngineFleet(fleet_config(num_engines, tp))
    out = {}
    try:
        await fleet.start()
        out["serving"] = fleet.health.serving()
        out["engines"] = await engines_where(fleet)
        out["own_pgs"] = [s.placement.placement_group.id.hex() for s in fleet.slots]
        out["free_gpus_running"] = free_gpus()
        if replace_slot is not None:
            s = fleet.slots[replace_slot]
            old = s.actor
            generation = fleet.health.slots[replace_slot].generation
            ray.kill(old, no_restart=True)
            t0 = time.monotonic()
            await wait_for(lambda: fleet.health.slots[replace_slot].generation > generation
                           and replace_slot in fleet.health.serving(), 120, "replacement not serving")
            out["replace_s"] = round(time.monotonic() - t0, 2)
            out["replaced"] = await fleet.slots[replace_slot].actor.where.remote()
            out["replaced_pg"] = fleet.slots[replace_slot].placement.placement_group.id.hex()
            out["free_gpus_after_replacement"] = free_gpus()
    finally:
        ids = [s.placement.placement_group.id.hex() for s in fleet.slots if s.placement and s.placement.placement_group]
        await fleet.shutdown()
    await wait_for(lambda: free_gpus() == 16, 30, "GPUs not released after the fleet stopped")
    out["free_gpus_after_stop"] = free_gpus()
    out["pg_states_after_stop"] = group_states(ids)
    return out


def tp2_fleet():
    return asyncio.run(fleet_scenario(6, 2, replace_slot=1))


def tp4_fleet():
    return asyncio.run(fleet_scenario(3, 4, replace_slot=0))


def start_engines(config, timeout_s=30.0):
    """What the fleet does, without it: reserve each engine's placement, start the engine actor in it."""
    placements, engines = [], []
    try:
        for i in range(config.num_engines):
            placements.append(reserve_engine_placement(config, i, timeout_s=timeout_s))
        for i, p in enumerate(placements):
            engines.append(actor.create_engine_actor(config, i, placement=p, name=f"probe-engine-{i}-{time.monotonic_ns()}"))
        ray.get([e.start.remote() for e in engines], timeout=90)
        out = [{"engine": w, "own_pg": p.placement_group.id.hex()}
               for w, p in zip(ray.get([e.where.remote() for e in engines], timeout=90), placements)]
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


def two_tp2():
    out, placements, engines = start_engines(gpu_config(2, 2))
    stop(placements, engines)
    return {"nodes": [e["engine"]["node"] for e in out]}


def tp1():
    out, placements, engines = start_engines(gpu_config(8, 1))
    stop(placements, engines)
    return {"engines": out}


def hold_every_gpu():
    """Four TP-4 engines' placement groups take both nodes' 16 GPUs (reserved as the fleet reserves
    them; no engine actors needed to hold them)."""
    config = gpu_config(4, 4)
    return [reserve_engine_placement(config, i, timeout_s=30.0) for i in range(config.num_engines)]


def does_not_fit():
    res = {}
    # Both nodes held: a TP-2 engine more has nowhere to go.
    placements = hold_every_gpu()
    try:
        res["full"] = expect_unavailable(gpu_config(1, 2), 1.5)
    finally:
        stop(placements, [])
    # TP 16 on nodes of 8 GPUs never fits (STRICT_PACK): the raw reservation (logging why while it
    # waits, here after 0.5 s instead of a minute) ...
    import logging
    from rollout_service.fleet import placement as placement_module

    class Keep(logging.Handler):
        def emit(self, record):
            warnings.append(record.getMessage())

    warnings = []
    placement_module.logger.addHandler(Keep())
    placement_module.PENDING_WARNING_S = 0.5
    try:
        res["tp16"] = expect_unavailable(gpu_config(1, 16), 1.5)
    finally:
        placement_module.PENDING_WARNING_S = 60.0
    res["tp16"]["warnings"] = warnings
    res["pg_states"] = sorted({v["state"] for v in ray.util.placement_group_table().values()})
    res["free_gpus_after"] = free_gpus()

    # ... and the fleet's start: an error naming the group, after fleet.start_timeout_s, not a hang.
    async def fleet_start():
        fleet = EngineFleet(fleet_config(1, 16, start_timeout_s=2.0))
        t0 = time.monotonic()
        try:
            await fleet.start()
            return {"error": None, "seconds": time.monotonic() - t0}
        except RuntimeError as e:
            return {"error": str(e), "seconds": time.monotonic() - t0}
        finally:
            await fleet.shutdown()

    res["fleet"] = asyncio.run(fleet_start())
    res["free_gpus_after_fleet"] = free_gpus()
    return res


def abandoned():
    """An engine start cancelled while its group waits for GPUs (fleet stop, config restart): the
    reservation thread goes on, and the group it gets once GPUs free up must be removed, not kept."""
    from rollout_service.fleet.bring_up import reserve

    placements = hold_every_gpu()

    async def run():
        task = asyncio.ensure_future(reserve(gpu_config(1, 2), 7, 60.0))
        await asyncio.sleep(0.5)
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass
        stop(placements, [])  # the GPUs free up: the abandoned group is placed, then removed
        deadline = time.monotonic() + 30
        while True:
            states = sorted({v["state"] for v in ray.util.placement_group_table().values()})
            if (states == ["REMOVED"] and free_gpus() == 16) or time.monotonic() > deadline:
                return {"pg_states": states, "free_gpus": free_gpus(), "cancelled": task.cancelled()}
            await asyncio.sleep(0.2)

    return asyncio.run(run())


def pinned():
    config = gpu_config(1, 2, bundle_resources={"engine_node": 0.01})
    out, placements, engines = start_engines(config)
    try:
        cpu = EngineConfig(model="/models/probe", bundle_resources={"engine_node": 0.01})
        cpu_out, cpu_placements, cpu_engines = start_engines(cpu)
        stop(cpu_placements, cpu_engines)
        # The labelled node's 2 GPUs are taken: a second pinned engine must not go to the 8-GPU nodes.
        return {"engines": out, "cpu_engines": cpu_out, "second": expect_unavailable(config, 1.5)}
    finally:
        stop(placements, engines)


# One Ray for everything (a Ray start is most of the cost on 2 cores): two nodes with 8 declared GPUs
# each, as `ray start --num-gpus 8` would start them on two machines; later a third node joins with
# 2 GPUs and the custom resource "engine_node" that pinned engines ask for.
results = {"seconds": {}}
node_args = dict(include_dashboard=False, temp_dir=os.environ["PROBE_RAY_TMP"], node_ip_address="127.0.0.1",
                 env_vars={k: os.environ[k] for k in (*RAY_ENV, *LOCAL_RAY_ENV)})
cluster = Cluster()
try:
    t0 = time.monotonic()
    results["gpu_nodes"] = [cluster.add_node(num_cpus=8, num_gpus=8, **node_args).node_id for _ in range(2)]
    cluster.connect(namespace="placement-probe")
    cluster.wait_for_nodes()
    results["seconds"]["ray_start"] = round(time.monotonic() - t0, 2)
    scenario("tp2_fleet", tp2_fleet)
    scenario("tp4_fleet", tp4_fleet)
    scenario("two_tp2", two_tp2)
    scenario("tp1", tp1)
    scenario("does_not_fit", does_not_fit)
    scenario("abandoned", abandoned)
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


def _probe_result(proc: subprocess.Popen, timeout_s: float = 480.0) -> dict:
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
def placement_probe(tmp_path_factory):
    return _probe_result(_start_probe(_PROBE, tmp_path_factory.mktemp("placement")))


def _scenario(results: dict, name: str):
    res = results[name]
    assert "traceback" not in res, res["traceback"]
    return res


def _check_engines(probe: dict, engines: list[dict], own_pgs: list[str], tp: int) -> dict[str, int]:
    """Each engine in its own group, its TP workers' GPUs on the engine's node, no GPU twice in the
    cluster; returns engines per node."""
    nodes = set(probe["gpu_nodes"])
    assert len(set(own_pgs)) == len(own_pgs)  # one placement group per engine
    used: list[tuple[str, str]] = []
    per_node: dict[str, int] = {}
    for e, pg in zip(engines, own_pgs):
        workers = e["workers"]
        assert e["pg"] == pg  # vLLM finds the group through get_current_placement_group()
        assert e["gpus"] == []  # the engine actor holds no GPU itself (num_gpus=0)
        assert len(workers) == tp
        assert all(w["pg"] == pg and len(w["gpus"]) == 1 for w in workers)
        assert {w["node"] for w in workers} == {e["node"]} and e["node"] in nodes  # one node per engine
        assert all(w["cuda_visible_devices"] is None for w in workers)  # NOSET, as vLLM's workers
        used += [(w["node"], w["gpus"][0]) for w in workers]
        per_node[e["node"]] = per_node.get(e["node"], 0) + 1
    assert len(set(used)) == len(used) == len(engines) * tp, used  # no GPU shared between engines
    return per_node


def _check_fleet(probe: dict, name: str, num_engines: int, tp: int, replaced: int) -> dict:
    res = _scenario(probe, name)
    assert res["serving"] == list(range(num_engines))
    per_node = _check_engines(probe, res["engines"], res["own_pgs"], tp)
    # The engines need more GPUs than one node has: they are on both nodes (how many on each is Ray's
    # choice; no node holds more than its 8 GPUs allow, checked above as no GPU twice).
    assert len(per_node) == 2, per_node
    assert res["free_gpus_running"] == 16 - num_engines * tp
    # Replacement: the killed engine's workers are gone and their GPUs free again (no hang waiting for
    # them); the new engine starts in the slot's kept placement group: same node, same GPUs.
    before, after = res["engines"][replaced], res["replaced"]
    assert res["replaced_pg"] == res["own_pgs"][replaced] == after["pg"]
    assert after["node"] == before["node"]
    assert sorted(w["gpus"][0] for w in after["workers"]) == sorted(w["gpus"][0] for w in before["workers"])
    assert res["free_gpus_after_replacement"] == res["free_gpus_running"]  # nothing leaked, nothing doubled
    # Stopped: every group removed, every GPU back.
    assert res["pg_states_after_stop"] == ["REMOVED"] and res["free_gpus_after_stop"] == 16
    return res


def test_six_tp2_engines_on_two_8_gpu_nodes_one_node_each_no_shared_gpu_replaced_in_their_group(placement_probe):
    _check_fleet(placement_probe, "tp2_fleet", 6, 2, replaced=1)


def test_three_tp4_engines_on_two_8_gpu_nodes_one_node_each_no_shared_gpu_replaced_in_their_group(placement_probe):
    _check_fleet(placement_probe, "tp4_fleet", 3, 4, replaced=0)


def test_engines_that_fit_one_node_are_still_spread_over_the_nodes(placement_probe):
    """deployments/multi-node-gpu.yaml says Ray spreads the engines' groups over the nodes: two TP-2
    engines that would both fit one 8-GPU node land on two (Ray 2.60's placement group scheduling)."""
    nodes = _scenario(placement_probe, "two_tp2")["nodes"]
    assert len(set(nodes)) == 2 and set(nodes) == set(placement_probe["gpu_nodes"]), nodes


def test_tp1_engines_each_see_exactly_their_own_gpu(placement_probe):
    engines = _scenario(placement_probe, "tp1")["engines"]
    assert len(engines) == 8
    gpus = []
    for e in engines:
        me = e["engine"]
        assert me["pg"] == e["own_pg"] and len(me["gpus"]) == 1 and me["workers"] == []
        assert me["cuda_visible_devices"] == me["gpus"][0]
        gpus.append((me["node"], me["gpus"][0]))
    assert len(set(gpus)) == 8


def test_engine_that_does_not_fit_fails_within_the_timeout_naming_its_bundles(placement_probe):
    res = _scenario(placement_probe, "does_not_fit")
    full = res["full"]
    assert full["error"] and 1.4 <= full["seconds"] < 1.5 + 5, full
    assert "2 bundles" in full["error"] and "STRICT_PACK" in full["error"]
    tp16 = res["tp16"]
    assert tp16["error"] and 1.4 <= tp16["seconds"] < 1.5 + 5, tp16
    assert "engine 99" in tp16["error"] and "16 bundles" in tp16["error"] and "{'GPU': 1.0" in tp16["error"]
    assert "tensor_parallel_size 16" in tp16["error"]
    (warning,) = tp16["warnings"]  # logged while it still waited
    assert "still pending after 0.5s" in warning and "16 bundles" in warning and "tensor_parallel_size 16" in warning
    assert res["pg_states"] == ["REMOVED"]  # no pending group is left behind
    assert res["free_gpus_after"] == 16
    # The fleet's start ends with that error (fleet.start_timeout_s), it does not wait forever.
    fleet = res["fleet"]
    assert fleet["error"] and fleet["seconds"] < 2.0 + 30, fleet
    assert "no engine could be started" in fleet["error"] and "16 bundles" in fleet["error"], fleet
    assert res["free_gpus_after_fleet"] == 16


def test_a_group_reserved_for_a_cancelled_engine_start_is_removed_once_placed(placement_probe):
    res = _scenario(placement_probe, "abandoned")
    assert res["cancelled"] and res["pg_states"] == ["REMOVED"] and res["free_gpus"] == 16, res


def test_bundle_resources_pin_the_engine_group_to_the_labelled_node(placement_probe):
    res = _scenario(placement_probe, "pinned")
    node = placement_probe["labelled_node"]
    (engine,) = res["engines"]
    assert engine["engine"]["node"] == node
    assert [w["node"] for w in engine["engine"]["workers"]] == [node, node]
    assert sorted(w["gpus"][0] for w in engine["engine"]["workers"]) == ["0", "1"]
    (cpu_engine,) = res["cpu_engines"]
    assert cpu_engine["engine"]["node"] == node and cpu_engine["engine"]["pg"] == cpu_engine["own_pg"]
    assert res["second"]["error"] and "engine_node" in res["second"]["error"], res["second"]


def test_probe_timings_are_reported(placement_probe):
    """Not a check of speed: the timings land in the test log (-rA / -s) for the record."""
    print("placement probe seconds:", placement_probe["seconds"])
    print("two TP-2 engines on nodes:", placement_probe["two_tp2"]["nodes"], "of", placement_probe["gpu_nodes"])
    for name in ("tp2_fleet", "tp4_fleet"):
        print(name, "engines per node:", [e["node"][:8] for e in placement_probe[name]["engines"]],
              "replacement seconds:", placement_probe[name].get("replace_s"))
    assert set(placement_probe["seconds"]) >= {"ray_start", "tp2_fleet", "tp4_fleet", "tp1", "does_not_fit", "add_node", "pinned"}
