"""The GPU (NCCL) refit path cannot run here (no GPU). What can: its contract with the pinned vLLM.

These check, against vLLM's own classes, that the names and call shapes our NCCL path relies on
exist: the trainer-side engine accepts our init info, client and weight source; our controller
client covers vLLM's weight-sync client protocol; the worker methods the controller fans out to
exist on vLLM's worker; and vLLM's own per-tensor check accepts our state-dict source. The failure
path of the controller's NCCL round runs on a real engine in tests/test_refit.py.
"""

from __future__ import annotations

import inspect

import pytest
import torch

import vllm.distributed.weight_transfer.nccl_engine as vllm_wt  # a missing vLLM must fail, not skip

WORKER_METHODS = (
    "init_weight_transfer_engine",
    "shutdown_weight_transfer_engine",
    "start_weight_update",
    "update_weights",
    "finish_weight_update",
)


def _public_methods(cls) -> dict[str, inspect.Signature]:
    return {n: inspect.signature(f) for n, f in inspect.getmembers(cls, inspect.isfunction) if not n.startswith("_")}


def test_controller_client_implements_vllms_weight_sync_client_protocol():
    from vllm.distributed.weight_transfer.clients import RayVLLMWeightSyncClient

    from rollout_service.refit.transports import ControllerWeightSyncClient

    theirs, ours = _public_methods(RayVLLMWeightSyncClient), _public_methods(ControllerWeightSyncClient)
    assert set(theirs) <= set(ours), set(theirs) - set(ours)
    for name, sig in theirs.items():
        assert list(sig.parameters) == list(ours[name].parameters), name


def test_every_worker_method_the_controller_fans_out_exists_on_vllms_worker():
    from vllm.v1.worker.gpu_worker import Worker

    from rollout_service.refit.controller import RefitController

    source = inspect.getsource(RefitController)
    for name in WORKER_METHODS:
        assert callable(getattr(Worker, name, None)), name
        assert f'"{name}"' in source, f"controller never calls {name}"
    # update_weights / init take the dict payload under the keyword the controller passes.
    assert "update_info" in inspect.signature(Worker.update_weights).parameters
    assert "init_info" in inspect.signature(Worker.init_weight_transfer_engine).parameters


def test_trainer_engine_accepts_our_init_info_client_and_source():
    from vllm.distributed.weight_transfer.base import WeightSource

    from rollout_service.refit.client import state_dict_weight_source

    info = vllm_wt.NCCLTrainerInitInfo(master_address="127.0.0.1", master_port=29500, world_size=3, rank=0)
    assert info.is_sender
    params = inspect.signature(vllm_wt.NCCLTrainerWeightTransferEngine.trainer_init).parameters
    assert {"client", "source"} <= set(params)
    source = state_dict_weight_source()
    assert isinstance(source, WeightSource)


def test_vllms_per_tensor_check_accepts_the_state_dict_source_and_catches_a_mismatch():
    from rollout_service.refit.client import state_dict_weight_source

    source = state_dict_weight_source()
    source.params = {"a.weight": torch.randn(4, 3), "b.bias": torch.randn(5).to(torch.bfloat16)}
    meta = source.metadata()
    sent = list(vllm_wt.NCCLTrainerWeightTransferEngine._checked_iter(source, meta))
    assert [n for n, _ in sent] == ["a.weight", "b.bias"]
    # The update info vLLM builds from the metadata (what the workers size their buffers from).
    update = vllm_wt.NCCLWeightTransferUpdateInfo(
        names=[m.name for m in meta], dtype_names=[str(m.dtype).split(".")[-1] for m in meta],
        shapes=[list(m.shape) for m in meta],
    )
    assert update.dtype_names == ["float32", "bfloat16"]
    # Re-iterable (a fresh pass each round), and a source that disagrees with its metadata is refused.
    assert [n for n, _ in source] == ["a.weight", "b.bias"]
    with pytest.raises(ValueError):
        list(vllm_wt.NCCLTrainerWeightTransferEngine._checked_iter(source, meta[:1]))
