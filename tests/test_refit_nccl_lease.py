"""The NCCL refit path on a real CPU engine, short of vLLM's NCCL calls themselves.

vLLM's NCCL weight transfer needs GPUs. Here the engine fleet runs a real CPU engine, and the
refit controller is configured as a GPU service is (``engine.device: cuda``, ``refit.backend:
nccl``): it drives that engine exactly as it would drive GPU engines. Only vLLM's NCCL calls are
stand-ins: on the engine side the controller's fan-out of vLLM's weight-transfer worker methods
(``NcclStandInController`` below records what every engine would receive and runs a CPU worker
method instead), on the trainer side vLLM's NCCL rendezvous and packed broadcast (replaced in
vLLM's module). Everything else is real: ``TrainerClient`` learning the backend, bucket size and
timeout from the controller's config, vLLM's ``NCCLTrainerWeightTransferEngine`` driving our
``ControllerWeightSyncClient``, and the controller's pause, lease, label and resume.

A trainer that dies in the middle of a round leaves no engine paused: the round runs under a lease
the trainer renews with every call; when it runs out, every engine reloads its last committed
weights and resumes, the lock and the fleet's refit bracket are released.

Each round is recorded once on the metrics endpoint, as a refit over the other transports is: its
outcome, phases, stall and bytes; a start refused while a round runs counts as rejected.
"""

from __future__ import annotations

import asyncio
import sys
import time

import pytest
import ray
from ray import cloudpickle

from rollout_service.refit.controller import RefitController


cloudpickle.register_pickle_by_value(sys.modules[__name__])  # Ray workers cannot import test modules

LEASE_S = 2.0
BUCKET_BYTES = 4 * 1024 * 1024  # the service's refit.bucket_bytes: vLLM's packed buffer size on the NCCL path


class NcclStandInController(RefitController):
    """The real controller; only the fan-out of vLLM's weight-transfer worker methods (NCCL on a GPU)
    is a stand-in: it records what each engine would receive, and whether the engines were paused,
    then runs a worker method that works on CPU on every engine. After :meth:`load_on_next_update`,
    the next ``update_weights`` really changes the engines' weights (from a checkpoint directory),
    as vLLM's layerwise load in place does, and records their checksums right after."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.fan_outs: list[tuple[str, list, list[bool]]] = []
        self.refuse: str | None = None
        self.update_from: str | None = None
        self.after_update: list[str] | None = None

    async def _nccl_fan_out(self, engines, method: str, kwargs=None) -> None:
        per_engine = kwargs if isinstance(kwargs, list) else [kwargs] * len(engines)
        paused = [await e.is_paused.remote() for e in engines]
        self.fan_outs.append((method, per_engine, paused))
        if method == self.refuse:
            self.refuse = None
            raise RuntimeError(f"{method} refused by the worker (stand-in)")
        if method == "rs_nccl_update" and self.update_from is not None:
            path, self.update_from = self.update_from, None
            await asyncio.gather(*[e.collective_rpc.remote("rs_reload_from_path", args=(path,)) for e in engines])
            sums = await asyncio.gather(*[e.collective_rpc.remote("rs_weights_checksum") for e in engines])
            self.after_update = [c for per_engine in sums for c in per_engine]
            return
        await asyncio.gather(*[e.collective_rpc.remote("rs_weights_checksum") for e in engines])

    def load_on_next_update(self, path: str) -> None:
        self.update_from = path

    def checksums_after_update(self) -> list[str] | None:
        return self.after_update

    def recorded_fan_outs(self) -> list[tuple[str, list, list[bool]]]:
        return self.fan_outs

    def refuse_next(self, method: str) -> None:
        """The next fan-out of ``method`` fails on the workers, as vLLM's worker refusing it would."""
        self.refuse = method


