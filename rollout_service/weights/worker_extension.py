"""Methods added to every vLLM worker (``worker_extension_cls``), reached by ``collective_rpc``.

Weights must be received *inside* the worker: passing tensors as ``collective_rpc`` arguments
through AsyncLLM fails and can leave a half-loaded model (FIELD-NOTES). Measured here: even with
``VLLM_ENABLE_V1_MULTIPROCESSING=0`` the worker runs in an EngineCore *subprocess* of the engine
actor, reached through msgpack (functions and tensors are not serializable there), and that
process is not connected to Ray. So the worker itself joins a gloo group, reads a safetensors file
the engine actor wrote, or reads a checkpoint directory, and loads through vLLM's in-place
``reload_weights`` (copying into parameters directly has no effect on CPU, where the model computes
from packed copies).

A refit is staged, loaded, then committed, so a failure at any point leaves consistent weights:

- ``rs_stage_*`` receives the new state dict without touching the model (a failed transfer is
  dropped with no effect);
- ``rs_load_staged`` loads it, remembering the source of the weights it replaces;
- ``rs_commit`` forgets that source; ``rs_rollback`` reloads it (the model may be half-loaded
  after a failed load, or loaded while another engine failed).

The source of the current weights is kept as a CPU copy of the received tensors (collective,
object store) or as a checkpoint path (path transport, and the model's own path at start).
"""

from __future__ import annotations

import hashlib
import os
import time
from typing import Any

from rollout_service.weights.worker_scoring import ScoringWorker
from rollout_service.weights.worker_sources import (Recording, Source, StageJob, StagingFallback, checkpoint_bytes,
                                                    checkpoint_files, merged, read_checkpoint, read_file, tensors_of)

# The staging methods of this class that a background stage (rs_stage_begin) runs the work of.
STAGE_COLLECTIVE_METHOD = "rs_stage_collective"
STAGE_PATH_METHOD = "rs_stage_path"
STAGE_FILE_METHOD = "rs_stage_safetensors_file"


class _InjectedLoadFault(RuntimeError):
    pass


