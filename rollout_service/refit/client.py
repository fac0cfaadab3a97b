"""Trainer-side client for in-flight refits. Imports neither vLLM nor (until used) Ray.

A trainer holds one :class:`TrainerClient` (it is picklable: ship it to a Ray actor and call
``init_weight_sync`` there). It talks to the service's refit controller through its Ray handle::

    client = TrainerClient()                 # finds the running service's controller
    client.init_weight_sync()                # gloo group: trainer rank 0 + every engine worker
    report = client.refit("7", model.state_dict())               # collective broadcast
    report = client.refit("8", model.state_dict(), transport="object_store")
    report = client.refit("9", "/ckpt/step-9", transport="path")  # HF checkpoint directory
    client.stats()                           # version, in-flight rollouts and their lag

``refit`` returns the report dict (:class:`~rollout_service.refit.types.RefitReport`) or raises
``RefitInProgress`` / ``RefitFailed`` (engines resumed on the previous weights either way).

For the collective transport the trainer is the broadcast root: ``refit`` starts the controller's
call (pause every engine, then receive) and broadcasts the buckets itself, concurrently.
"""

from __future__ import annotations

import threading
import time
import uuid
from typing import Any, Callable, Mapping

from rollout_service.refit.collective import (
    ABORT_MESSAGE,
    GroupOutOfSync,
    PackBuffers,
    free_port,
    open_group,
    plan_for_state_dict,
    send_buckets,
)
from rollout_service.refit.transports import CheckpointPathTransfer, CollectiveTransfer, ObjectStoreTransfer
from rollout_service.refit.types import RefitFailed, RefitInProgress, WeightSyncNotInitialized

TRANSPORTS = ("collective", "object_store", "path")


