"""Pure parts of the refit: bucket plan, the gloo wire protocol between real processes, the client."""

from __future__ import annotations

import io
import multiprocessing as mp
import pickle
import subprocess
import sys

import pytest
import torch

from rollout_service.weights.collective import (
    ABORT_MESSAGE,
    BucketPlan,
    TransferAborted,
    bucket_size,
    free_port,
    open_group,
    plan_for_state_dict,
    receive_buckets,
    send_buckets,
)
from rollout_service.refit.types import RefitFailed, RefitReport


def state_dict():
    g = torch.Generator().manual_seed(0)
    return {
        "embed.weight": torch.randn(100, 16, generator=g),
        "norm.weight": torch.randn(16, generator=g).to(torch.bfloat16),
        "odd.bias": torch.randn(3, generator=g),  # 12 bytes: next slot must stay 8-aligned
        "head.weight": torch.randn(50, 16, generator=g),
    }


def test_plan_packs_in_order_aligned_and_round_trips_as_json():
    sd = state_dict()
    plan = plan_for_state_dict(sd, bucket_bytes=4096)
    assert [s.name for b in plan.buckets for s in b] == list(sd)
    assert plan.total_bytes == sum(t.numel() * t.element_size() for t in sd.values())
    assert all(s.offset % 8 == 0 for b in plan.buckets for s in b)
    assert all(bucket_size(b) <= 4096 or len(b) == 1 for b in plan.buckets)
    assert BucketPlan.from_json(plan.to_json()) == plan


def test_a_tensor_larger_than_a_bucket_gets_its_own_bucket():
    plan = plan_for_state_dict({"a": torch.zeros(10), "big": torch.zeros(1000), "c": torch.zeros(10)}, 256)
    assert [[s.name for s in b] for b in plan.buckets] == [["a"], ["big"], ["c"]]


def _receiver(port, plan_json, q):
    try:
        group = open_group("127.0.0.1", port, 2, 1, "t", 30)
        got, _ = receive_buckets(group, BucketPlan.from_json(plan_json))
        # As bytes: a tensor put on a Queue travels as a shared-memory fd that the parent can only
        # open while this process lives, and it exits right after (FileNotFoundError in the parent).
        buffer = io.BytesIO()
        torch.save({n: t.clone() for n, t in got}, buffer)
        q.put(("ok", buffer.getvalue()))
    except TransferAborted as exc:
        q.put(("aborted", str(exc)))
    except Exception as exc:  # pragma: no cover - surfaced by the assertion in the test
        q.put(("error", repr(exc)))


class _UnpackableLast(dict):
    """A state dict whose last tensor cannot be read once the transfer started (packing fails)."""

    def __getitem__(self, name):
        if name == list(self)[-1]:
            raise KeyError(f"{name} vanished mid-transfer")
        return super().__getitem__(name)


def _run(fail_after: int | None, sd=None):
    sd = sd if sd is not None else state_dict()
    plan = plan_for_state_dict(sd, bucket_bytes=4096)
    port = free_port()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_receiver, args=(port, plan.to_json(), q))
    p.start()
    group = open_group("127.0.0.1", port, 2, 0, "t", 30)

    def on_bucket(i):
        if fail_after is not None and i == fail_after:
            raise RuntimeError("injected")

    err = None
    try:
        send_buckets(group, sd, plan, on_bucket=on_bucket)
    except (RuntimeError, KeyError) as exc:
        err = exc
    status, payload = q.get(timeout=60)
    p.join(30)
    if status == "ok":
        payload = torch.load(io.BytesIO(payload))
    return sd, plan, (status, payload), err


def test_broadcast_over_a_dedicated_gloo_group_delivers_exact_tensors():
    sd, plan, (status, got), err = _run(None)
    assert err is None and status == "ok" and len(plan.buckets) > 1
    assert list(got) == list(sd)
    for name, t in sd.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t)


def test_trainer_failure_after_a_bucket_aborts_every_receiver():
    _, plan, (status, message), err = _run(0)
    assert str(err) == "injected"
    assert status == "aborted" and ABORT_MESSAGE in message and f"after 1 of {len(plan.buckets)}" in message


def test_packing_failure_mid_transfer_completes_the_broadcast_and_aborts():
    # The workers posted a receive for every bucket: the unsent ones go as filler, then ABORT.
    _, plan, (status, message), err = _run(None, _UnpackableLast(state_dict()))
    assert isinstance(err, KeyError) and len(plan.buckets) == 2  # bucket 0 sent, bucket 1 filler
    assert status == "aborted" and ABORT_MESSAGE in message


def test_client_imports_without_vllm_or_ray():
    code = "import sys, rollout_service.refit.client as c; print('vllm' in sys.modules, 'ray' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "False"]


def test_client_and_errors_survive_pickling_for_ray():
    from rollout_service.refit.client import TrainerClient

    c = pickle.loads(pickle.dumps(TrainerClient(controller=None, bucket_bytes=1 << 20, timeout_s=5)))
    assert c.bucket_bytes == 1 << 20 and c.timeout_s == 5 and c._group is None
    report = RefitReport(version="2", previous_version="1", transport="collective", failed_step="transfer").to_dict()
    e = pickle.loads(pickle.dumps(RefitFailed("boom", report)))
    assert str(e) == "boom" and e.report["failed_step"] == "transfer"


def test_refit_rejects_unknown_transport_before_touching_the_service():
    from rollout_service.refit.client import TrainerClient

    with pytest.raises(ValueError):
        TrainerClient(controller=object()).refit("1", {}, transport="carrier-pigeon")


def test_version_lag_counts_refits_since_a_rollout_started():
    from rollout_service.refit.controller import RefitController

    c = RefitController({})
    c._version_history = ["0", "1", "2"]
    assert [c.version_lag(v) for v in ("2", "1", "0", "x")] == [0, 1, 2, None]