class RolloutWorkerExtension(ScoringWorker):
    """Mixed into vLLM's worker class; ``self`` is the worker (``self.model_runner`` etc.). The
    canary's scoring methods come from :class:`~rollout_service.weights.worker_scoring.ScoringWorker`."""

    # ---------------------------------------------------------------- diagnostics
    def rs_weights_checksum(self) -> str:
        """sha256 over the model's parameters (name, dtype, bytes) as loaded in this worker."""
        import torch

        model = self.model_runner.get_model()
        h = hashlib.sha256()
        with torch.no_grad():
            for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
                t = p.detach().to("cpu").contiguous()
                h.update(name.encode())
                h.update(str(t.dtype).encode())
                h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        return h.hexdigest()

    def rs_param_shapes(self) -> list[tuple[str, list[int], str]]:
        """Checkpoint-format names are what the trainer sends; exposed for diagnostics."""
        model = self.model_runner.get_model()
        return [(n, list(p.shape), str(p.dtype)) for n, p in model.named_parameters()]

    def rs_process_info(self) -> dict[str, Any]:
        """Where this worker runs (pid, parent, whether Ray is connected here), for docs and tests."""
        try:
            import ray

            ray_connected = bool(ray.is_initialized())
        except Exception:  # pragma: no cover - ray always importable in our images
            ray_connected = False
        return {"pid": os.getpid(), "ppid": os.getppid(), "ray_connected": ray_connected, "rank": self.rank}

    # ------------------------------------------------------- direct (unstaged) loads
    def rs_reload_from_path(self, path: str) -> None:
        """Load a HF-format checkpoint directory in place (no rollback bookkeeping)."""
        self._rs_state()  # the record first: vLLM's reload rewrites model_config.model to ``path``
        self.reload_weights(weights_path=path)

    def rs_reload_from_tensors(self, named_tensors: list[tuple[str, Any]]) -> None:
        """Load (name, tensor) pairs that arrived inside this worker (no rollback bookkeeping)."""
        self._rs_state()
        self.reload_weights(weights_iterator=iter(named_tensors))

    # ------------------------------------------------------------ collective group
    def rs_weight_sync_init(
        self, host: str, port: int, world_size: int, rank_offset: int, group_name: str, timeout_s: float
    ) -> int:
        """Join the trainer's dedicated gloo group (never the default group). Returns this rank."""
        from rollout_service.weights.collective import open_group

        self.rs_weight_sync_close()
        rank = rank_offset + int(self.rank)
        self._rs_group = open_group(host, port, world_size, rank, group_name, timeout_s)
        return rank

    def rs_weight_sync_close(self) -> None:
        self._rs_group = None

    def rs_bench_raw_receive(self, bucket_sizes: list[int]) -> dict[str, float]:
        """Benchmark baseline: raw broadcasts of these sizes into preallocated, touched buffers,
        every receive posted at once behind a one-header handshake (scripts/bench_refit.py times
        the trainer side). Timed here from the handshake on: the window of ``rs_stage_collective``'s
        ``seconds`` (the report's ``worker_receive_s``)."""
        import torch

        bufs = [torch.zeros(n, dtype=torch.uint8) for n in bucket_sizes]
        header = torch.empty(2, dtype=torch.int64)
        t_enter = time.perf_counter()
        header_work = self._rs_group.broadcast_async(header)
        works = [self._rs_group.broadcast_async(b) for b in bufs]
        header_work.wait()
        t0 = time.perf_counter()
        for w in works:
            w.wait()
        t1 = time.perf_counter()
        return {"seconds": t1 - t0, "with_handshake_s": t1 - t_enter}

    # ----------------------------------------------------------------- staging
    def _rs_state(self):
        if not hasattr(self, "_rs_current"):
            # Before any refit the weights are the model's own checkpoint. (Read before any reload:
            # vLLM's reload_weights(weights_path=...) rewrites model_config.model to that path.)
            self._rs_current = Source(path=self.model_runner.vllm_config.model_config.model)
            self._rs_previous = None
            self._rs_staged = None
            self._rs_spare = None
        return self

    def _rs_new_round(self) -> None:
        """A refit starts: a backup still held is one a failed commit left behind (that refit rolled
        forward), never one to roll back to from here on."""
        self._rs_state()
        if self._rs_previous is not None:
            self._rs_drop(self._rs_previous)
            self._rs_previous = None

    def _rs_drop(self, source: "Source | None") -> None:
        """A source no longer needed: its receive buffers serve the next collective refit."""
        if source is not None and source.buffers is not None:
            self._rs_spare = source.buffers
    def rs_stage_collective(self, plan_json: str) -> dict[str, Any]:
        """Receive every bucket of the broadcast; the model is not touched."""
        self._rs_new_round()
        self.rs_discard_staged()
        receive = self._rs_collective_receiver(plan_json)
        t0 = time.perf_counter()
        self._rs_staged = receive()
        return {"bytes": self._rs_staged.nbytes, "seconds": time.perf_counter() - t0}

    def _rs_collective_receiver(self, plan_json: str):
        """What receives the broadcast (``() -> Source``), its buffers allocated here, before any
        receive is posted (an allocation that fails raises with nothing posted)."""
        from rollout_service.weights.collective import BucketPlan, allocate_receive_buffers, receive_buckets

        group = getattr(self, "_rs_group", None)
        if group is None:
            raise RuntimeError("no weight-sync group: call init_weight_sync first")
        plan = BucketPlan.from_json(plan_json)
        spare, self._rs_spare = self._rs_spare, None
        try:
            buffers = allocate_receive_buffers(plan, spare)
        except (MemoryError, RuntimeError) as exc:
            raise RuntimeError(f"receive buffers of {plan.total_bytes} bytes not allocated: {exc}") from exc

        def receive() -> Source:
            tensors, received = receive_buckets(group, plan, buffers)
            return Source(tensors=tensors, buffers=received)

        return receive

    def rs_stage_safetensors_file(self, path: str, delete: bool = True) -> dict[str, Any]:
        """Read a safetensors file the engine actor wrote (object-store transport) into memory."""
        self._rs_new_round()
        self.rs_discard_staged()
        t0 = time.perf_counter()
        self._rs_staged = read_file(path, delete)
        return {"bytes": self._rs_staged.nbytes, "seconds": time.perf_counter() - t0}

    # ------------------------------------------------ staging while the engine generates
    # vLLM's engine core runs a collective_rpc between two scheduler steps, in its own loop: a stage
    # that blocks in it (a broadcast waiting on the trainer, a file read) stalls every request of
    # the engine as a pause would. So an overlapped stage runs in a thread of the worker: begin
    # starts it and returns; poll (a short call between steps) says whether it is done and, once
    # it is, makes what it received the staged source. The model is not touched until the refit
    # pauses and loads it (rs_load_staged). Every call names its refit (``token``): a late call of
    # a refit that already ended (its controller gave up on this engine, or another engine failed
    # first) never touches a later refit's state; a begin past ``not_after`` (the engine actor's
    # deadline) or of a fenced refit (its failure path ran
    # here) is refused (``not_after``: :func:`rollout_service.weights.staging.host_deadline`).
    def rs_stage_begin(self, method: str, args: list, budget_bytes: int | None = None, token: str | None = None,
                       not_after: Any = None) -> dict[str, Any]:
        """Start staging as ``method(*args)`` would (a staging method of this class), in a thread.
        Returns ``{"started": True, "bytes": n}``, or ``{"started": False, "fallback": why}`` when
        this engine stages inside the refit's pause instead: a second copy of ``n`` bytes over
        ``budget_bytes``, or (path, file) memory that cannot hold it. A collective stage never
        falls back on its own (every worker of the group receives the same broadcast at once): a
        failed allocation is an error, and the refit ends with no engine paused."""
        import threading

        if token is not None and token in self._rs_fences():
            raise RuntimeError(f"refit {token} already ended on this engine (its failure path ran here)")
        from rollout_service.weights.staging import deadline_passed

        if deadline_passed(not_after):
            raise TimeoutError(f"refit {token}: the stage began past its deadline")
        self._rs_new_round()
        self.rs_discard_staged()
        if method == STAGE_COLLECTIVE_METHOD:
            from rollout_service.weights.collective import BucketPlan

            nbytes = BucketPlan.from_json(args[0]).total_bytes
        elif method == STAGE_PATH_METHOD:
            nbytes = checkpoint_bytes(args[0])
        elif method == STAGE_FILE_METHOD:
            nbytes = os.path.getsize(args[0])
        else:
            raise ValueError(f"cannot stage in the background through {method!r}")
        if budget_bytes is not None and nbytes > budget_bytes:
            return {"started": False, "bytes": nbytes,
                    "fallback": f"{nbytes} bytes over refit.staging_budget_bytes ({budget_bytes})"}
        if method == STAGE_COLLECTIVE_METHOD:
            work = self._rs_collective_receiver(args[0])  # raises on a failed allocation (nothing posted)
        elif method == STAGE_PATH_METHOD:
            if not checkpoint_files(args[0]):
                return {"started": False, "bytes": nbytes,
                        "fallback": "no *.safetensors in the checkpoint: the load reads it inside the pause"}
            work = lambda: read_checkpoint(args[0])  # noqa: E731
        else:
            work = lambda: read_file(args[0], bool(args[1]) if len(args) > 1 else True)  # noqa: E731
        job = StageJob(work, token, collective=method == STAGE_COLLECTIVE_METHOD)
        self._rs_job = job
        threading.Thread(target=job.run, name="rs-stage", daemon=True).start()
        return {"started": True, "bytes": nbytes}

    def rs_stage_poll(self, token: str | None = None) -> dict[str, Any]:
        """``{"done": False}`` while the background stage of refit ``token`` runs; once it ended,
        ``{"done": True, "bytes", "seconds"}`` with its result staged, or its error raised (nothing
        staged), or ``{"done": True, "fallback": why}`` (a path or file stage out of memory: the
        refit stages this engine inside its pause). Asked again, it answers the same (the workers
        of one engine are polled together until all are done)."""
        job = getattr(self, "_rs_job", None)
        if job is None or job.token != token:
            raise RuntimeError(f"no background stage of refit {token} here (discarded, superseded, or never begun)")
        if not job.finished.is_set():
            return {"done": False}
        if job.error is not None:
            if isinstance(job.error, (MemoryError, StagingFallback)) and not job.collective:
                return {"done": True, "fallback": f"{type(job.error).__name__}: {job.error}"}
            raise job.error
        if not job.installed:
            job.installed = True
            self._rs_staged = job.source
        return {"done": True, "bytes": job.source.nbytes, "seconds": job.seconds}

    def _rs_fences(self) -> list[str]:
        if not hasattr(self, "_rs_fenced"):
            self._rs_fenced: list[str] = []
        return self._rs_fenced

    def rs_stage_path(self, path: str) -> dict[str, Any]:
        """Checkpoint-directory transport inside the pause: nothing to receive, the load reads the
        files (an overlapped stage reads them beforehand: ``rs_stage_begin``)."""
        self._rs_new_round()
        nbytes = checkpoint_bytes(path)
        self.rs_discard_staged()  # (and a background stage left by an ended refit)
        self._rs_staged = Source(path=path)
        return {"bytes": nbytes, "seconds": 0.0}

    def rs_export_current(self, path: str) -> dict[str, Any] | None:
        """The committed weights, for a replacement engine: a checkpoint path, or (received tensors)
        written to the safetensors file ``path``. Only rank 0 answers: every worker of an engine
        received the same full state dict."""
        self._rs_state()
        if int(self.rank) != 0:
            return None
        if self._rs_previous is not None:
            raise RuntimeError("a refit is loading: the current weights are not committed yet")
        current = self._rs_current
        if current.path is not None:
            return {"path": current.path}
        from safetensors.torch import save_file

        save_file({name: t.contiguous() for name, t in current.tensors}, path)
        return {"file": path, "bytes": current.nbytes}

    def rs_discard_staged(self, token: str | None = None, fence: bool = False) -> None:
        """Drop the staged weights, and a background stage still running (what it receives is
        dropped when it ends; a broadcast it waits on ends by the trainer's trailer or the group's
        timeout). With ``token``: only if they are refit ``token``'s (a late call of an ended refit
        leaves a later one alone); ``fence``: refit ``token`` is over here, a begin of it that
        arrives later is refused (its controller's failure path)."""
        self._rs_state()
        if token is not None and fence:
            fences = self._rs_fences()
            fences.append(token)
            del fences[:-16]
        job = getattr(self, "_rs_job", None)
        if token is not None and (job is None or job.token != token):
            return  # not this refit's (a stage of another refit, or nothing staged in the background)
        if job is not None:
            job.abandon()
            self._rs_job = None
        self._rs_drop(self._rs_staged)
        self._rs_staged = None

    # -------------------------------------------------------- load / commit / rollback
    def rs_load_staged(self, fail_after_tensors: int | None = None) -> dict[str, Any]:
        """Load the staged state dict in place. ``fail_after_tensors`` injects a fault (tests only)."""
        self._rs_state()
        staged = self._rs_staged
        if staged is None:
            raise RuntimeError("nothing staged to load")
        self._rs_staged = None
        self._rs_job = None  # (a background stage's job keeps no reference to what is loaded)
        self._rs_previous, self._rs_current = self._rs_current, staged
        t0 = time.perf_counter()
        if fail_after_tensors is not None:
            self._rs_reload(weights_iterator=_failing_iter(tensors_of(staged), fail_after_tensors))
        else:
            self._rs_load(staged)
        self._rs_current = staged.settled()
        return {"seconds": time.perf_counter() - t0}

    def rs_commit(self) -> None:
        self._rs_state()
        self._rs_drop(self._rs_previous)
        self._rs_previous = None

    def rs_rollback(self) -> dict[str, Any]:
        """Reload the weights that were current before the last ``rs_load_staged`` (no-op if none)."""
        self._rs_state()
        self.rs_discard_staged()
        previous = self._rs_previous
        if previous is None:
            return {"reloaded": False}
        t0 = time.perf_counter()
        self._rs_load(previous)
        self._rs_drop(self._rs_current)
        self._rs_current, self._rs_previous = previous, None
        return {"reloaded": True, "source": previous.describe(), "seconds": time.perf_counter() - t0}

    def rs_reload_current(self) -> dict[str, Any]:
        """Reload the last committed source (GPU NCCL path: vLLM loaded in place and failed mid-way)."""
        self._rs_state()
        t0 = time.perf_counter()
        self._rs_load(self._rs_current)
        return {"source": self._rs_current.describe(), "seconds": time.perf_counter() - t0}

    # ------------------------------------------------------------- NCCL rounds (GPU)
    # vLLM's weight-transfer engine loads what it receives straight into the model (layerwise, in
    # place), so nothing of ours sees the tensors. These wrap vLLM's worker methods so an NCCL
    # round leaves the same record as the other transports: the engine's target model is wrapped
    # (vLLM's set_weight_update_target) to copy every tensor it loads to CPU as it passes; finish
    # makes them the current source (the previous one kept until commit); abort goes back to the
    # last committed weights. A replacement engine then exports what was loaded, and a later
    # failed round rolls back to it, not to the model's own checkpoint.
    def rs_nccl_start(self) -> None:
        self._rs_new_round()
        self.start_weight_update()
        engine = self.weight_transfer_engine
        self._rs_nccl_received = []
        engine.set_weight_update_target(Recording(engine.model, self._rs_nccl_received), engine.model_config)

    def rs_nccl_update(self, update_info: dict | list[dict]) -> None:
        self.update_weights(update_info=update_info)

    def rs_nccl_finish(self) -> dict[str, Any]:
        """vLLM's finish (the layerwise load is finalized); what the round loaded becomes current."""
        self.finish_weight_update()
        received = getattr(self, "_rs_nccl_received", None)
        self._rs_nccl_received = None
        if received is None:
            raise RuntimeError("finish of an NCCL round that rs_nccl_start did not open")
        full = merged(self._rs_current, received)  # a round may send a subset of the weights
        self._rs_drop(self._rs_previous)
        self._rs_previous, self._rs_current = self._rs_current, Source(tensors=full)
        return {"tensors": len(received), "bytes": self._rs_current.nbytes}

    def rs_nccl_abort(self) -> dict[str, Any]:
        """The round failed or was abandoned: back to the last committed weights, reloaded in full
        (vLLM loaded part of the round in place)."""
        self._rs_state()
        self._rs_nccl_received = None
        engine = getattr(self, "weight_transfer_engine", None)
        if getattr(self, "_weight_update_active", False):  # abandoned between start and finish
            try:
                self.finish_weight_update()
            except Exception:  # the reload below overwrites whatever it left
                self._weight_update_active = False
        if engine is not None:
            engine.reset_weight_update_target()
        if self._rs_previous is not None:  # finished, then failed before the commit
            return self.rs_rollback()
        return self.rs_reload_current()

    def _rs_load(self, source: Source) -> None:
        if source.tensors is not None:
            self._rs_reload(weights_iterator=iter(source.tensors))
        else:
            self._rs_reload(weights_path=source.path)

    def _rs_reload(self, **kwargs) -> None:
        """``reload_weights``, leaving a reloadable model if it raises.

        Measured: an exception inside vLLM's layerwise reload leaves the layers not yet complete on
        the meta device with wrapped loaders, and the next ``reload_weights`` then fails
        (``'Parameter' object has no attribute 'weight_loader'``). Finalizing puts every layer back
        on its kernel tensors (partly stale or partly new: the rollback's full reload overwrites them).
        """
        try:
            self.reload_weights(**kwargs)
        except BaseException:
            try:
                from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload

                finalize_layerwise_reload(self.model_runner.get_model(), self.model_runner.vllm_config.model_config)
            except Exception:  # the original error is the one to report
                pass
            raise


def _failing_iter(it, n: int):
    for i, item in enumerate(it):
        if i >= n:
            raise _InjectedLoadFault(f"injected load fault after {n} tensors")
        yield item
