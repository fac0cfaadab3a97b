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

This module is the actor, its entry points and the refit's bracket on the fleet. In rooms of their
own, mixins of :class:`RefitController`: :mod:`~rollout_service.refit.three_phase` (the three phases
and the failure path), :mod:`~rollout_service.refit.weight_sync` (the trainer's gloo group),
:mod:`~rollout_service.refit.nccl` (the NCCL round), :mod:`~rollout_service.refit.abandoned_refit`
(after a restart: the refit a dead incarnation left) and :mod:`~rollout_service.refit.rollout_reads`
(where trainers read their rollouts).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from rollout_service.config import RolloutServiceConfig
from rollout_service.fleet.types import REFIT_TIMINGS, FleetView, Member, actor_identity, is_actor_dead
from rollout_service.metrics import get_metrics
from rollout_service.refit.abandoned_refit import AbandonedRefitRecovery
from rollout_service.refit.control import EngineControl
from rollout_service.refit.deadlines import refit_lease_s
from rollout_service.refit.nccl import NcclRounds
from rollout_service.refit.rollout_aborts import RolloutAborts
from rollout_service.refit.rollout_reads import RolloutReads
from rollout_service.refit.three_phase import ThreePhaseRefit
from rollout_service.refit.types import RefitFailed, RefitInProgress, short_error
from rollout_service.refit.weight_sync import WeightSyncGroups
from rollout_service.weights.collective import ABORT_MESSAGE

logger = logging.getLogger(__name__)

CONTROLLER_NAME = "rollout-service-refit"
CONTROLLER_NAMESPACE = "rollout-service"


class RefitController(ThreePhaseRefit, WeightSyncGroups, NcclRounds, AbandonedRefitRecovery, RolloutReads,
                      RolloutAborts):
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
        self._abandoned_refit_lock = asyncio.Lock()
        self.recovered: dict[str, Any] | None = None  # what that found and did (stats)
        if self._reconstructed:
            self._end_abandoned_refit_soon()

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
        """Stage (``refit.staging: overlap``, while the engines generate) -> pause (keep) -> load ->
        label -> commit -> resume every engine (``inside``: the stage after the pause); returns the report.

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
            view = await self.fleet.begin_refit.remote(lease_s=refit_lease_s(timeout))
            committed = None
            report = None
            try:
                if kind == "collective":
                    self._check_weight_sync(view)
                if not view.members:
                    raise RefitFailed(f"refit to version {version} failed: no engine is serving (the fleet is "
                                      "replacing them); nothing changed", None)
                report = await self._run_three_phases(
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
                await self._end_bracket(committed, getattr(transfer, "path", None) if kind == "path" else None, timeout,
                                        report.to_dict() if report is not None else None)
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

    async def _end_bracket(self, committed: str | None, path: str | None, timeout: float,
                           report: dict[str, Any] | None = None) -> None:
        """Tell the fleet the refit is over (what it committed, and the report's staging and stall
        times for ``GET /v1/status``). A fleet that is restarting
        (killed mid-refit) is asked again until it answers, for at most ``timeout``: its durable
        record must not keep a bracket and a version that are no longer true."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                timings = {k: report.get(k) for k in REFIT_TIMINGS} if report else None
                await asyncio.wait_for(self.fleet.end_refit.remote(committed, path, timings), timeout)
                return
            except Exception as exc:
                if time.monotonic() > deadline:
                    raise
                logger.warning("end of the refit bracket not delivered (retrying): %s", short_error(exc))
                if is_actor_dead(exc):
                    self._fleet = None  # killed for good: looked up (or created) by name again
                await asyncio.sleep(0.5)

    async def shutdown(self) -> None:
        """Nothing to stop but its control connections: the engines belong to the fleet
        (``EngineFleet.shutdown``)."""
        self._weight_sync = None
        self._control.close()


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
