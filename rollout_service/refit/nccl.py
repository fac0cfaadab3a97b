"""The NCCL weight-update round of the control plane (GPU only; unverified on GPUs).

vLLM's trainer-side ``NCCLTrainerWeightTransferEngine`` drives a round from the trainer's process
(start -> update* -> finish) through ``transports.ControllerWeightSyncClient``; each call is fanned
out here to every engine's worker, where our methods wrap vLLM's (start / update / finish) and
record what the round loaded, as the other transports do (a replacement or a rollback after an
NCCL round loads those weights, not the model's own checkpoint). The round runs under a lease the trainer renews
with every call: if the trainer dies mid-round, the lease runs out and the round is abandoned —
the last committed weights reloaded, every engine resumed, the fleet's refit bracket ended. On CPU
the handshake and the round run short of vLLM's NCCL calls (tests/test_refit_nccl_lease.py).

A mixin of :class:`~rollout_service.refit.controller.RefitController`, whose fleet, config, view
and counters it uses.
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
import time
from typing import Any

from rollout_service.config import RolloutServiceConfig
from rollout_service.fleet.types import REFIT_TIMINGS, is_engine_death
from rollout_service.metrics import get_metrics
from rollout_service.refit.types import RefitFailed, RefitInProgress, RefitReport, WeightSyncNotInitialized, short_error

logger = logging.getLogger(__name__)


class NcclRounds:
    config: RolloutServiceConfig
    # Our worker methods around vLLM's start_weight_update / update_weights / finish_weight_update:
    # they keep the record of what each round loaded (weights/worker_extension.py, "NCCL rounds").
    _NCCL_START = "rs_nccl_start"
    _NCCL_UPDATE = "rs_nccl_update"
    _NCCL_FINISH = "rs_nccl_finish"

    # Unverified on GPUs: the VLLMWeightSyncClient calls of vLLM's trainer-side
    # NCCLTrainerWeightTransferEngine, fanned out to every engine (transports.ControllerWeightSyncClient).
    # On CPU the handshake and the round run short of vLLM's NCCL calls (tests/test_refit_nccl_lease.py).
    # The trainer drives the round (start -> update* -> finish) from its own process, so the round
    # runs under a lease the trainer renews with every call: if the trainer dies mid-round, the lease
    # runs out and the round is abandoned (weights reloaded, engines resumed, fleet bracket ended).
    async def nccl_init_weight_transfer_engine(self, init_info: dict) -> None:
        """Every worker of every serving engine joins the trainer's NCCL group.

        vLLM's trainer engine sends one worker init info (``rank_offset`` 1: the workers after the
        trainer). vLLM ranks a worker ``rank_offset + its rank within its engine``, and each of our
        engines is a separate vLLM instance (data-parallel index 0), so engine ``i`` gets
        ``rank_offset + i * tensor_parallel_size`` — the ranks our gloo group uses. The same info
        to every engine would give two engines the same ranks and hang the rendezvous."""
        if self.config.refit.backend != "nccl":
            raise ValueError("NCCL weight transfer needs engines started with vLLM's weight-transfer engine: set "
                             "refit.backend: nccl (this service runs gloo: TrainerClient.init_weight_sync() uses it)")
        view = await self._view()
        infos = nccl_worker_init_infos(init_info, len(view.members), self.config.engine.tensor_parallel_size)
        self._nccl_members = [list(m.key) for m in view.members]
        await self._nccl_fan_out(view.handles(), "init_weight_transfer_engine", [{"init_info": i} for i in infos])

    async def nccl_shutdown_weight_transfer_engine(self) -> None:
        view = await self._view()
        await asyncio.gather(*[e.collective_rpc.remote("shutdown_weight_transfer_engine") for e in view.handles()],
                             return_exceptions=True)

    async def _nccl_fan_out(self, engines, method: str, kwargs: dict | list[dict] | None = None) -> None:
        """One of vLLM's weight-transfer worker methods on every engine, under the step timeout;
        ``kwargs`` is one dict for all engines or a list with one per engine."""
        timeout = self.config.refit.step_timeout_s
        per_engine = kwargs if isinstance(kwargs, list) else [kwargs] * len(engines)
        await asyncio.wait_for(asyncio.gather(
            *[e.collective_rpc.remote(method, kwargs=kw, timeout=timeout) for e, kw in zip(engines, per_engine)]), timeout)

    async def nccl_start_weight_update(self) -> None:
        """Open a round: pause every engine (keep), then vLLM's ``start_weight_update`` on each.

        Every round is recorded once, when it ends (:meth:`_nccl_release`); a start refused because
        a refit runs is counted ``rejected`` here, as :meth:`refit` counts it."""
        if self._refit_lock.locked():
            get_metrics().refit("rejected")
            raise RefitInProgress("a refit is already running")
        await self._refit_lock.acquire()
        timeout = self.config.refit.step_timeout_s
        try:
            view = await self.fleet.begin_refit.remote(lease_s=self.config.refit.lease_s + timeout)
        except BaseException:
            self._refit_lock.release()
            get_metrics().refit("failed")
            raise
        round_ = self._nccl = {"view": view, "deadline": time.monotonic() + self.config.refit.lease_s,
                               "step": "pause", "report": None}
        round_["watchdog"] = asyncio.get_running_loop().create_task(self._nccl_watchdog(round_))
        try:
            if [list(m.key) for m in view.members] != getattr(self, "_nccl_members", None):
                raise WeightSyncNotInitialized("the serving engines changed since init_weight_transfer_engine: "
                                               "initialize the NCCL weight transfer again")
            engines = view.handles()
            # The version is named only at finish; until then the report has none.
            report = round_["report"] = RefitReport(
                version=None, previous_version=self.weight_version, transport="nccl",
                clear_cache=self.config.refit.clear_cache, engines=[m.slot for m in view.members])
            round_["t_start"] = t0 = time.perf_counter()
            await asyncio.wait_for(asyncio.gather(
                *[e.pause.remote(mode="keep", clear_cache=self.config.refit.clear_cache) for e in engines]), timeout)
            report.pause_s = time.perf_counter() - t0
            round_["step"] = "transfer"
            t0 = time.perf_counter()
            try:
                await self._nccl_fan_out(engines, self._NCCL_START)
            finally:
                report.transfer_s += time.perf_counter() - t0
        except BaseException as exc:
            # Once the start fan-out ran, some workers may have opened vLLM's session (layers on the
            # meta device): back to the committed weights on every engine, not a bare resume.
            await self._nccl_release(round_, reload=round_["step"] == "transfer", error=exc)
            raise

    def _nccl_renew(self) -> dict[str, Any]:
        """The round in progress, its lease renewed (every trainer call renews it)."""
        round_ = self._nccl
        if round_ is None:
            raise RefitFailed("no NCCL weight update in progress (its lease ran out, or start_weight_update "
                              "was not called)", None)
        round_["deadline"] = time.monotonic() + self.config.refit.lease_s
        return round_

    async def nccl_update_weights(self, update_info: dict) -> None:
        """vLLM's ``update_weights`` on every engine: it receives the broadcast and loads each layer in
        place as its tensors complete, so its time is the report's ``transfer_s``; the bytes are
        what ``update_info`` announces."""
        round_ = self._nccl_renew()
        report = round_["report"]
        t0 = time.perf_counter()
        try:
            await self._nccl_fan_out(round_["view"].handles(), self._NCCL_UPDATE, {"update_info": update_info})
        except BaseException as exc:
            report.transfer_s += time.perf_counter() - t0
            # vLLM loaded part of the weights in place: reload the last good checkpoint, resume.
            await self._nccl_release(round_, reload=True, error=exc)
            raise
        report.transfer_s += time.perf_counter() - t0
        num_tensors, size = nccl_update_size(update_info)
        report.num_tensors = (report.num_tensors or 0) + num_tensors
        report.bytes += size

    async def nccl_finish_weight_update(self, version: str | None) -> None:
        """vLLM's ``finish_weight_update`` on every engine (it finalizes the layerwise reload: the
        report's ``load_s``), then label the version (with the resume: ``resume_s``)."""
        round_ = self._nccl_renew()
        report = round_["report"]
        engines = round_["view"].handles()
        committed = None
        if version is not None:
            report.version = str(version)
        try:
            round_["step"] = "load"
            t0 = time.perf_counter()
            await self._nccl_fan_out(engines, self._NCCL_FINISH)
            report.load_s = time.perf_counter() - t0
            round_["step"] = "label"
            t0 = time.perf_counter()
            if version is not None:
                await asyncio.wait_for(asyncio.gather(*[e.set_weight_version.remote(str(version)) for e in engines]),
                                       self.config.refit.step_timeout_s)
                self.weight_version = str(version)
                self._version_history.append(str(version))
                self._num_refits += 1
                committed = str(version)
            # Past the label: release each engine's backup of the previous weights (a commit that
            # fails leaves a stale backup its next load releases; the round stays committed).
            commits = await asyncio.gather(*[asyncio.wait_for(e.collective_rpc.remote(
                "rs_commit", timeout=self.config.refit.step_timeout_s), self.config.refit.step_timeout_s)
                for e in engines], return_exceptions=True)
            report.commit_failed = [m.slot for m, r in zip(round_["view"].members, commits)
                                    if isinstance(r, Exception) and not is_engine_death(r)]
            report.engines_lost += [m.slot for m, r in zip(round_["view"].members, commits)
                                    if isinstance(r, Exception) and is_engine_death(r)]
            report.resume_s = time.perf_counter() - t0
        except BaseException as exc:
            # Past the label step some engines may carry the new label: the old one goes back on
            # every engine with the old weights.
            await self._nccl_release(round_, reload=True, error=exc,
                                     relabel=report.previous_version if round_["step"] == "label" else None)
            raise
        await self._nccl_release(round_, reload=False, committed=committed)

    async def _nccl_watchdog(self, round_: dict[str, Any]) -> None:
        while self._nccl is round_:
            await asyncio.sleep(min(1.0, self.config.refit.lease_s / 4))
            if self._nccl is round_ and time.monotonic() > round_["deadline"]:
                error = f"the trainer did not renew its lease within {self.config.refit.lease_s:.0f}s"
                logger.warning("NCCL weight update abandoned: %s", error)
                await self._nccl_release(round_, reload=True, error=error, from_watchdog=True)

    async def _nccl_release(self, round_: dict[str, Any], *, reload: bool, committed: str | None = None,
                            error: BaseException | str | None = None, from_watchdog: bool = False,
                            relabel: str | None = None) -> None:
        """End ``round_`` (if it is still the one in progress): optionally reload the last committed
        weights, resume, end the fleet bracket, and record the round, once: ``ok`` without
        ``error``, else ``failed`` at the step it had reached — with its report if it got as far as
        the pause, without one (as :meth:`refit` records a stale weight-sync group) if not."""
        if self._nccl is not round_:
            return  # already ended: by the watchdog, or by the call that failed first
        self._nccl = None
        report: RefitReport | None = round_["report"]
        engines = round_["view"].handles()
        if not from_watchdog:
            round_["watchdog"].cancel()
        try:
            if reload:  # the round failed or was abandoned: the engines go back to the last committed weights
                timeout = self.config.refit.step_timeout_s
                reloads = await asyncio.gather(*[asyncio.wait_for(e.collective_rpc.remote(
                    "rs_nccl_abort", timeout=timeout), timeout) for e in engines], return_exceptions=True)
                if report is not None:
                    report.rolled_back = not any(isinstance(r, BaseException) for r in reloads)
                if relabel is not None:
                    labels = await asyncio.gather(*[asyncio.wait_for(e.set_weight_version.remote(relabel), timeout)
                                                    for e in engines], return_exceptions=True)
                    # An engine that could not be put back on its old weights and label must not serve.
                    for m, r, lbl in zip(round_["view"].members, reloads, labels):
                        if isinstance(r, BaseException) or isinstance(lbl, BaseException):
                            await self.fleet.mark_dead.remote(m.slot, m.generation,
                                                              "rollback or relabel failed after a failed NCCL round")
            t0 = time.perf_counter()
            # Deadlines: a stalled engine must not hold the round open (the fleet resumes one left
            # paused after fleet.resume_unbracketed_pause_s, and replaces a hung one).
            await asyncio.gather(*[asyncio.wait_for(e.resume.remote(), self.config.refit.step_timeout_s)
                                   for e in engines], return_exceptions=True)
            if report is not None:
                report.resume_s += time.perf_counter() - t0
                report.total_s = report.stall_s = time.perf_counter() - round_["t_start"]
        finally:
            try:
                timings = {k: report.to_dict().get(k) for k in REFIT_TIMINGS} if report is not None else None
                await asyncio.wait_for(self.fleet.end_refit.remote(committed, None, timings),
                                       self.config.refit.step_timeout_s)
            finally:
                if self._refit_lock.locked():
                    self._refit_lock.release()
                self._nccl_record(round_, report, error)

    def _nccl_record(self, round_: dict[str, Any], report: RefitReport | None, error) -> None:
        if report is None:
            get_metrics().refit("failed")
            return
        if error is None:
            report.ok = True
        else:
            report.failed_step = round_["step"]
            report.error = error if isinstance(error, str) else short_error(error)
            self._num_failed_refits += 1
        self._last_report = report.to_dict()
        get_metrics().refit("ok" if report.ok else "failed", self._last_report)