@pytest.fixture(scope="module")
def rig(refit_controller, tiny_model_dir):
    """The stand-in controller, configured as a GPU service's, over the CPU engine fleet of
    ``refit_controller`` (tests/test_refit.py's: one engine start less), on whatever version that
    fleet serves."""
    from rollout_service.config import RolloutServiceConfig

    refit = {"step_timeout_s": 30, "lease_s": LEASE_S, "bucket_bytes": BUCKET_BYTES}
    gpu_service = RolloutServiceConfig.model_validate(
        {"engine": {"model": str(tiny_model_dir), "device": "cuda"}, "refit": {**refit, "backend": "nccl"}})
    fleet = refit_controller.fleet_handle
    controller = ray.remote(NcclStandInController).options(num_cpus=0, max_concurrency=1000).remote(
        gpu_service.model_dump(), fleet)
    ray.get(controller.start.remote(), timeout=600)
    yield controller, fleet
    ray.kill(controller)


@pytest.fixture(scope="module")
def other_weights(tiny_model_dir, tmp_path_factory):
    """A checkpoint directory with weights other than the engines' (and vLLM's update info for them)."""
    import shutil

    from safetensors.torch import load_file, save_file

    from refit_helpers import perturbed

    ckpt = tmp_path_factory.mktemp("nccl") / "ckpt"
    shutil.copytree(tiny_model_dir, ckpt)
    weights = perturbed(load_file(str(ckpt / "model.safetensors")), seed=61)
    save_file(weights, str(ckpt / "model.safetensors"))
    info = {"names": list(weights), "dtype_names": [str(t.dtype).split(".")[-1] for t in weights.values()],
            "shapes": [list(t.shape) for t in weights.values()]}
    return str(ckpt), info


def _worker_init_info(world_size: int) -> dict:
    """What vLLM's trainer engine sends for the workers (rank_offset 1: after the trainer)."""
    from vllm.distributed.weight_transfer.nccl_common import NCCLWeightTransferInitInfo, worker_init_payload

    return worker_init_payload(NCCLWeightTransferInitInfo(master_address="127.0.0.1", master_port=29500,
                                                          rank_offset=1, world_size=world_size, packed=True))


async def test_an_abandoned_nccl_round_resumes_every_engine_when_its_lease_runs_out(rig, other_weights):
    """The trainer dies after vLLM loaded part of a new state dict in place: the lease runs out, every
    engine gets the committed weights back and is resumed."""
    from rollout_service.refit.types import RefitFailed, RefitInProgress

    controller, fleet = rig
    engine = (await controller.get_engines.remote())[0]
    checksum = await controller.weights_checksums.remote()
    before = await controller.stats.remote()
    await controller.nccl_init_weight_transfer_engine.remote(_worker_init_info(world_size=2))
    await controller.nccl_start_weight_update.remote()
    assert await engine.is_paused.remote() and (await fleet.stats.remote())["refitting"]
    with pytest.raises(RefitInProgress):
        await controller.nccl_start_weight_update.remote()
    path, info = other_weights
    await controller.load_on_next_update.remote(path)
    await controller.nccl_update_weights.remote(info)  # the engines now hold other weights
    changed = await controller.checksums_after_update.remote()
    assert changed and all(c != checksum[0] for c in changed), "precondition: the update changed the weights"
    t0 = time.monotonic()
    # The trainer dies here: no finish, no renewal.
    while await engine.is_paused.remote():
        assert time.monotonic() - t0 < LEASE_S + 10, "engines still paused after the lease ran out"
        await asyncio.sleep(0.1)
    released_s = time.monotonic() - t0
    print(f"lease {LEASE_S}s: engines resumed {released_s:.1f}s after the trainer's last call")
    assert released_s >= LEASE_S - 0.5
    stats = await controller.stats.remote()
    assert not stats["refitting"] and stats["num_failed_refits"] == before["num_failed_refits"] + 1
    assert stats["weight_version"] == before["weight_version"]
    assert not (await fleet.stats.remote())["refitting"]
    assert await controller.weights_checksums.remote() == checksum  # reloaded the committed weights
    # A late call of the dead trainer's round is refused; a new round can start.
    with pytest.raises(RefitFailed, match="no NCCL weight update in progress"):
        await controller.nccl_update_weights.remote({})
    await controller.nccl_start_weight_update.remote()
    await controller.nccl_finish_weight_update.remote("lease-1")
    assert not await engine.is_paused.remote() and await engine.weight_version.remote() == "lease-1"


