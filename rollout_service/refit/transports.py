"""How new weights reach the engine workers: one strategy per transport.

A transport only *stages* the new state dict inside every worker (nothing is loaded yet); the
controller then loads, commits or rolls back the same way whatever the transport. Each strategy is
a small picklable object the trainer-side client builds; it names what every engine calls to stage
it (``engine_stage``), which the engine runs as the first step of its one apply call
(:mod:`rollout_service.engine.refit_steps`).

- :class:`CollectiveTransfer` — the trainer (rank 0) broadcasts buckets over the dedicated gloo
  group set up by ``init_weight_sync``; every worker receives them itself (``rs_stage_collective``).
  The trainer sends concurrently with the controller's call (see ``client.TrainerClient.refit``).
- :class:`ObjectStoreTransfer` — a Ray object ref of a ``{name: tensor}`` state dict. The EngineCore
  subprocess that hosts the worker is not connected to Ray, and tensors cannot travel as
  ``collective_rpc`` arguments, so the engine *actor* resolves the ref and writes one safetensors
  file to ``/dev/shm`` (same node, page cache); the worker reads it and the file is deleted.
- :class:`CheckpointPathTransfer` — a HF-format checkpoint directory every engine node can read.
- :class:`ControllerWeightSyncClient` — GPU only, vLLM's native ``WeightTransferConfig(backend="nccl")``
  engine driven through the controller; written against vLLM's API, **not run on a GPU** (on CPU:
  the handshake and the round short of the NCCL calls).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# The staging worker methods (rollout_service.weights.worker_extension) a transfer names.
from rollout_service.engine.refit_steps import STAGE_COLLECTIVE, STAGE_PATH


def bytes_of(results: list[list[dict[str, Any]]]) -> tuple[int, float]:
    """Bytes staged per engine (every engine receives the full state dict) and the slowest worker's
    own receive seconds (the rest of the transfer step is RPC and hand-off latency), from each
    engine's stage results (one dict per worker)."""
    workers = [w for per_engine in results for w in per_engine if w]
    return max((w["bytes"] for w in workers), default=0), max((w["seconds"] for w in workers), default=0.0)


# Each transfer names what every engine does to stage it (``RefitSteps.refit_apply``'s ``stage``).

@dataclass
class CollectiveTransfer:
    plan_json: str
    total_bytes: int
    kind: str = "collective"

    def engine_stage(self) -> dict[str, Any]:
        return {"rpc": STAGE_COLLECTIVE, "args": [self.plan_json]}


@dataclass
class ObjectStoreTransfer:
    refs: list  # [ObjectRef of {name: tensor}]; wrapped in a list so Ray does not resolve it on the way
    kind: str = "object_store"

    def engine_stage(self) -> dict[str, Any]:
        return {"refs": self.refs}


@dataclass
class CheckpointPathTransfer:
    path: str
    kind: str = "path"

    def engine_stage(self) -> dict[str, Any]:
        return {"rpc": STAGE_PATH, "args": [self.path]}


class ControllerWeightSyncClient:
    """GPU: vLLM's ``VLLMWeightSyncClient`` protocol over our controller, for vLLM's trainer-side
    ``NCCLTrainerWeightTransferEngine`` (``WeightTransferConfig(backend="nccl")``).

    **Unverified on GPUs** (on CPU: everything short of vLLM's NCCL calls). vLLM's trainer engine
    drives the round trip (``start_weight_update`` / ``update_weights`` concurrently with its NCCL
    broadcast / ``finish_weight_update``); each call is fanned out to every engine by the
    controller, which pauses (keep) before the round and labels + resumes after it. The engines
    start with vLLM's ``weight_transfer_config`` when the service's ``refit.backend`` is nccl
    (``EngineReplica.engine_args``). vLLM loads in place while receiving, so this path has no
    stage / load split: a failed round is rolled back by reloading the last source our transports
    know (``rs_nccl_abort``, from ``RefitController._nccl_release``).
    """

    def __init__(self, controller, version: str | None = None, timeout_s: float = 300.0):
        self.controller = controller
        self.version = version
        self.timeout_s = timeout_s

    def _call(self, method: str, *args):
        import ray

        return ray.get(getattr(self.controller, method).remote(*args), timeout=self.timeout_s)

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._call("nccl_init_weight_transfer_engine", init_info)

    def shutdown_weight_transfer_engine(self) -> None:
        self._call("nccl_shutdown_weight_transfer_engine")

    def start_weight_update(self) -> None:
        self._call("nccl_start_weight_update")

    def update_weights(self, update_info) -> None:
        self._call("nccl_update_weights", update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._call("nccl_finish_weight_update", weight_version or self.version)


Transfer = CollectiveTransfer | ObjectStoreTransfer | CheckpointPathTransfer
