"""The control plane: the Ray-handle API trainers call; orchestrates refits over the engine fleet.

One named, detached actor per deployment (``rollout-service-refit`` in namespace
``rollout-service``). It owns no engines: the :class:`~rollout_service.fleet.fleet.EngineFleet`
does (creates, probes, replaces them). Every refit is bracketed on the fleet
(``begin_refit`` / ``end_refit``): it runs over the engines serving at its start, no engine joins
meanwhile, and a replacement that comes up later loads the version the refit committed.

A refit (:meth:`RefitController.refit`) is: pause every engine (``keep``: in-flight requests are
frozen, none aborted; new ones queue) -> stage the new state dict in every worker through a
transport (model untouched) -> load it in place (``reload_weights``) -> label the version -> commit
-> resume. Any failure or timeout before the commit — an engine dying mid-refit included — rolls
every surviving engine back to the previous weights (reloaded from the kept CPU copy or checkpoint
path) and version, resumes them all, and raises :class:`~rollout_service.refit.types.RefitFailed`
with the report; an engine that cannot be restored is handed to the fleet to be replaced, never
left paused. A second refit while one runs raises
:class:`~rollout_service.refit.types.RefitInProgress`. See docs/refit.md.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from rollout_service.config import RolloutServiceConfig
from rollout_service.fleet.types import FleetView, Member, actor_identity, is_actor_dead, is_engine_death
from rollout_service.weights.collective import ABORT_MESSAGE
from rollout_service.metrics import get_metrics
from rollout_service.engine.refit_steps import STEPS as APPLY_STEPS
from rollout_service.refit.control import EngineControl
from rollout_service.refit.nccl import NcclRounds
from rollout_service.refit.recovery import RestartRecovery
from rollout_service.refit.transports import bytes_of
from rollout_service.refit.types import (
    MEMBERSHIP_CHANGED,
    RefitFailed,
    RefitInProgress,
    RefitReport,
    WeightSyncNotInitialized,
    short_error,
)

logger = logging.getLogger(__name__)

CONTROLLER_NAME = "rollout-service-refit"


APPLY_MARGIN_S = 5.0  # past the sum of an apply's step deadlines, for the call itself


class _StepFailed(Exception):
    """An engine's apply call named the step that failed and why (the message is the report's error)."""
CONTROLLER_NAMESPACE = "rollout-service"


class RefitController(NcclRounds, RestartRecovery):
    def __init__(self, config: RolloutServiceConfig | dict, fleet=None):
        self.config = config if isinstance(config, RolloutServiceConfig) else RolloutServiceConfig.model_validate(config)
        self._fleet = fleet
        self.weight_version = "0"
        self._started = False
        self._start_lock = asyncio.Lock()
        self._refit_lock = asyncio.Lock()
        self._version_history: list[str] = [self.weight_version]
        self._weight_sync: dict[str, Any] | None = None
        self._last_report: dict[str, Any] | None = None
        self._num_refits = 0
        self._num_failed_refits = 0
        self._nccl: dict[str, Any] | None = None  # the NCCL round in progress: members, lease deadline
        self._control = EngineControl(self.config.refit.control)  # the three phases: data channel or Ray
        # Ray restarts a controller that died (max_restarts): the new incarnation first ends the refit
        # the old one may have left half-done (_end_abandoned_refit), before anything else.
        _, self._reconstructed = actor_identity()
        self._recover_lock = asyncio.Lock()
        self.recovered: dict[str, Any] | None = None  # what that found and did (stats)
        if self._reconstructed:
            self._recover_at_once()

    @property
    def fleet(self):
        if self._fleet is None:
            from rollout_service.fleet.fleet import get_or_create_fleet

            self._fleet = get_or_create_fleet(self.config)
        return self._fleet

    async def start(self) -> float:
        """Wait until the fleet has started its engines (idempotent). Returns the fleet's start-up seconds."""
        try:
            await asyncio.wait_for(self.fleet.view.remote(), self.config.refit.step_timeout_s)
        except Exception as exc:
            if not is_actor_dead(exc):
                raise
            self._fleet = None  # killed for good and created again: look it up (or create it) by name
        await self._after_restart()
        async with self._start_lock:
            startup = await self.fleet.start.remote()
            if not self._started:
                self._started = True
                view = await self.fleet.view.remote()
                self.weight_version = view.version
                if view.version not in self._version_history:
                    self._version_history.append(view.version)
            return startup

    async def register_with_fleet(self) -> None:
        """Live and die with the fleet: it kills this actor when the Serve app is deleted."""
        import ray

        self.fleet.add_dependent.remote(ray.get_runtime_context().current_actor)

    def update_config(self, config: dict) -> None:
        """A redeploy's config: refit settings apply from the next refit (engines are the fleet's)."""
        self.config = RolloutServiceConfig.model_validate(config)
        self._control.mode = self.config.refit.control
        if self._control.mode != "channel":
            self._control.close()

    async def _view(self) -> FleetView:
        await self.start()
        return await self.fleet.view.remote()

    async def get_engines(self) -> list[Any]:
        """Handles of the engines serving now (diagnostics and tests; the data plane uses a FleetClient)."""
        return (await self._view()).handles()

    async def engine_health(self) -> list[dict[str, Any]]:
        view = await self._view()

        async def one(m: Member):
            try:
                return {"slot": m.slot, **await asyncio.wait_for(m.handle.health.remote(), timeout=10)}
            except Exception as exc:  # dead or hung engine: report, do not raise
                return {"slot": m.slot, "index": m.slot, "ready": False, "error": f"{type(exc).__name__}: {exc}"[:300]}

        return list(await asyncio.gather(*[one(m) for m in view.members]))

    async def stats(self) -> dict[str, Any]:
        """Current version, the fleet's health, and the lag of in-flight rollouts (refits since the
        version each started on)."""
        view = await self._view()
        health, fleet = await asyncio.gather(self.engine_health(), self.fleet.stats.remote())
        started_on = await asyncio.gather(*[self._in_flight_versions(m.handle) for m in view.members])
        by_version: dict[str, int] = {}
        lags: list[int] = []
        for h, versions in zip(health, started_on):
            h["in_flight_started_on"] = {}
            for v in versions.values():
                h["in_flight_started_on"][v] = h["in_flight_started_on"].get(v, 0) + 1
                by_version[v] = by_version.get(v, 0) + 1
                lag = self.version_lag(v)
                if lag is not None:
                    lags.append(lag)
        return {
            "weight_version": self.weight_version,
            "num_engines": len(view.members),
            "engines": health,
            "fleet": fleet,
            "startup_s": fleet.get("startup_s"),
            "refitting": self._refit_lock.locked(),
            "num_refits": self._num_refits,
            "num_failed_refits": self._num_failed_refits,
            "last_refit": self._last_report,
            "in_flight": sum(by_version.values()),
            "in_flight_by_version": by_version,
            "lag": {
                "max": max(lags, default=0),
                "mean": (sum(lags) / len(lags)) if lags else 0.0,
                "histogram": {str(k): lags.count(k) for k in sorted(set(lags))},
            },
            "weight_sync": dict(self._weight_sync) if self._weight_sync else None,
            "recovered": self.recovered,
        }

    @staticmethod
    async def _in_flight_versions(engine) -> dict[str, str]:
        try:
            return await asyncio.wait_for(engine.in_flight_versions.remote(), timeout=10)
        except Exception:
            return {}

    def version_lag(self, version: str) -> int | None:
        """Refits between ``version`` and the current one (None: a version this controller never served)."""
        try:
            return len(self._version_history) - 1 - self._version_history.index(version)
        except ValueError:
            return None

    def current_version(self) -> str:
        return self.weight_version

    def refit_config(self) -> dict[str, Any]:
        """The ``refit`` section: ``TrainerClient`` takes its backend, bucket size and step timeout
        from it unless the trainer overrides them."""
        return self.config.refit.model_dump()

    def store_config(self) -> dict[str, Any]:
        """Where rollouts are stored (trainers read trajectories there: ``TrainerClient.get_rollout``)."""
        import os

        store = self.config.store.model_copy()
        store.redis_url = os.environ.get("ROLLOUT_SERVICE_REDIS_URL") or store.redis_url
        if not store.redis_url:
            raise RuntimeError("store.redis_url is not configured")
        return store.model_dump()

    def is_refitting(self) -> bool:
        return self._refit_lock.locked()

    async def weights_checksums(self) -> list[str]:
        """sha256 of the loaded weights of every worker of every engine (diagnostics, tests)."""
        await self.start()
        out = await self.fleet.fan_out.remote("collective_rpc", "rs_weights_checksum")
        failed = {slot: r["error"] for slot, r in out.items() if isinstance(r, dict)}
        if failed:
            raise RuntimeError(f"weights checksum failed on engine slot(s) {failed}")
        return [c for slot in sorted(out) for c in out[slot]]

    # ----------------------------------------------------------------- weight sync
    async def weight_sync_world_size(self) -> int:
        """Trainer (rank 0) + every worker of every serving engine."""
        view = await self._view()
        return 1 + len(view.members) * self.config.engine.tensor_parallel_size

    async def init_weight_sync(self, host: str, port: int, group_name: str, timeout_s: float | None = None) -> list[int]:
        """Every engine worker joins the trainer's dedicated gloo group (trainer = rank 0, hosting the
        TCPStore at host:port). The trainer joins concurrently (``TrainerClient.init_weight_sync``).
        Returns the workers' ranks. Also on a service whose ``refit.backend`` is nccl, when the
        trainer asks for gloo: the group is this service's own, whatever the engines started with."""
        if self._refit_lock.locked():
            raise RefitInProgress("cannot re-create the weight-sync group while a refit runs")
        view = await self._view()
        timeout = timeout_s or self.config.refit.step_timeout_s
        tp = self.config.engine.tensor_parallel_size
        world = 1 + len(view.members) * tp
        self._weight_sync = None
        calls = [
            m.handle.collective_rpc.remote(
                "rs_weight_sync_init", args=(host, port, world, 1 + i * tp, group_name, timeout), timeout=timeout
            )
            for i, m in enumerate(view.members)
        ]
        ranks = await asyncio.wait_for(asyncio.gather(*calls), timeout=timeout)
        self._weight_sync = {"host": host, "port": port, "group": group_name, "world_size": world, "timeout_s": timeout,
                             "epoch": view.epoch, "members": [list(m.key) for m in view.members]}
        return [r for per_engine in ranks for r in per_engine]

    async def close_weight_sync(self) -> None:
        self._weight_sync = None
        await self.fleet.fan_out.remote("collective_rpc", "rs_weight_sync_close")

    async def check_weight_sync(self) -> None:
        """Raise WeightSyncNotInitialized if the group no longer matches the serving engines (the
        trainer asks before it sends: a broadcast into a group with a dead rank fails mid-way)."""
        self._check_weight_sync(await self._view())

    def _check_weight_sync(self, view: FleetView) -> None:
        """The gloo group has a rank per engine worker: it is only usable by the members it was built with."""
        if self._weight_sync is None:
            raise WeightSyncNotInitialized("collective transfer needs init_weight_sync first")
        if self._weight_sync["members"] != [list(m.key) for m in view.members]:
            before = self._weight_sync["epoch"]
            self._weight_sync = None
            raise WeightSyncNotInitialized(
                f"{MEMBERSHIP_CHANGED} (fleet epoch {before} -> {view.epoch}: an "
                "engine was lost or replaced); call init_weight_sync again (TrainerClient does it by itself)")

    # ----------------------------------------------------------------------- refit
    async def refit(
        self,
        version: str,
        transfer,
        *,
        clear_cache: bool | None = None,
        timeout_s: float | None = None,
        fail_load_after_tensors: int | None = None,
    ) -> dict[str, Any]:
        """Pause (keep) -> stage -> load -> label -> commit -> resume every engine; returns the report.

        ``transfer`` is a strategy from :mod:`rollout_service.refit.transports`. ``clear_cache``
        (default: config, False) drops the KV cache and recomputes in-flight requests with the new
        weights after resume. ``fail_load_after_tensors`` injects a load fault (tests only).
        Raises RefitInProgress (another refit runs) or RefitFailed (nothing changed, all resumed).
        """
        if self._refit_lock.locked():
            get_metrics().refit("rejected")
            raise RefitInProgress(f"a refit is already running (current version {self.weight_version})")
        async with self._refit_lock:
            await self.start()
            version = str(version)
            if version in self._version_history:
                get_metrics().refit("rejected")
                raise ValueError(f"weight version {version!r} was already used; versions label distinct weights")
            timeout = timeout_s or self.config.refit.step_timeout_s
            kind = getattr(transfer, "kind", None)
            view = await self.fleet.begin_refit.remote(lease_s=_overall(timeout))
            committed = None
            try:
                if kind == "collective":
                    self._check_weight_sync(view)
                if not view.members:
                    raise RefitFailed(f"refit to version {version} failed: no engine is serving (the fleet is "
                                      "replacing them); nothing changed", None)
                report = await self._refit_locked(
                    version,
                    transfer,
                    self.config.refit.clear_cache if clear_cache is None else bool(clear_cache),
                    timeout,
                    fail_load_after_tensors,
                    view,
                )
                if report.ok:
                    committed = version
            except BaseException:  # raised without a report: no serving engine, a stale weight-sync group
                get_metrics().refit("failed")
                raise
            finally:
                await self._end_bracket(committed, getattr(transfer, "path", None) if kind == "path" else None, timeout)
            self._last_report = report.to_dict()
            get_metrics().refit("ok" if report.ok else "failed", self._last_report)
            if not report.ok:
                self._num_failed_refits += 1
                if getattr(transfer, "kind", None) == "collective" and report.failed_step == "transfer":
                    # A receive that timed out leaves the gloo group out of step: re-create it.
                    if ABORT_MESSAGE not in (report.error or ""):
                        self._weight_sync = None
                raise RefitFailed(
                    f"refit to version {version} failed at {report.failed_step}: {report.error}; "
                    f"engines resumed on version {self.weight_version}",
                    self._last_report,
                )
            self._num_refits += 1
            return self._last_report

    async def _refit_locked(self, version, transfer, clear_cache, timeout, fail_load_after_tensors,
                            view: FleetView) -> RefitReport:
        """Three fan-outs, one engine call each (rollout_service.engine.refit_steps): pause (with the
        counts), apply (stage, load, label), commit + resume, over the engines' data channels or by
        Ray calls (rollout_service.refit.control). No engine resumes before every engine is loaded
        and labelled; from there the refit rolls forward."""
        engines = view.handles()
        previous = self.weight_version
        report = RefitReport(
            version=version, previous_version=previous, transport=getattr(transfer, "kind", "?"), clear_cache=clear_cache,
            engines=[m.slot for m in view.members],
        )
        step = "pause"
        applying = False
        reached: dict[int, str | None] = {}  # slot -> the last apply step it finished (absent: unknown)
        paused: list[Any] = []
        resumed: set[int] = set()  # id() of the handles the commit phase resumed
        aborted_before: dict[int, int] = {}  # id(handle) -> its aborted count before the refit
        aborted_after: int | None = None
        await self._control.prepare(view.members, timeout)
        t_start = time.perf_counter()
        try:
            async def pause(m: Member):
                # Recorded before the call: a pause that times out or fails half-way may still land,
                # and every engine asked to pause is resumed on the way out (resume is idempotent).
                paused.append(m.handle)
                counts = await self._control.call(m, "refit_pause", clear_cache)
                aborted_before[id(m.handle)] = counts["aborted"]
                return counts

            t0 = time.perf_counter()
            counts = await asyncio.wait_for(asyncio.gather(*[pause(m) for m in view.members]), timeout)
            report.pause_s = time.perf_counter() - t0
            report.requests_in_flight = sum(c["in_flight"] for c in counts)

            step, applying = "transfer", True
            t0 = time.perf_counter()
            kwargs = {"fail_after_tensors": fail_load_after_tensors} if fail_load_after_tensors is not None else None
            stage = transfer.engine_stage()
            applied = await asyncio.gather(
                *[asyncio.wait_for(self._control.call(m, "refit_apply", stage, version, kwargs, timeout,
                                                      ray_only="refs" in stage),  # refs cannot cross the channel
                                   len(APPLY_STEPS) * timeout + APPLY_MARGIN_S) for m in view.members],
                return_exceptions=True)
            apply_s = time.perf_counter() - t0
            done = [a for a in applied if not isinstance(a, BaseException)]
            for m, a in zip(view.members, applied):
                if not isinstance(a, BaseException):
                    reached[m.slot] = a["reached"]
                elif is_engine_death(a):  # nothing to undo on it: the fleet replaces it on the current version
                    await self._lost(m, a, timeout, report)
            report.bytes, report.worker_receive_s = bytes_of([a["stage"] for a in done])
            report.worker_timings = [w for a in done for w in a["load"] if w]
            report.transfer_s = max((a["seconds"].get("transfer", 0.0) for a in done), default=0.0)
            report.load_s = max((a["seconds"].get("load", 0.0) for a in done), default=0.0)
            label_s = max(0.0, apply_s - report.transfer_s - report.load_s)
            failed = [a for a in applied if isinstance(a, BaseException) or not a["ok"]]
            if failed:
                first = min(failed, key=lambda a: 0 if isinstance(a, BaseException) else APPLY_STEPS.index(a["step"]))
                if isinstance(first, BaseException):
                    raise first
                step = first["step"]
                raise _StepFailed(first["error"])
            # Every engine holds the new weights under the new label: from here the refit rolls
            # forward. A commit only releases the backup; one that fails is reported, not undone.
            step = "commit"
            aborted_after = await self._commit_and_resume(view, timeout, report, resumed)
            report.resume_s += label_s
            self.weight_version = version
            self._version_history.append(version)
            report.ok = True
        except BaseException as exc:  # noqa: BLE001 - every failure must end in a consistent, resumed state
            report.failed_step = step
            report.error = str(exc) if isinstance(exc, _StepFailed) else short_error(exc)
            logger.warning("refit to %s failed at %s: %s", version, step, report.error)

            def undo(slot: int) -> tuple[bool, bool] | None:
                """(roll the load back, restore the label) for one engine, from how far it got; None:
                unknown (its apply call raised: it died, or answered nothing within every step's
                deadline and may still be loading): it must not serve again, the fleet replaces it."""
                if not applying:
                    return False, False
                if slot not in reached:  # (a dead one is in report.engines_lost, left out)
                    return None
                return reached[slot] is not None, reached[slot] in ("load", "label")

            report.rolled_back = await self._recover(view, previous, undo, timeout, report)
        finally:
            left = [e for e in paused if id(e) not in resumed]
            if left:
                await self._resume(left, timeout, report)
            report.total_s = time.perf_counter() - t_start
        if aborted_after is None:  # a failure path: counted again on the engines counted before
            aborted_after = await self._sum([e for e in engines if id(e) in aborted_before], "num_aborted", timeout)
        report.requests_aborted = max(0, aborted_after - sum(aborted_before.values()))
        if report.engines_lost:
            lost = ", ".join(map(str, report.engines_lost))
            report.error = "; ".join(filter(None, [f"engine slot(s) {lost} died during the refit (the fleet replaces them)",
                                                   report.error]))
        return report

    async def _lost(self, m: Member, exc: BaseException, timeout: float, report) -> None:
        """An engine died during the refit: reported (the fleet replaces it on the current version)."""
        report.engines_lost.append(m.slot)
        try:  # the fleet's monitor finds the engine anyway
            await asyncio.wait_for(self.fleet.report_failure.remote(
                m.slot, m.generation, f"{type(exc).__name__}: during a refit", is_actor_dead(exc)), timeout)
        except Exception:
            pass

    async def _end_bracket(self, committed: str | None, path: str | None, timeout: float) -> None:
        """Tell the fleet the refit is over (and what it committed). A fleet that is restarting
        (killed mid-refit) is asked again until it answers, for at most ``timeout``: its durable
        record must not keep a bracket and a version that are no longer true."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                await asyncio.wait_for(self.fleet.end_refit.remote(committed, path), timeout)
                return
            except Exception as exc:
                if time.monotonic() > deadline:
                    raise
                logger.warning("end of the refit bracket not delivered (retrying): %s", short_error(exc))
                if is_actor_dead(exc):
                    self._fleet = None  # killed for good: looked up (or created) by name again
                await asyncio.sleep(0.5)

    async def _commit_and_resume(self, view: FleetView, timeout, report, resumed: set[int]) -> int | None:
        """Release every engine's backup of the previous weights and resume it (one call each). Past
        the point of no return: an engine whose commit fails still serves the new weights under the
        new label (its stale backup is released by its next load); one that died is replaced by the
        fleet on the new version; one whose resume fails is resumed by the fleet
        (``fleet.resume_unbracketed_pause_s``). Returns the aborted count after, if every engine
        answered."""
        t0 = time.perf_counter()
        results = await asyncio.gather(
            *[asyncio.wait_for(self._control.call(m, "refit_commit_resume", timeout), 2 * timeout) for m in view.members],
            return_exceptions=True)
        report.resume_s = time.perf_counter() - t0
        commit_errors, resume_errors = [], []
        aborted = 0
        for m, r in zip(view.members, results):
            if isinstance(r, BaseException):
                if is_engine_death(r):
                    await self._lost(m, r, timeout, report)
                else:  # stalled: neither its commit nor its resume is known; the fleet's probes decide
                    report.commit_failed.append(m.slot)
                    commit_errors.append(f"engine slot {m.slot}: {short_error(r)}")
                resumed.add(id(m.handle))  # a second resume of a dead or stalled engine would only wait
                aborted = None
                continue
            resumed.add(id(m.handle))
            if aborted is not None:
                aborted += r["aborted"]
            if r["commit_error"]:
                report.commit_failed.append(m.slot)
                commit_errors.append(f"engine slot {m.slot}: {r['commit_error']}")
            if r["resume_error"]:
                resume_errors.append(f"engine slot {m.slot}: {r['resume_error']}")
        if commit_errors:
            report.error = "commit failed (rolled forward: every engine holds the new weights): " + "; ".join(commit_errors)
            logger.warning("refit to %s: %s", report.version, report.error)
        if resume_errors:
            # Not a reason to undo anything: a committed refit stays committed.
            report.error = (report.error + "; " if report.error else "") + (
                "resume failed (the fleet resumes the engine): " + "; ".join(resume_errors))[:600]
        return aborted

    async def _recover(self, view: FleetView, previous, undo, timeout, report) -> bool:
        """Back to the previous weights and label on every surviving engine, as far as each got
        (``undo(slot)``: roll the load back, restore the label). An engine that died needs nothing
        (its replacement loads the fleet's current version); one that is alive but cannot be
        restored must not serve a half-loaded model: it is handed to the fleet to be killed and
        replaced (its in-flight calls fail over), never left paused."""
        broken: list[str] = []
        unrestorable: list[Member] = []
        rolled: list[bool] = []
        lost = set(report.engines_lost)

        async def one(m: Member):
            e = m.handle
            plan = undo(m.slot)
            if plan is None:
                broken.append(f"engine slot {m.slot}: its state after the failed apply is unknown")
                unrestorable.append(m)
                return
            rollback, relabel = plan
            try:
                if rollback:
                    await asyncio.wait_for(e.collective_rpc.remote("rs_rollback", timeout=timeout), timeout)
                    rolled.append(True)
                else:
                    await asyncio.wait_for(e.collective_rpc.remote("rs_discard_staged", timeout=timeout), timeout)
                if relabel:
                    await asyncio.wait_for(e.set_weight_version.remote(previous), timeout)
            except Exception as exc:
                if is_engine_death(exc):
                    await self._lost(m, exc, timeout, report)
                    return
                broken.append(f"engine slot {m.slot}: {short_error(exc)}")
                unrestorable.append(m)

        await asyncio.gather(*[one(m) for m in view.members if m.slot not in lost])
        for m in unrestorable:
            try:
                await asyncio.wait_for(self.fleet.mark_dead.remote(
                    m.slot, m.generation, f"not restorable after a failed refit: {report.error}"), timeout)
            except Exception as exc:  # the fleet's probes find it (it stays paused, never resumed here)
                logger.warning("could not hand engine slot %d to the fleet: %s", m.slot, short_error(exc))
        self._unrestorable = [m.handle for m in unrestorable]
        if broken:
            report.error = f"{report.error}; rollback failed, replaced by the fleet: {'; '.join(broken)}"
        return bool(rolled) and not broken

    async def _resume(self, paused, timeout, report) -> None:
        keep_paused = set(map(id, getattr(self, "_unrestorable", [])))
        self._unrestorable = []
        t0 = time.perf_counter()
        results = await asyncio.gather(
            *[asyncio.wait_for(e.resume.remote(), timeout) for e in paused if id(e) not in keep_paused],
            return_exceptions=True,
        )
        errors = [f"{type(r).__name__}: {r}" for r in results if isinstance(r, BaseException) and not is_engine_death(r)]
        if errors:
            # Not a reason to undo anything: a committed refit stays committed (the fleet resumes an
            # engine left paused outside a refit after fleet.resume_unbracketed_pause_s).
            report.error = (report.error + "; " if report.error else "") + (
                "resume failed (the fleet resumes the engine): " + "; ".join(errors))[:600]
        report.resume_s += time.perf_counter() - t0

    @staticmethod
    async def _sum(engines, method: str, timeout: float) -> int:
        """Sum over the engines that answer within ``timeout`` (a dead or stalled one counts 0: the
        refit notices it elsewhere)."""
        values = await asyncio.gather(*[asyncio.wait_for(getattr(e, method).remote(), timeout) for e in engines],
                                      return_exceptions=True)
        return int(sum(v for v in values if isinstance(v, int)))

    async def shutdown(self) -> None:
        """Nothing to stop but its control connections: the engines belong to the fleet
        (``EngineFleet.shutdown``)."""
        self._weight_sync = None
        self._control.close()


def _overall(step_timeout: float) -> float:
    """A refit is four steps, each under its own timeout, plus a rollback in the worst case."""
    return 6 * step_timeout + 30


def controller_name(instance_name: str) -> str:
    return f"{instance_name}-refit"


def get_or_create_controller(config: RolloutServiceConfig | None = None, *, name: str = CONTROLLER_NAME):
    """The deployment's controller actor (``<service.instance_name>-refit``), created on first call
    (detached: it outlives callers).

    Without ``config`` (a trainer attaching to a service deployed by ``serve deploy``), the config
    is the running fleet's (the fleet of the same instance as ``name``). The controller is killed
    with the fleet (when the app is deleted)."""
    import ray

    from rollout_service.fleet.fleet import fleet_name, get_fleet

    if config is None:
        instance = name[: -len("-refit")] if name.endswith("-refit") else name
        config = RolloutServiceConfig.model_validate(ray.get(get_fleet(fleet_name(instance)).service_config.remote(), timeout=60))
    actor = (
        ray.remote(RefitController)
        .options(
            name=controller_name(config.service.instance_name),
            namespace=CONTROLLER_NAMESPACE,
            lifetime="detached",
            get_if_exists=True,
            num_cpus=0,
            max_concurrency=1000,
            max_restarts=-1,  # restarted after a death; the new incarnation ends an abandoned refit first
        )
        .remote(config.model_dump())
    )
    actor.update_config.remote(config.model_dump())
    actor.register_with_fleet.remote()
    return actor


def get_controller(name: str = CONTROLLER_NAME):
    """For trainers: the running service's controller, created if the service has none yet."""
    import ray

    try:
        return ray.get_actor(name, namespace=CONTROLLER_NAMESPACE)
    except ValueError:
        return get_or_create_controller(name=name)
