"""Trainer-side client for in-flight refits. Imports neither vLLM nor (until used) Ray.

A trainer holds one :class:`TrainerClient` (it is picklable: ship it to a Ray actor and call
``init_weight_sync`` there). It talks to the service's refit controller through its Ray handle::

    client = TrainerClient()                 # finds the running service's controller
    client.init_weight_sync()                # the service's refit.backend: gloo group (CPU) or NCCL (GPU)
    report = client.refit("7", model.state_dict())               # collective broadcast
    report = client.refit("8", model.state_dict(), transport="object_store")
    report = client.refit("9", "/ckpt/step-9", transport="path")  # HF checkpoint directory
    client.stats()                           # version, in-flight rollouts and their lag

Unless given to the constructor, ``bucket_bytes`` and ``timeout_s`` are the service's
``refit.bucket_bytes`` / ``refit.step_timeout_s``, and ``init_weight_sync``'s backend is its
``refit.backend``: read from the controller's config when they are needed (so a redeploy's values
apply to the next call).

``refit`` returns the report dict (:class:`~rollout_service.refit.types.RefitReport`) or raises
``RefitInProgress`` / ``RefitFailed`` (engines resumed on the previous weights either way).

For the collective transport the trainer is the broadcast root: ``refit`` starts the controller's
call (every engine receives, while it generates under ``refit.staging: overlap`` or after the
pause under ``inside``) and broadcasts the buckets itself, concurrently.

The client is async-first: every method is a coroutine (``ainit_weight_sync``, ``arefit``,
``astats``, ``aget_rollout``, ``aweights_checksums``, ``asettings``) and its plain name is a thin
synchronous shim that runs it to completion (in a private event loop; on a worker thread when the
calling thread already runs one). Async trainers (an async Ray actor, where a blocking ``ray.get``
stalls the event loop for the whole refit) await the coroutines::

    await client.ainit_weight_sync()
    report = await client.arefit("7", model.state_dict())
    await client.astats(); await client.aget_rollout(rid); await client.aweights_checksums()

The coroutines await the controller's object refs; what blocks — finding the controller by name on
first use, joining the gloo group, the broadcast, the object-store copy, and vLLM's synchronous
NCCL trainer engine — runs in a worker thread. A refit of either kind refuses to overlap another.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from rollout_service.weights.collective import PackBuffers, free_port, open_group
from rollout_service.refit.awaiting import aget, mark_retrieved, on_callers_device, run_sync
from rollout_service.refit.deadlines import trainer_wait_s
from rollout_service.refit.gloo_trainer import GlooTrainer
from rollout_service.refit.nccl_trainer import NcclTrainer
from rollout_service.refit.rollout_reads import read_group, read_trajectory
from rollout_service.refit.transports import CheckpointPathTransfer, ObjectStoreTransfer
from rollout_service.refit.types import GROUP_UNKNOWN, MEMBERSHIP_CHANGED, RefitInProgress, WeightSyncNotInitialized

logger = logging.getLogger("rollout_service.refit.client")

TRANSPORTS = ("collective", "object_store", "path")
BACKENDS = ("gloo", "nccl")


@dataclass(frozen=True)
class RefitSettings:
    """What one call uses: the client's explicit arguments, else the service's ``refit`` config."""

    backend: str
    bucket_bytes: int
    timeout_s: float


class TrainerClient(NcclTrainer, GlooTrainer):
    def __init__(
        self,
        controller=None,
        *,
        bucket_bytes: int | None = None,
        timeout_s: float | None = None,
        clear_cache: bool | None = None,
    ):
        """``bucket_bytes`` / ``timeout_s`` None: the service's ``refit.bucket_bytes`` /
        ``refit.step_timeout_s``; ``clear_cache`` None: its ``refit.clear_cache``."""
        self._controller = controller
        self.bucket_bytes = bucket_bytes
        self.timeout_s = timeout_s
        self.clear_cache = clear_cache
        self._group = None
        self._group_timeout_s = timeout_s or 300.0  # the gloo group's own timeout (init_weight_sync's)
        self._group_formed = False  # init_weight_sync succeeded once: re-forming it is the trainer's intent
        self._nccl = None
        self._pack_buffers = PackBuffers()
        self._lock = threading.Lock()  # one refit at a time, sync or async (held across threads)

    def __getstate__(self):
        # Picklable: the group and locks are per process; the receiver calls init_weight_sync.
        return {"_controller": self._controller, "bucket_bytes": self.bucket_bytes, "timeout_s": self.timeout_s,
                "clear_cache": self.clear_cache}

    def __setstate__(self, state):
        self.__init__(**{k.lstrip("_"): v for k, v in state.items()})

    @property
    def controller(self):
        """The refit controller's handle (found by name on first use: a blocking GCS query)."""
        if self._controller is None:
            from rollout_service.refit.controller import get_controller

            self._controller = get_controller()
        return self._controller

    async def _acontroller(self):
        if self._controller is None:
            await asyncio.to_thread(lambda: self.controller)
        return self._controller

    def settings(self) -> RefitSettings:
        """The backend, bucket size and step timeout a call uses: the explicit constructor arguments,
        the rest from the service's ``refit`` config (one controller query)."""
        return run_sync(self.asettings())

    async def asettings(self) -> RefitSettings:
        """:meth:`settings`, awaited."""
        return self._resolve(await aget((await self._acontroller()).refit_config.remote(), 60))

    def _resolve(self, refit_config: Mapping[str, Any]) -> RefitSettings:
        from rollout_service.config import RefitConfig

        refit = RefitConfig.model_validate(refit_config)
        return RefitSettings(
            backend=refit.backend,
            bucket_bytes=self.bucket_bytes or refit.bucket_bytes,
            timeout_s=self.timeout_s or refit.step_timeout_s,
        )

    def _explicit(self) -> RefitSettings | None:
        """The settings without asking the controller, when the caller fixed both values (the backend
        is not needed for a refit: it follows the group init_weight_sync formed)."""
        if self.bucket_bytes and self.timeout_s:
            return RefitSettings(backend="", bucket_bytes=self.bucket_bytes, timeout_s=self.timeout_s)
        return None

    # ------------------------------------------------------------------- set-up
    def init_weight_sync(self, *, backend: str | None = None, host: str | None = None, port: int | None = None,
                         timeout_s: float | None = None) -> dict[str, Any]:
        """:meth:`ainit_weight_sync`, run to completion."""
        return run_sync(self.ainit_weight_sync(backend=backend, host=host, port=port, timeout_s=timeout_s))

    async def ainit_weight_sync(
        self,
        *,
        backend: str | None = None,
        host: str | None = None,
        port: int | None = None,
        timeout_s: float | None = None,
    ) -> dict[str, Any]:
        """Form the collective group: this process is rank 0, every engine worker joins.

        ``backend`` None: the service's ``refit.backend``. gloo (CPU): a dedicated
        ``ProcessGroupGloo`` on a TCPStore this process hosts — never the default process group.
        nccl (GPU, unverified here): vLLM's NCCL weight-transfer engine, with packed buffers of
        ``bucket_bytes``; the engines were started for it by ``refit.backend: nccl``. The address
        look-up (a GCS query) and the join run in a worker thread.
        """
        settings = await self.asettings()
        controller = await self._acontroller()
        backend, host, port, timeout = await asyncio.to_thread(
            self._weight_sync_args, backend or settings.backend, host, port, timeout_s or settings.timeout_s)
        self._group = self._nccl = None  # one transport at a time: the new one replaces the old
        if backend == "nccl":  # pragma: no cover - GPU only
            world = await aget(controller.weight_sync_world_size.remote(), timeout)
            # vLLM's trainer engine is synchronous: its controller calls block that thread, not the loop.
            return await asyncio.to_thread(on_callers_device(self._init_nccl), host, port, timeout, world,
                                           settings.bucket_bytes)
        world = await aget(controller.weight_sync_world_size.remote(), timeout)
        name, t0 = _group_name(), time.perf_counter()
        ranks_ref = controller.init_weight_sync.remote(host, port, name, timeout)
        group = await asyncio.to_thread(open_group, host, port, world, 0, name, timeout)
        ranks = await aget(ranks_ref, timeout)
        self._group, self._group_timeout_s, self._group_formed = group, timeout, True
        return _gloo_info(name, host, port, world, ranks, t0)

    def _weight_sync_args(self, backend, host, port, timeout_s) -> tuple[str, str, int, float]:
        if backend not in BACKENDS:
            raise ValueError(f"backend must be gloo or nccl, got {backend!r}")
        host = host or _node_ip()
        return backend, host, port or free_port(host), timeout_s

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
        """:meth:`arefit`, run to completion."""
        return run_sync(self.arefit(version, params, transport=transport, clear_cache=clear_cache, timeout_s=timeout_s,
                                 on_bucket=on_bucket))

    async def arefit(
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

        ``on_bucket(i)`` runs after bucket ``i`` is on the wire (collective only, in the sending
        worker thread); if it raises, the transfer is aborted on every worker and the refit fails
        cleanly (failure injection). Cancelling the await does not stop the refit (the controller runs it to its end, and a
        started broadcast is completed): the client stays busy (``RefitInProgress``) until it is over.
        """
        _check_transport(transport)
        self._acquire()
        try:
            task = asyncio.ensure_future(self._arefit_locked(version, params, transport, clear_cache, timeout_s,
                                                             on_bucket))
        except BaseException:
            self._lock.release()
            raise
        task.add_done_callback(mark_retrieved)
        return await asyncio.shield(task)

    async def _arefit_locked(self, version, params, transport, clear_cache, timeout_s, on_bucket) -> dict[str, Any]:
        try:
            await self._acontroller()
            settings = self._explicit() or await self.asettings()
            version, clear, timeout = self._refit_args(version, clear_cache, timeout_s, settings)
            if transport == "collective":
                if self._nccl is not None:  # pragma: no cover - GPU only
                    previous = await aget(self.controller.current_version.remote(), 60)
                    return await asyncio.to_thread(on_callers_device(self._refit_nccl), version, params, previous)
                bucket = settings.bucket_bytes
                try:
                    if self._group is not None:  # before any byte is sent: is the group still whole?
                        await aget(self.controller.check_weight_sync.remote(), 60)
                    report = await self._arefit_collective(version, params, clear, timeout, on_bucket, bucket)
                    return {**report, "weight_sync_reformed": None}
                except WeightSyncNotInitialized as exc:
                    if not self._reform_after(exc):
                        raise
                    logger.warning("re-forming the weight-sync group before refit %s: %s", version, exc)
                    await self.ainit_weight_sync(backend="gloo", timeout_s=self._group_timeout_s)
                    report = await self._arefit_collective(version, params, clear, timeout, on_bucket, bucket)
                    return {**report, "weight_sync_reformed": str(exc)}
            transfer = await asyncio.to_thread(_staged_transfer, params, transport)
            report = await aget(self._start(version, transfer, clear, timeout), trainer_wait_s(timeout))
            return {**report, "weight_sync_reformed": None}
        finally:
            self._lock.release()

    def _reform_after(self, exc: WeightSyncNotInitialized) -> bool:
        """An engine was lost or replaced since the group was formed, or the controller holds no
        group though this client does (the controller was restarted): the group is re-formed over
        the engines serving now, once, and the refit retried (the trainer had formed a group
        before). The report then says why (``weight_sync_reformed``)."""
        return str(exc).startswith((MEMBERSHIP_CHANGED, GROUP_UNKNOWN)) and self._group_formed

    def _acquire(self) -> None:
        if not self._lock.acquire(blocking=False):
            raise RefitInProgress("this client is already running a refit")

    def _refit_args(self, version, clear_cache, timeout_s, settings: RefitSettings) -> tuple[str, bool | None, float]:
        return str(version), self.clear_cache if clear_cache is None else clear_cache, timeout_s or settings.timeout_s

    def _start(self, version: str, transfer, clear, timeout):
        """The controller's refit call (pause, receive or stage, load, label, resume): its ref."""
        return self.controller.refit.remote(version, transfer, clear_cache=clear, timeout_s=timeout)

    # --------------------------------------------------------------------- misc
    def stats(self) -> dict[str, Any]:
        """:meth:`astats`, run to completion."""
        return run_sync(self.astats())

    async def astats(self) -> dict[str, Any]:
        """The controller's view: weight version, engines and their health, in-flight rollouts and their lag."""
        return await aget((await self._acontroller()).stats.remote(), 60)

    def get_rollout(self, rollout_id: str) -> dict[str, Any] | None:
        """:meth:`aget_rollout`, run to completion."""
        return run_sync(self.aget_rollout(rollout_id))

    async def aget_rollout(self, rollout_id: str) -> dict[str, Any] | None:
        """The trajectory of one rollout (segments: token_ids, loss_mask, logprobs, weight_versions),
        the ``GET /v1/rollouts/{id}`` document, None if unknown. Read from the rollout store
        directly (the service's Redis): a data read, not the control plane's business."""
        config = await aget((await self._acontroller()).store_config.remote(), 60)
        return await read_trajectory(config, rollout_id)

    def abort(self, rollout_id: str, reason: str | None = None) -> dict[str, Any] | None:
        """:meth:`aabort`, run to completion."""
        return run_sync(self.aabort(rollout_id, reason))

    async def aabort(self, rollout_id: str, reason: str | None = None) -> dict[str, Any] | None:
        """Abort a rollout, as ``POST /v1/rollouts/{id}/abort`` does: its running call ends at its
        engine's next step (``finish_reason`` abort, its tokens so far stored), its next calls get
        409 ``rollout_aborted``. Idempotent (the first reason stands); None if the rollout is unknown.
        docs/trainer-integration.md, "Steering rollouts"."""
        from rollout_service.store.base import validate_rollout_id

        validate_rollout_id(rollout_id)
        if reason is not None and (not isinstance(reason, str) or len(reason) > 512):
            raise ValueError("reason must be a string of at most 512 characters (as POST /v1/rollouts/{id}/abort takes)")
        return await aget((await self._acontroller()).abort_rollout.remote(rollout_id, reason), 60)

    def group(self, group_id: str) -> dict[str, Any] | None:
        """:meth:`agroup`, run to completion."""
        return run_sync(self.agroup(group_id))

    async def agroup(self, group_id: str) -> dict[str, Any] | None:
        """A group of rollouts (``GET /v1/groups/{id}?trajectories=true``): every member's state
        (running, finished, failed, aborted, stale, missing), turns, first and last weight version and
        trajectory; None if no call named the group. ``rollout_service.training.rows_from_group``
        turns it into the rows of its finished members. Read from the rollout store directly."""
        config = await aget((await self._acontroller()).store_config.remote(), 60)
        return await read_group(config, group_id)

    def abort_group(self, group_id: str, reason: str | None = None) -> dict[str, Any] | None:
        """:meth:`aabort_group`, run to completion."""
        return run_sync(self.aabort_group(group_id, reason))

    async def aabort_group(self, group_id: str, reason: str | None = None) -> dict[str, Any] | None:
        """Abort every member of a group, as ``POST /v1/groups/{id}/abort`` does (each as
        :meth:`aabort`, a member still on its first call included); None if no call named the group."""
        from rollout_service.store.base import validate_rollout_id

        validate_rollout_id(group_id)
        if reason is not None and (not isinstance(reason, str) or len(reason) > 512):
            raise ValueError("reason must be a string of at most 512 characters (as POST /v1/groups/{id}/abort takes)")
        return await aget((await self._acontroller()).abort_group.remote(group_id, reason), 60)

    def weights_checksums(self) -> list[str]:
        """:meth:`aweights_checksums`, run to completion."""
        return run_sync(self.aweights_checksums())

    async def aweights_checksums(self) -> list[str]:
        """A checksum of every engine worker's weights (equal across engines after a refit)."""
        timeout = self.timeout_s or (await self.asettings()).timeout_s
        return await aget((await self._acontroller()).weights_checksums.remote(), timeout)


# ------------------------------------------------------------------------ helpers

def _check_transport(transport: str) -> None:
    if transport not in TRANSPORTS:
        raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")


def _staged_transfer(params, transport: str):
    """The transfer for the object-store or path transport (blocking: copies and ``ray.put``s)."""
    if transport == "object_store":
        import ray

        cpu = {name: t.detach().to("cpu").contiguous() for name, t in params.items()}
        transfer = ObjectStoreTransfer([ray.put(cpu)])
        del cpu
        return transfer
    if not isinstance(params, str):
        raise TypeError("transport='path' takes a checkpoint directory path")
    return CheckpointPathTransfer(params)


def _group_name() -> str:
    return f"refit-{uuid.uuid4().hex[:8]}"


def _gloo_info(name: str, host: str, port: int, world: int, ranks, t0: float) -> dict[str, Any]:
    return {"backend": "gloo", "group": name, "host": host, "port": port, "world_size": world,
            "worker_ranks": ranks, "seconds": time.perf_counter() - t0}


def _node_ip() -> str:
    """The address Ray registered for this node (127.0.0.1 on a local cluster), else loopback."""
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except Exception:
        pass
    return "127.0.0.1"