def test_trainer_client_runs_an_nccl_refit_configured_by_the_service(rig, tiny_model_dir, monkeypatch):
    """TrainerClient() with no arguments on a refit.backend: nccl service: init_weight_sync() picks
    NCCL, vLLM's trainer engine hands every engine worker init info vLLM's own worker parses (with
    the service's bucket size), and a refit runs the round start -> update || broadcast -> finish
    with the engines paused (keep), then labels the version and resumes them."""
    import vllm.distributed.weight_transfer.nccl_engine as vllm_wt
    from safetensors.torch import load_file

    from rollout_service.refit.client import TrainerClient

    controller, fleet = rig
    rendezvous, broadcast = [], []
    monkeypatch.setattr(vllm_wt, "open_trainer_endpoint", lambda info: rendezvous.append(info) or "nccl-group")

    def packed_broadcast(iterator, group, src, post_iter_func, buffer_size_bytes, num_buffers):
        assert group == "nccl-group" and src == 0 and buffer_size_bytes == BUCKET_BYTES
        broadcast.extend((name, post_iter_func((name, t)).dtype) for name, t in iterator)

    monkeypatch.setattr(vllm_wt, "packed_nccl_broadcast_producer", packed_broadcast)
    already = len(ray.get(controller.recorded_fan_outs.remote()))
    before = ray.get(controller.stats.remote())

    client = TrainerClient(controller)  # nothing explicit: the service's refit section decides
    assert client.settings().backend == "nccl" and client.settings().bucket_bytes == BUCKET_BYTES
    info = client.init_weight_sync()
    assert info["backend"] == "nccl" and info["world_size"] == 2 and info["bucket_bytes"] == BUCKET_BYTES
    (trainer_side,) = rendezvous
    assert (trainer_side.rank, trainer_side.world_size, trainer_side.master_port) == (0, 2, info["port"])

    (init,) = ray.get(controller.recorded_fan_outs.remote())[already:]
    method, per_engine, _ = init
    assert method == "init_weight_transfer_engine"
    worker = vllm_wt.NCCLWeightTransferEngine.init_info_cls(**per_engine[0]["init_info"])  # as the worker parses it
    assert (worker.master_address, worker.master_port) == (info["host"], info["port"])
    assert (worker.rank_offset, worker.world_size) == (1, 2)
    assert worker.packed and worker.packed_buffer_size_bytes == BUCKET_BYTES

    weights = load_file(str(tiny_model_dir / "model.safetensors"))
    report = client.refit("nccl-1", weights)
    assert report["ok"] and report["transport"] == "nccl" and report["version"] == "nccl-1"
    assert report["previous_version"] == before["weight_version"] and report["num_tensors"] == len(weights)

    round_ = ray.get(controller.recorded_fan_outs.remote())[already + 1:]
    assert [m for m, _, _ in round_] == ["rs_nccl_start", "rs_nccl_update", "rs_nccl_finish"]
    assert all(all(paused) for _, _, paused in round_)  # the whole round with the engine paused (keep)
    update = vllm_wt.NCCLWeightTransferEngine.update_info_cls(**round_[1][1][0]["update_info"])
    assert update.names == list(weights)
    assert update.shapes == [list(t.shape) for t in weights.values()]
    assert update.dtype_names == [str(t.dtype).split(".")[-1] for t in weights.values()]
    assert broadcast == [(name, t.dtype) for name, t in weights.items()]  # what the workers were told to expect

    engine = ray.get(controller.get_engines.remote())[0]
    assert not ray.get(engine.is_paused.remote()) and ray.get(engine.weight_version.remote()) == "nccl-1"
    stats = ray.get(controller.stats.remote())
    assert stats["weight_version"] == "nccl-1" and not stats["refitting"]
    assert stats["num_refits"] == before["num_refits"] + 1
    assert not ray.get(fleet.stats.remote())["refitting"]


