"""The GPU (NCCL) refit path cannot run here (no GPU). What can: its contract with the pinned vLLM.

These check, against vLLM's own classes, that the names and call shapes our NCCL path relies on
exist: the trainer-side engine accepts our init info, client and weight source; our controller
client covers vLLM's weight-sync client protocol; the worker methods the controller fans out to
exist on vLLM's worker; vLLM's own per-tensor check accepts our state-dict source; ``refit.backend:
nccl`` starts the engines with vLLM's NCCL weight-transfer engine; every engine's workers get ranks
of their own. The client / controller handshake and round run on a real CPU engine, short of the
NCCL calls, in tests/test_refit_nccl_lease.py; a round refused by the worker in tests/test_refit.py.
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

    from rollout_service.refit.nccl import NcclRounds

    from rollout_service.weights.worker_extension import RolloutWorkerExtension

    source = inspect.getsource(NcclRounds)  # the controller's NCCL round
    extension = inspect.getsource(RolloutWorkerExtension)  # our worker methods around vLLM's round
    for name in WORKER_METHODS:
        assert callable(getattr(Worker, name, None)), name
        # init / shutdown: fanned out as they are; start / update / finish: through our rs_nccl_*
        # methods, which call vLLM's and keep the record of what the round loaded.
        assert f'"{name}"' in source or f"self.{name}(" in extension, f"nothing calls {name}"
    for ours in (NcclRounds._NCCL_START, NcclRounds._NCCL_UPDATE, NcclRounds._NCCL_FINISH, "rs_nccl_abort"):
        assert callable(getattr(RolloutWorkerExtension, ours, None)), ours
    assert '"rs_nccl_abort"' in source  # a failed or abandoned round goes back to the committed weights
    # vLLM's transfer engine lets the worker swap the model a round loads into (our recording hook).
    from vllm.distributed.weight_transfer.base import WeightTransferEngine

    assert {"set_weight_update_target", "reset_weight_update_target"} <= set(dir(WeightTransferEngine))
    assert "self.model.load_weights" in inspect.getsource(vllm_wt.NCCLWeightTransferEngine.receive_weights)
    # update_weights / init take the dict payload under the keyword the controller passes.
    assert "update_info" in inspect.signature(Worker.update_weights).parameters
    assert "init_info" in inspect.signature(Worker.init_weight_transfer_engine).parameters


def test_trainer_engine_accepts_our_init_info_client_and_source():
    from vllm.distributed.weight_transfer.base import WeightSource

    from rollout_service.refit.nccl_trainer import state_dict_weight_source

    info = vllm_wt.NCCLTrainerInitInfo(master_address="127.0.0.1", master_port=29500, world_size=3, rank=0)
    assert info.is_sender
    params = inspect.signature(vllm_wt.NCCLTrainerWeightTransferEngine.trainer_init).parameters
    assert {"client", "source"} <= set(params)
    source = state_dict_weight_source()
    assert isinstance(source, WeightSource)


def test_vllms_per_tensor_check_accepts_the_state_dict_source_and_catches_a_mismatch():
    from rollout_service.refit.nccl_trainer import state_dict_weight_source

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


def test_refit_backend_nccl_starts_the_engines_with_vllms_nccl_weight_transfer():
    from vllm.config import WeightTransferConfig
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    from rollout_service.config import RolloutServiceConfig
    from rollout_service.engine.replica import EngineReplica

    gpu = {"model": "/models/x", "device": "cuda", "tensor_parallel_size": 2}
    nccl = RolloutServiceConfig.model_validate({"engine": gpu, "refit": {"backend": "nccl"}})
    args = EngineReplica(nccl.engine).engine_args()
    assert args.weight_transfer_config == WeightTransferConfig(backend="nccl")
    # What each worker builds from it when it loads the model (vLLM's Worker.load_model): the dense NCCL engine.
    assert WeightTransferEngineFactory._registry["nccl"]() is vllm_wt.NCCLWeightTransferEngine
    # The engine section travels as a dict (Serve args, the fleet's redeploy check): the setting survives it.
    assert RolloutServiceConfig.model_validate(nccl.model_dump()).engine == nccl.engine
    gloo = RolloutServiceConfig.model_validate({"engine": gpu})
    assert EngineReplica(gloo.engine).engine_args().weight_transfer_config is None


def test_nccl_refit_config_is_refused_where_it_cannot_run():
    from pydantic import ValidationError

    from rollout_service.config import RolloutServiceConfig

    with pytest.raises(ValidationError, match="needs engine.device cuda"):
        RolloutServiceConfig.model_validate({"refit": {"backend": "nccl"}})
    with pytest.raises(ValidationError, match="follows refit.backend"):
        RolloutServiceConfig.model_validate({"engine": {"device": "cuda", "weight_transfer_backend": "nccl"}})


def test_each_engine_gets_its_own_nccl_ranks():
    """Our engines are separate vLLM instances, each ranking its workers from its own rank_offset
    (vLLM's worker_init_process_group: data-parallel index 0, rank within the engine + offset); one
    shared offset would give every engine the same ranks. 3 engines x TP 2: ranks 1..6, trainer 0."""
    from vllm.distributed.weight_transfer.nccl_common import NCCLWeightTransferInitInfo, worker_init_payload

    from rollout_service.refit.nccl import nccl_worker_init_infos
    from rollout_service.refit.types import WeightSyncNotInitialized

    sent = worker_init_payload(NCCLWeightTransferInitInfo(master_address="10.0.0.1", master_port=29500,
                                                          rank_offset=1, world_size=7, packed=True))
    infos = [vllm_wt.NCCLWeightTransferEngine.init_info_cls(**i) for i in nccl_worker_init_infos(sent, 3, 2)]
    ranks = [info.rank_offset + rank_in_engine for info in infos for rank_in_engine in range(2)]
    assert ranks == [1, 2, 3, 4, 5, 6]
    assert {(i.master_address, i.master_port, i.world_size, i.packed) for i in infos} == {("10.0.0.1", 29500, 7, True)}
    with pytest.raises(WeightSyncNotInitialized, match="world size 7"):
        nccl_worker_init_infos(sent, 2, 2)  # an engine was lost since the trainer asked for the world size