class TrainerClient:
    def __init__(
        self,
        controller=None,
        *,
        bucket_bytes: int = 256 * 1024 * 1024,
        timeout_s: float = 300.0,
        clear_cache: bool | None = None,
    ):
        self._controller = controller
        self.bucket_bytes = bucket_bytes
        self.timeout_s = timeout_s
        self.clear_cache = clear_cache
        self._group = None
        self._nccl = None
        self._pack_buffers = PackBuffers()
        self._lock = threading.Lock()

    def __getstate__(self):
        # Picklable: the group and locks are per process; the receiver calls init_weight_sync.
        return {"_controller": self._controller, "bucket_bytes": self.bucket_bytes, "timeout_s": self.timeout_s,
                "clear_cache": self.clear_cache}

    def __setstate__(self, state):
        self.__init__(**{k.lstrip("_"): v for k, v in state.items()})

    @property
    def controller(self):
        if self._controller is None:
            from rollout_service.refit.controller import get_controller

            self._controller = get_controller()
        return self._controller

    # ------------------------------------------------------------------- set-up
    def init_weight_sync(
        self,
        *,
        backend: str = "gloo",
        host: str | None = None,
        port: int | None = None,
        timeout_s: float | None = None,
    ) -> dict[str, Any]:
        """Form the collective group: this process is rank 0, every engine worker joins.

        gloo (CPU): a dedicated ``ProcessGroupGloo`` on a TCPStore this process hosts — never the
        default process group. nccl (GPU, unverified here): vLLM's NCCL weight-transfer engine.
        """
        import ray

        timeout = timeout_s or self.timeout_s
        host = host or _node_ip()
        port = port or free_port(host)
        if backend == "nccl":
            return self._init_nccl(host, port, timeout)
        if backend != "gloo":
            raise ValueError(f"backend must be gloo or nccl, got {backend!r}")
        self._group = None
        world = ray.get(self.controller.weight_sync_world_size.remote(), timeout=timeout)
        name = f"refit-{uuid.uuid4().hex[:8]}"
        t0 = time.perf_counter()
        ranks_ref = self.controller.init_weight_sync.remote(host, port, name, timeout)
        group = open_group(host, port, world, 0, name, timeout)  # blocks until every worker joined
        ranks = ray.get(ranks_ref, timeout=timeout)
        self._group = group
        return {"backend": "gloo", "group": name, "host": host, "port": port, "world_size": world,
                "worker_ranks": ranks, "seconds": time.perf_counter() - t0}

    def close(self) -> None:
        self._group = None
        self._pack_buffers.clear()
        self._nccl = None

    # ------------------------------------------------------------------- refit
    def refit(
        self,
        version: str | int,
        params: Mapping[str, Any] | str | None = None,
        *,
        transport: str = "collective",
        clear_cache: bool | None = None,
        timeout_s: float | None = None,
        on_bucket: Callable[[int], None] | None = None,
    ) -> dict[str, Any]:
        """Load ``params`` (checkpoint-format ``{name: tensor}``, or a checkpoint directory for
        ``transport="path"``) into every engine in flight and label them ``version``.

        ``on_bucket(i)`` runs after bucket ``i`` is on the wire (collective only); if it raises,
        the transfer is aborted on every worker and the refit fails cleanly (failure injection).
        """
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
        if not self._lock.acquire(blocking=False):
            raise RefitInProgress("this client is already running a refit")
        try:
            clear = self.clear_cache if clear_cache is None else clear_cache
            timeout = timeout_s or self.timeout_s
            if self._nccl is not None and transport == "collective":
                return self._refit_nccl(str(version), params)
            if transport == "collective":
                return self._refit_collective(str(version), params, clear, timeout, on_bucket)
            import ray

            if transport == "object_store":
                cpu = {name: t.detach().to("cpu").contiguous() for name, t in params.items()}
                transfer = ObjectStoreTransfer([ray.put(cpu)])
                del cpu
            else:
                if not isinstance(params, str):
                    raise TypeError("transport='path' takes a checkpoint directory path")
                transfer = CheckpointPathTransfer(params)
            ref = self.controller.refit.remote(str(version), transfer, clear_cache=clear, timeout_s=timeout)
            return _get(ref, _overall(timeout))
        finally:
            self._lock.release()

    def _refit_collective(self, version, params, clear, timeout, on_bucket) -> dict[str, Any]:
        import ray

        if self._group is None:
            raise WeightSyncNotInitialized("call init_weight_sync() first (or again after a failed transfer)")
        plan = plan_for_state_dict(params, self.bucket_bytes)
        ref = self.controller.refit.remote(
            version, CollectiveTransfer(plan.to_json(), plan.total_bytes), clear_cache=clear, timeout_s=timeout
        )
        deadline = time.monotonic() + _overall(timeout)

        def poll() -> None:
            # While waiting for the workers to join: the controller may have refused or failed.
            ready, _ = ray.wait([ref], timeout=0)
            if ready:
                _get(ref, 60)
                raise RuntimeError("controller finished a collective refit without receiving any data")
            if time.monotonic() > deadline:
                raise TimeoutError(f"engine workers did not join the broadcast within {timeout}s")

        timings: dict[str, float] = {}
        try:
            send_buckets(self._group, params, plan, on_bucket=on_bucket, poll=poll, buffers=self._pack_buffers,
                         timings=timings)
        except GroupOutOfSync as exc:
            # Nobody received the first header: it is still pending on our side, so the group is
            # out of step with the workers. Re-create it before the next collective refit.
            self._group = None
            raise exc.__cause__ or exc
        except BaseException as exc:
            try:
                _get(ref, _overall(timeout))
            except RefitFailed as failed:
                self._forget_group_if_out_of_step(failed.report)
                raise failed from exc
            raise
        try:
            report = _get(ref, _overall(timeout))
            report["trainer_send_s"] = timings.get("send_s")
            return report
        except RefitFailed as failed:
            self._forget_group_if_out_of_step(failed.report)
            raise

    def _forget_group_if_out_of_step(self, report: dict[str, Any] | None) -> None:
        """A worker's receive failed or timed out (not a clean ABORT): the group is out of step and
        the controller forgot it too; the next collective refit needs ``init_weight_sync()``."""
        report = report or {}
        if report.get("failed_step") == "transfer" and ABORT_MESSAGE not in (report.get("error") or ""):
            self._group = None

    # --------------------------------------------------------------------- misc
    def stats(self) -> dict[str, Any]:
        import ray

        return ray.get(self.controller.stats.remote(), timeout=60)

    def get_rollout(self, rollout_id: str) -> dict[str, Any] | None:
        """The trajectory of one rollout (segments: token_ids, loss_mask, logprobs, weight_versions)."""
        import ray

        return ray.get(self.controller.get_rollout.remote(rollout_id), timeout=60)

    def weights_checksums(self) -> list[str]:
        import ray

        return ray.get(self.controller.weights_checksums.remote(), timeout=self.timeout_s)

    # ------------------------------------------------------------- GPU (unverified)
    def _init_nccl(self, host: str, port: int, timeout: float) -> dict[str, Any]:  # pragma: no cover - GPU only
        """vLLM's trainer-side NCCL engine, driving every engine through the controller."""
        import ray
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo, NCCLTrainerWeightTransferEngine

        from rollout_service.refit.transports import ControllerWeightSyncClient

        world = ray.get(self.controller.weight_sync_world_size.remote(), timeout=timeout)
        self._nccl_source = state_dict_weight_source()
        self._nccl_client = ControllerWeightSyncClient(self.controller, timeout_s=timeout)
        self._nccl = NCCLTrainerWeightTransferEngine.trainer_init(
            NCCLTrainerInitInfo(master_address=host, master_port=port, world_size=world, rank=0),
            client=self._nccl_client,
            source=self._nccl_source,
        )
        return {"backend": "nccl", "host": host, "port": port, "world_size": world}

    def _refit_nccl(self, version: str, params) -> dict[str, Any]:  # pragma: no cover - GPU only
        import ray

        from rollout_service.refit.types import RefitReport

        previous = ray.get(self.controller.current_version.remote(), timeout=60)
        t0 = time.perf_counter()
        self._nccl_source.params = params
        self._nccl_client.version = version
        self._nccl.send_weights()  # start_weight_update -> update_weights || broadcast -> finish
        return RefitReport(
            version=version, previous_version=previous, transport="nccl", ok=True,
            bytes=sum(t.numel() * t.element_size() for t in params.values()), num_tensors=len(params),
            total_s=time.perf_counter() - t0,
        ).to_dict()


def _get(ref, timeout: float):
    """ray.get, raising our own exceptions (RefitFailed, RefitInProgress, ...) rather than Ray's wrapper."""
    import ray

    try:
        return ray.get(ref, timeout=timeout)
    except ray.exceptions.RayTaskError as exc:
        cause = getattr(exc, "cause", None)
        if isinstance(cause, (RefitFailed, RefitInProgress, WeightSyncNotInitialized, ValueError, TypeError)):
            raise cause from None
        raise


def _overall(step_timeout: float) -> float:
    """A refit is four steps, each under its own timeout, plus a rollback in the worst case."""
    return 6 * step_timeout + 30


def _node_ip() -> str:
    try:
        import ray

        if ray.is_initialized():
            # The address the cluster registered for this node (127.0.0.1 on a local cluster), not
            # whatever interface this process would pick on its own.
            node_id = ray.get_runtime_context().get_node_id()
            for node in ray.nodes():
                if node.get("NodeID") == node_id and node.get("NodeManagerAddress"):
                    return node["NodeManagerAddress"]
            return ray.util.get_node_ip_address()
    except Exception:
        pass
    return "127.0.0.1"


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
