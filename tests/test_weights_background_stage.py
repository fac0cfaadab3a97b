"""The worker extension's stage in a background thread (refit.staging: overlap), without vLLM: the
real ``RolloutWorkerExtension`` methods on a host object that has only what staging reads, over a
real two-rank gloo group (the trainer's rank in a thread of this process). The engine behaviour
(a refit staged while a real vLLM engine generates) is tested in tests/test_refit.py."""

from __future__ import annotations

import concurrent.futures
import threading
import time
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from rollout_service.weights.collective import free_port, open_group, plan_for_state_dict, send_buckets
from rollout_service.weights.staging import deadline_passed, host_deadline
from rollout_service.weights.worker_extension import RolloutWorkerExtension


class _Worker(RolloutWorkerExtension):
    """What the staging methods read of vLLM's worker: its rank and the model's own path."""

    rank = 1

    def __init__(self, model_dir: str):
        self.model_runner = SimpleNamespace(vllm_config=SimpleNamespace(model_config=SimpleNamespace(model=model_dir)))


def _until_done(worker, timeout_s: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        polled = worker.rs_stage_poll()
        if polled["done"]:
            return polled
        assert time.monotonic() < deadline, "the background stage did not end"
        time.sleep(0.01)


def test_a_checkpoint_is_read_in_the_background_and_kept_as_its_path_once_loaded(tiny_model_dir):
    worker = _Worker(str(tiny_model_dir))
    size = (tiny_model_dir / "model.safetensors").stat().st_size
    began = worker.rs_stage_begin("rs_stage_path", [str(tiny_model_dir)])
    assert began == {"started": True, "bytes": size}
    done = _until_done(worker)
    assert done["done"] and done["bytes"] > 0
    staged = worker._rs_staged
    assert staged.path == str(tiny_model_dir) and staged.tensors is not None
    assert staged.settled().tensors is None and staged.settled().path == str(tiny_model_dir)
    assert worker.rs_stage_poll() == done and worker._rs_staged is staged  # asked again: the same answer
    worker.rs_discard_staged()
    assert worker._rs_staged is None
    with pytest.raises(RuntimeError, match="no background stage"):
        worker.rs_stage_poll()


def test_a_late_call_of_an_ended_refit_never_touches_the_current_one(tiny_model_dir):
    """Calls name their refit: a poll or discard of another refit leaves the stage alone; a refit
    fenced by its failure path, or a begin past its deadline, is refused."""
    worker = _Worker(str(tiny_model_dir))
    assert worker.rs_stage_begin("rs_stage_path", [str(tiny_model_dir)], token="b")["started"]
    with pytest.raises(RuntimeError, match="no background stage of refit a"):
        worker.rs_stage_poll("a")
    worker.rs_discard_staged(token="a", fence=True)  # refit a's failure path, late: b's stage stays
    assert _until_done_token(worker, "b")["done"] and worker._rs_staged is not None
    with pytest.raises(RuntimeError, match="refit a already ended"):
        worker.rs_stage_begin("rs_stage_path", [str(tiny_model_dir)], token="a")
    assert worker._rs_staged is not None  # (the refused begin discarded nothing)
    with pytest.raises(TimeoutError, match="past its deadline"):
        worker.rs_stage_begin("rs_stage_path", [str(tiny_model_dir)], token="c", not_after=host_deadline(-1))
    worker.rs_discard_staged(token="b")
    assert worker._rs_staged is None
    # A deadline is the monotonic clock of its host: another host's is never taken as passed.
    assert deadline_passed(host_deadline(-1)) and not deadline_passed(host_deadline(60))
    assert not deadline_passed(["another-host", 0.0]) and not deadline_passed(None)


def _until_done_token(worker, token: str, timeout_s: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while not (polled := worker.rs_stage_poll(token))["done"]:
        assert time.monotonic() < deadline, "the background stage did not end"
        time.sleep(0.01)
    return polled


def test_over_the_budget_nothing_is_staged_and_the_fallback_says_why(tiny_model_dir):
    worker = _Worker(str(tiny_model_dir))
    size = (tiny_model_dir / "model.safetensors").stat().st_size
    began = worker.rs_stage_begin("rs_stage_path", [str(tiny_model_dir)], size - 1)
    assert began["started"] is False and began["fallback"] == f"{size} bytes over refit.staging_budget_bytes ({size - 1})"
    assert worker._rs_staged is None and getattr(worker, "_rs_job", None) is None
    with pytest.raises(ValueError, match="cannot stage in the background"):
        worker.rs_stage_begin("rs_load_staged", [])


def test_a_broadcast_is_received_in_the_background_and_an_abandoned_one_is_dropped(tiny_model_dir):
    params = {k: v for k, v in list(load_file(str(tiny_model_dir / "model.safetensors")).items())[:6]}
    plan = plan_for_state_dict(params, bucket_bytes=1 << 20)
    port = free_port()
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        trainer_group = pool.submit(open_group, "127.0.0.1", port, 2, 0, "bg-stage", 30)
        worker_group = pool.submit(open_group, "127.0.0.1", port, 2, 1, "bg-stage", 30)
        trainer, group = trainer_group.result(timeout=60), worker_group.result(timeout=60)
    worker = _Worker(str(tiny_model_dir))
    worker._rs_group = group

    # Received while the caller goes on (the poll says "not done" until the trainer sends).
    assert worker.rs_stage_begin("rs_stage_collective", [plan.to_json()])["started"]
    assert worker.rs_stage_poll() == {"done": False}
    sender = threading.Thread(target=send_buckets, args=(trainer, params, plan))
    sender.start()
    done = _until_done(worker)
    sender.join(30)
    assert done["bytes"] == plan.total_bytes
    got = dict(worker._rs_staged.tensors)
    assert got.keys() == params.keys() and all(torch.equal(got[k], params[k]) for k in params)
    worker.rs_discard_staged()

    # Abandoned while it waits (a refit that failed on another engine): its result is dropped when
    # the broadcast ends, and the group stays in step for the next one.
    assert worker.rs_stage_begin("rs_stage_collective", [plan.to_json()])["started"]
    job = worker._rs_job
    worker.rs_discard_staged()
    sender = threading.Thread(target=send_buckets, args=(trainer, params, plan))
    sender.start()
    assert job.finished.wait(30)
    sender.join(30)
    assert job.source is None and worker._rs_staged is None
    assert worker.rs_stage_begin("rs_stage_collective", [plan.to_json()])["started"]
    sender = threading.Thread(target=send_buckets, args=(trainer, params, plan))
    sender.start()
    assert _until_done(worker)["bytes"] == plan.total_bytes
    sender.join(30)