def test_trainer_client_takes_bucket_size_and_timeout_from_the_service_unless_given(rig):
    from rollout_service.refit.client import RefitSettings, TrainerClient

    controller, _ = rig
    assert TrainerClient(controller).settings() == RefitSettings("nccl", BUCKET_BYTES, 30.0)
    explicit = TrainerClient(controller, bucket_bytes=1 << 20, timeout_s=7)
    assert explicit.settings() == RefitSettings("nccl", 1 << 20, 7)
    # Told otherwise: a gloo group on a refit.backend nccl service (the controller does not refuse it).
    info = explicit.init_weight_sync(backend="gloo")
    assert info["backend"] == "gloo" and info["worker_ranks"] == [1]
    ray.get(controller.close_weight_sync.remote(), timeout=60)
    explicit.close()


def test_nccl_update_size_is_what_the_tensors_hold_for_every_dtype():
    import torch

    from rollout_service.refit.nccl import nccl_update_size

    tensors = {str(d): torch.zeros((3, 5), dtype=d) for d in (
        torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int8, torch.uint8, torch.int32,
        torch.int64, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2)}
    info = {"names": list(tensors), "dtype_names": [str(t.dtype).split(".")[-1] for t in tensors.values()],
            "shapes": [list(t.shape) for t in tensors.values()]}
    size = sum(t.numel() * t.element_size() for t in tensors.values())
    assert nccl_update_size(info) == nccl_update_size([info, info]) == (len(tensors), size)


