"""The trainer's side of the NCCL path (GPU only; unverified on GPUs): vLLM's trainer-side
``NCCLTrainerWeightTransferEngine``, driving every engine through the controller
(:class:`~rollout_service.refit.transports.ControllerWeightSyncClient`; the controller's side is
:mod:`rollout_service.refit.nccl`). A mixin of :class:`~rollout_service.refit.client.TrainerClient`,
whose controller handle it uses. On CPU everything up to vLLM's NCCL rendezvous runs
(tests/test_refit_nccl_lease.py). Imports vLLM only when used.
"""

from __future__ import annotations

import time
from typing import Any, Mapping


class NcclTrainer:
    def _init_nccl(self, host: str, port: int, timeout: float, world: int, bucket_bytes: int) -> dict[str, Any]:
        """vLLM's trainer-side NCCL engine, driving every engine through the controller (GPU only).

        Blocking: vLLM's engine calls the controller synchronously (``ray.get`` inside
        ``ControllerWeightSyncClient``); the async path runs this in a worker thread. The packed
        buffers (two per side, on the GPU) are ``bucket_bytes`` each; vLLM hands that size to the
        workers with the init info, so both sides agree. On CPU everything up to vLLM's NCCL
        rendezvous runs (tests/test_refit_nccl_lease.py); the rendezvous itself needs GPUs."""
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo, NCCLTrainerWeightTransferEngine

        from rollout_service.refit.transports import ControllerWeightSyncClient

        self._nccl_source = state_dict_weight_source()
        self._nccl_client = ControllerWeightSyncClient(self.controller, timeout_s=timeout)
        self._nccl = NCCLTrainerWeightTransferEngine.trainer_init(
            NCCLTrainerInitInfo(master_address=host, master_port=port, world_size=world, rank=0,
                                packed_buffer_size_bytes=bucket_bytes),
            client=self._nccl_client,
            source=self._nccl_source,
        )
        return {"backend": "nccl", "host": host, "port": port, "world_size": world, "bucket_bytes": bucket_bytes}

    def _refit_nccl(self, version: str, params, previous: str) -> dict[str, Any]:
        from rollout_service.refit.types import RefitReport

        t0 = time.perf_counter()
        self._nccl_source.params = params
        self._nccl_client.version = version
        self._nccl.send_weights()  # start_weight_update -> update_weights || broadcast -> finish
        seconds = time.perf_counter() - t0
        return RefitReport(
            version=version, previous_version=previous, transport="nccl", ok=True,
            bytes=sum(t.numel() * t.element_size() for t in params.values()), num_tensors=len(params),
            total_s=seconds, stall_s=seconds,
        ).to_dict()



def state_dict_weight_source():
    """vLLM's ``WeightSource`` over the state dict of the current refit (set ``.params`` per round).

    Built on first use: this module imports without vLLM. Only the two abstract methods are ours;
    vLLM's defaults group the stream and ``NCCLTrainerWeightTransferEngine`` checks each yielded
    tensor against ``metadata()``."""
    from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

    class StateDictWeightSource(WeightSource):
        def __init__(self, params: Mapping[str, Any] | None = None):
            self.params = params or {}

        def metadata(self):
            return [ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in self.params.items()]

        def __iter__(self):
            return iter(list(self.params.items()))

    return StateDictWeightSource()