def nccl_worker_init_infos(init_info: dict, num_engines: int, tensor_parallel_size: int) -> list[dict]:
    """Per engine, vLLM's worker init info with that engine's ``rank_offset`` (see
    ``RefitController.nccl_init_weight_transfer_engine``). Refuses an info whose ``world_size`` is not
    the trainer plus every worker of ``num_engines`` engines (the serving set changed since the
    trainer asked ``weight_sync_world_size``)."""
    world = 1 + num_engines * tensor_parallel_size
    if init_info.get("world_size") != world:
        raise WeightSyncNotInitialized(
            f"NCCL init for world size {init_info.get('world_size')}, but the serving engines make {world} "
            "(trainer + every worker): the engines changed, initialize the NCCL weight transfer again")
    base = int(init_info.get("rank_offset", 1))
    return [{**init_info, "rank_offset": base + i * tensor_parallel_size} for i in range(num_engines)]


def nccl_update_size(update_info: dict | list[dict]) -> tuple[int, int]:
    """(tensors, bytes) an NCCL ``update_weights`` call announces to each engine: numel x itemsize
    from vLLM's update info (``names`` / ``dtype_names`` / ``shapes``). vLLM also takes a list with
    one info per worker rank: every worker receives the whole broadcast, so the first stands for all."""
    info = update_info[0] if isinstance(update_info, list) else update_info
    size = sum(math.prod(shape) * _dtype_itemsize(dtype) for dtype, shape in zip(info["dtype_names"], info["shapes"]))
    return len(info["names"]), size


def _dtype_itemsize(name: str) -> int:
    """Bytes per element of a torch dtype named as vLLM names it (``bfloat16``, ``float8_e4m3fn``,
    ``int64``, ``bool``): the first number is its bits. Without importing torch, which this actor
    does not otherwise load (an import would stall its event loop, and the round's lease, for seconds)."""
    bits = re.search(r"\d+", name)
    return -(-int(bits.group()) // 8) if bits else 1