def test_every_nccl_round_is_recorded_once_with_its_outcome_phases_and_bytes(rig, tiny_model_dir):
    """On the real metrics endpoint: a round that commits (ok: pause, transfer = vLLM's receive
    with its layer-by-layer load, load = vLLM's finish of that reload, resume = label + resume;
    the bytes update_info announces), a start refused while it runs (rejected), and a start whose
    start_weight_update the worker refuses after the pause (failed at transfer: pause, transfer,
    resume). The counters move by exactly that, and the histograms' buckets by the rounds' reports."""
    from safetensors.torch import load_file
    from test_metrics import EXPORT_INTERVAL_S, _scrape, _settled, _value

    from rollout_service.metrics import EXPORT_PREFIX, NAME_PREFIX
    from rollout_service.refit.types import RefitInProgress
    from rollout_service.ops.runtime import metrics_url

    controller, fleet = rig
    url = metrics_url()
    assert url is not None
    weights = load_file(str(tiny_model_dir / "model.safetensors"))
    update_info = {"names": list(weights), "dtype_names": [str(t.dtype).split(".")[-1] for t in weights.values()],
                   "shapes": [list(t.shape) for t in weights.values()]}
    size = sum(t.numel() * t.element_size() for t in weights.values())
    ray.get(controller.nccl_init_weight_transfer_engine.remote(_worker_init_info(world_size=2)), timeout=60)
    stats_before = ray.get(controller.stats.remote())
    before = _settled(url)

    ray.get(controller.nccl_start_weight_update.remote(), timeout=60)
    with pytest.raises(RefitInProgress):
        ray.get(controller.nccl_start_weight_update.remote(), timeout=60)
    ray.get(controller.nccl_update_weights.remote(update_info), timeout=60)
    ray.get(controller.nccl_finish_weight_update.remote("metrics-ok"), timeout=60)
    ok = ray.get(controller.stats.remote())["last_refit"]
    ray.get(controller.refuse_next.remote("rs_nccl_start"))
    with pytest.raises(RuntimeError, match="rs_nccl_start refused"):
        ray.get(controller.nccl_start_weight_update.remote(), timeout=60)
    stats = ray.get(controller.stats.remote())
    failed = stats["last_refit"]

    assert ok["ok"] and ok["transport"] == "nccl" and ok["version"] == "metrics-ok" and ok["failed_step"] is None
    assert ok["previous_version"] == stats_before["weight_version"]
    assert (ok["bytes"], ok["num_tensors"]) == (size, len(weights))
    assert all(ok[f"{p}_s"] > 0 for p in ("pause", "transfer", "load", "resume"))
    assert ok["total_s"] >= ok["pause_s"] + ok["transfer_s"] + ok["load_s"] + ok["resume_s"]
    assert not failed["ok"] and failed["failed_step"] == "transfer" and "refused" in failed["error"]
    assert failed["version"] is None and failed["bytes"] == 0 and failed["load_s"] == 0
    assert failed["rolled_back"]  # a start refused after the fan-out: every engine back on the committed weights
    assert stats["weight_version"] == "metrics-ok" and not stats["refitting"]
    assert stats["num_refits"] == stats_before["num_refits"] + 1
    assert stats["num_failed_refits"] == stats_before["num_failed_refits"] + 1
    engine = ray.get(controller.get_engines.remote())[0]
    assert not ray.get(engine.is_paused.remote()) and not ray.get(fleet.stats.remote())["refitting"]

    counted = {
        ("refits_total", (("outcome", "ok"),)): 1,
        ("refits_total", (("outcome", "rejected"),)): 1,
        ("refits_total", (("outcome", "failed"),)): 1,
        ("refit_phase_seconds_count", (("phase", "pause"),)): 2,
        ("refit_phase_seconds_count", (("phase", "transfer"),)): 2,
        ("refit_phase_seconds_count", (("phase", "load"),)): 1,  # the failed start never got there
        ("refit_phase_seconds_count", (("phase", "resume"),)): 2,
        ("refit_stall_seconds_count", ()): 2,
        ("refit_bytes_total", ()): size,
    }
    expected = {(EXPORT_PREFIX + NAME_PREFIX + n, ls): v for (n, ls), v in counted.items()}

    def moved(samples, name, **labels):
        return _value(samples, name, **labels) - _value(before, name, **labels)

    deadline = time.monotonic() + 9 * EXPORT_INTERVAL_S
    while True:
        after = _scrape(url)
        got = {(n, ls): moved(after, n, **dict(ls)) for n, ls in expected}
        over = {k: v for k, v in got.items() if v > expected[k]}
        assert over == {}, f"counted more than happened: {over} (expected {expected})"
        if got == expected:
            break
        assert time.monotonic() < deadline, {k: (v, expected[k]) for k, v in got.items() if v != expected[k]}
        time.sleep(1)
    # Ray exports a histogram's sum from its buckets (not exact): the buckets are where each round's
    # own durations fall, per phase and for the stall.
    rounds = {p: [ok[f"{p}_s"]] + ([failed[f"{p}_s"]] if p != "load" else []) for p in ("pause", "transfer", "load", "resume")}
    rounds["stall"] = [ok["total_s"], failed["total_s"]]
    for phase, values in rounds.items():
        name, labels = ("refit_stall_seconds", {}) if phase == "stall" else ("refit_phase_seconds", {"phase": phase})
        buckets = _buckets(after, name, labels), _buckets(before, name, labels)
        got = {le: n - buckets[1].get(le, 0) for le, n in buckets[0].items()}
        assert got and got == {le: sum(v <= le for v in values) for le in got}, (phase, values, got)


def _buckets(samples, name: str, labels: dict) -> dict[float, float]:
    """A histogram's cumulative bucket counts by upper bound, summed over processes."""
    out: dict[float, float] = {}
    for n, ls, v in samples:
        if n == f"ray_rollout_service_{name}_bucket" and all(ls.get(k) == w for k, w in labels.items()):
            out[float(ls["le"])] = out.get(float(ls["le"]), 0) + v
    return out
