"""The weight side of the simulated engine (:mod:`rollout_service.engine.simulated`): what the real
engine's worker extension (:mod:`rollout_service.weights.worker_extension`) does with weights —
stage (also in a background thread, ahead of a refit's pause), load, commit, roll back, export —
on digests instead of tensors, with the same semantics, so the fleet's and the refit's logic runs
against it as against vLLM's workers."""

from __future__ import annotations

import hashlib
import os
import threading
import time
from dataclasses import dataclass
from typing import Any


def _digest_path(path: str) -> str:
    """A checkpoint directory's identity: its safetensors files' names, sizes and modification times."""
    h = hashlib.sha256(os.path.abspath(path).encode())
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            st = os.stat(os.path.join(path, name))
            h.update(f"{name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()


def _digest_tensors(named) -> tuple[str, int]:
    """sha256 over (name, dtype, bytes) of checkpoint-format tensors, and their size."""
    import torch

    h, nbytes = hashlib.sha256(), 0
    for name, t in sorted(named, key=lambda kv: kv[0]):
        t = t.detach().to("cpu").contiguous()
        h.update(name.encode())
        h.update(str(t.dtype).encode())
        if t.numel():
            h.update(t.view(torch.uint8).numpy().tobytes())
        nbytes += t.numel() * t.element_size()
    return h.hexdigest(), nbytes


@dataclass
class _Weights:
    digest: str
    path: str | None = None  # a checkpoint directory, when that is where they came from


class SimulatedWorker:
    """The weight side of the real engine's worker extension (``rs_*`` methods, reached by
    ``collective_rpc``), with the same stage / load / commit / rollback semantics, on digests."""

    def __init__(self, model_dir: str):
        self.current = _Weights(_digest_path(model_dir), path=model_dir)
        self.previous: _Weights | None = None
        self.staged: _Weights | None = None
        self.group = None
        self.job: dict[str, Any] | None = None  # a background stage (rs_stage_begin)
        self.pending: list = []  # a state dict the actor resolved for it (object_store_stage)
        self.fences: list[str] = []  # refits whose failure path ran here (a late begin of one is refused)
        self.lock = threading.Lock()
        self.half_loaded = False  # a load failed part-way: the weights are neither old nor new

    def rs_weights_checksum(self) -> str:
        return "half-loaded" if self.half_loaded else self.current.digest

    def rs_process_info(self) -> dict[str, Any]:
        return {"pid": os.getpid(), "ppid": os.getppid(), "ray_connected": True, "rank": 0}

    def rs_reload_from_path(self, path: str) -> None:
        self.current, self.half_loaded = _Weights(_digest_path(path), path=path), False

    def rs_weight_sync_init(self, host: str, port: int, world_size: int, rank_offset: int, group_name: str,
                            timeout_s: float) -> int:
        from rollout_service.weights.collective import open_group

        self.group = None
        self.group = open_group(host, port, world_size, rank_offset, group_name, timeout_s)
        return rank_offset

    def rs_weight_sync_close(self) -> None:
        self.group = None

    def rs_stage_collective(self, plan_json: str) -> dict[str, Any]:
        from rollout_service.weights.collective import BucketPlan, receive_buckets

        if self.group is None:
            raise RuntimeError("no weight-sync group: call init_weight_sync first")
        self.previous = self.staged = None  # a backup a failed commit left: never rolled back to now
        t0 = time.perf_counter()
        tensors, _buffers = receive_buckets(self.group, BucketPlan.from_json(plan_json))
        digest, nbytes = _digest_tensors(tensors)
        self.staged = _Weights(digest)
        return {"bytes": nbytes, "seconds": time.perf_counter() - t0}

    def rs_stage_path(self, path: str) -> dict[str, Any]:
        if not os.path.isdir(path):
            raise FileNotFoundError(f"checkpoint directory not found in the engine worker: {path}")
        self.previous = None
        self.rs_discard_staged()  # (and a background stage left by an ended refit)
        self.staged = _Weights(_digest_path(path), path=path)
        nbytes = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".safetensors"))
        return {"bytes": nbytes, "seconds": 0.0}

    def rs_discard_staged(self, token: str | None = None, fence: bool = False) -> None:
        with self.lock:  # (collective_rpc runs these in threads: a discard and a begin may overlap)
            self._discard(token, fence)

    def _discard(self, token: str | None, fence: bool) -> None:
        if token is not None and fence:
            self.fences = [*self.fences, token][-16:]
        if token is not None and (self.job is None or self.job["token"] != token):
            return  # not this refit's
        self.staged = None
        job, self.job = self.job, None
        if job is not None:
            job["abandoned"] = True

    def rs_stage_begin(self, method: str, args: list, budget_bytes: int | None = None, token: str | None = None,
                       not_after: Any = None) -> dict[str, Any]:
        """A stage in a background thread, as the real worker's (the thread computes, the poll
        installs): ``method`` is one of the staging methods (``sim_object``: the state dict the
        actor resolved, ``object_store_stage``)."""
        with self.lock:
            return self._begin(method, args, budget_bytes, token, not_after)

    def _begin(self, method: str, args: list, budget_bytes: int | None, token: str | None,
               not_after: Any) -> dict[str, Any]:
        from rollout_service.weights.staging import deadline_passed

        if token is not None and token in self.fences:
            raise RuntimeError(f"refit {token} already ended on this engine (its failure path ran here)")
        if deadline_passed(not_after):
            raise TimeoutError(f"refit {token}: the stage began past its deadline")
        self._discard(None, False)
        self.previous = None  # a backup a failed commit left: never rolled back to now
        if method == "rs_stage_collective":
            from rollout_service.weights.collective import BucketPlan

            if self.group is None:
                raise RuntimeError("no weight-sync group: call init_weight_sync first")
            plan, group = BucketPlan.from_json(args[0]), self.group
            nbytes = plan.total_bytes

            def work():
                from rollout_service.weights.collective import receive_buckets

                tensors, _buffers = receive_buckets(group, plan)
                digest, n = _digest_tensors(tensors)
                return _Weights(digest), n
        elif method == "rs_stage_path":
            path = args[0]
            if not os.path.isdir(path):
                raise FileNotFoundError(f"checkpoint directory not found in the engine worker: {path}")
            nbytes = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".safetensors"))

            def work():
                return _Weights(_digest_path(path), path=path), nbytes
        elif method == "sim_object":
            state, self.pending = (self.pending or [None])[-1], []
            nbytes = 0

            def work():
                return self.weights_of(state)
        else:
            raise ValueError(f"cannot stage in the background through {method!r}")
        if budget_bytes is not None and nbytes > budget_bytes:
            return {"started": False, "bytes": nbytes,
                    "fallback": f"{nbytes} bytes over refit.staging_budget_bytes ({budget_bytes})"}
        job: dict[str, Any] = {"done": threading.Event(), "abandoned": False, "token": token, "installed": False,
                               "weights": None, "bytes": 0, "seconds": 0.0, "error": None}

        def run():
            t0 = time.perf_counter()
            try:
                job["weights"], job["bytes"] = work()
            except BaseException as exc:  # noqa: BLE001 - handed to the poll
                job["error"] = exc
            finally:
                job["seconds"] = time.perf_counter() - t0
                job["done"].set()

        self.job = job
        threading.Thread(target=run, name="sim-stage", daemon=True).start()
        return {"started": True, "bytes": nbytes}

    def rs_stage_poll(self, token: str | None = None) -> dict[str, Any]:
        job = self.job
        if job is None or job["token"] != token:
            raise RuntimeError(f"no background stage of refit {token} here (discarded, superseded, or never begun)")
        if not job["done"].is_set():
            return {"done": False}
        if job["error"] is not None:
            raise job["error"]
        if not job["installed"]:
            job["installed"] = True
            self.staged = job["weights"]
        return {"done": True, "bytes": job["bytes"], "seconds": job["seconds"]}

    def rs_load_staged(self, fail_after_tensors: int | None = None) -> dict[str, Any]:
        if self.staged is None:
            raise RuntimeError("nothing staged to load")
        staged, self.staged = self.staged, None
        self.job = None
        self.previous, self.current = self.current, staged
        if fail_after_tensors is not None:
            self.half_loaded = True
            raise RuntimeError(f"injected load fault after {fail_after_tensors} tensors")
        self.half_loaded = False
        return {"seconds": 0.0}

    def rs_commit(self) -> None:
        self.previous = None

    def rs_rollback(self) -> dict[str, Any]:
        self.rs_discard_staged()
        if self.previous is None:
            return {"reloaded": False}
        self.current, self.previous, self.half_loaded = self.previous, None, False
        return {"reloaded": True, "source": self.current.path or "weights in memory", "seconds": 0.0}

    def rs_reload_current(self) -> dict[str, Any]:
        self.half_loaded = False
        return {"source": self.current.path or "weights in memory", "seconds": 0.0}

    def stage_object(self, state: Any) -> dict[str, Any]:
        """An object-store refit or a replacement's load: ``{"path": dir}``, another simulated engine's
        export (``{"sim_digest": hex}``), or a ``{name: tensor}`` state dict."""
        self.previous = None
        if isinstance(state, dict) and set(state) == {"path"}:
            return self.rs_stage_path(state["path"])
        self.staged, nbytes = self.weights_of(state)
        return {"bytes": nbytes, "seconds": 0.0}

    @staticmethod
    def weights_of(state: Any) -> tuple[_Weights, int]:
        """What a staged object is (not installed): a checkpoint path, a digest, or a state dict."""
        if isinstance(state, dict) and set(state) == {"path"}:
            return _Weights(_digest_path(state["path"]), path=state["path"]), 0
        if isinstance(state, dict) and set(state) == {"sim_digest"}:
            return _Weights(str(state["sim_digest"])), 0
        items = state.items() if hasattr(state, "items") else state
        digest, nbytes = _digest_tensors(list(items))
        return _Weights(digest), nbytes

    def export(self) -> dict[str, Any]:
        if self.previous is not None:
            raise RuntimeError("a refit is loading: the current weights are not committed yet")
        return {"path": self.current.path} if self.current.path else {"sim_digest": self.current.digest}
