"""The control plane: owns the engine replicas; the Ray-handle API trainers call.

One named, detached actor per deployment (``rollout-service-refit`` in namespace
``rollout-service``). It creates the engines, so they live as long as the service does, whether the
app was started by ``serve run`` on a driver or by ``serve deploy`` on a cluster. The data plane
(affinity replicas) asks it for the engine handles once and then talks to the engines directly;
pause / weight load / resume are fanned out from here to every engine.

A refit (:meth:`RefitController.refit`) is: pause every engine (``keep``: in-flight requests are
frozen, none aborted; new ones queue) -> stage the new state dict in every worker through a
transport (model untouched) -> load it in place (``reload_weights``) -> label the version -> commit
-> resume. Any failure or timeout before the commit rolls every engine back to the previous
weights (reloaded from the kept CPU copy or checkpoint path) and version, resumes them all, and
raises :class:`~rollout_service.refit.types.RefitFailed` with the report. A second refit while one
runs raises :class:`~rollout_service.refit.types.RefitInProgress`. See docs/refit.md.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from rollout_service.config import RolloutServiceConfig
from rollout_service.refit.collective import ABORT_MESSAGE
from rollout_service.refit.types import RefitFailed, RefitInProgress, RefitReport, WeightSyncNotInitialized

logger = logging.getLogger(__name__)

CONTROLLER_NAME = "rollout-service-refit"
CONTROLLER_NAMESPACE = "rollout-service"


class RefitController:
    def __init__(self, config: RolloutServiceConfig | dict):
        self.config = config if isinstance(config, RolloutServiceConfig) else RolloutServiceConfig.model_validate(config)
        self.engines: list[Any] = []
        self.weight_version = "0"
        self._started = False
        self._start_lock = asyncio.Lock()
        self._startup_s: float | None = None
        self._refit_lock = asyncio.Lock()
        self._version_history: list[str] = [self.weight_version]
        self._weight_sync: dict[str, Any] | None = None
        self._last_report: dict[str, Any] | None = None
        self._num_refits = 0
        self._num_failed_refits = 0

    async def start(self) -> float:
        """Create and start every engine (idempotent). Returns seconds taken."""
        async with self._start_lock:
            if self._started:
                return self._startup_s or 0.0
            from rollout_service.engine.replica import create_engine_actor

            t0 = time.perf_counter()
            ec = self.config.engine
            self.engines = [
                create_engine_actor(ec, i, initial_weight_version=self.weight_version)
                for i in range(ec.num_engines)
            ]
            await asyncio.gather(*[e.start.remote() for e in self.engines])
            self._started = True
            self._startup_s = time.perf_counter() - t0
            return self._startup_s

    async def get_engines(self) -> list[Any]:
        await self.start()
        return list(self.engines)

    async def engine_health(self) -> list[dict[str, Any]]:
        async def one(i, e):
            try:
                return await asyncio.wait_for(e.health.remote(), timeout=10)
            except Exception as exc:  # dead or hung engine: report, do not raise
                return {"index": i, "ready": False, "error": f"{type(exc).__name__}: {exc}"[:300]}

        return list(await asyncio.gather(*[one(i, e) for i, e in enumerate(self.engines)]))

    async def stats(self) -> dict[str, Any]:
        """Current version and the lag of in-flight rollouts (refits since the version each started on)."""
        health = await self.engine_health()
        started_on = await asyncio.gather(*[self._in_flight_versions(e) for e in self.engines])
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
            "num_engines": len(self.engines),
            "engines": health,
            "startup_s": self._startup_s,
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

    async def get_rollout(self, rollout_id: str) -> dict[str, Any] | None:
        """A rollout's trajectory (the same document as ``GET /v1/rollouts/{id}``), None if unknown.

        Read straight from the store, so a trainer needs no HTTP access to the service.
        """
        from rollout_service.onpolicy.trajectory import trajectory_export
        from rollout_service.store.base import validate_rollout_id
        from rollout_service.store.redis_store import RedisRolloutStore

        validate_rollout_id(rollout_id)
        if getattr(self, "_store", None) is None:
            if not self.config.store.redis_url:
                raise RuntimeError("store.redis_url is not configured")
            self._store = RedisRolloutStore.from_config(self.config.store)
        state = await self._store.load(rollout_id)
        return None if state is None else trajectory_export(state)

    def is_refitting(self) -> bool:
        return self._refit_lock.locked()

    async def weights_checksums(self) -> list[str]:
        """sha256 of the loaded weights of every worker of every engine (diagnostics, tests)."""
        await self.start()
        out = await asyncio.gather(*[e.collective_rpc.remote("rs_weights_checksum") for e in self.engines])
        return [c for per_engine in out for c in per_engine]

    # ----------------------------------------------------------------- weight sync
    def weight_sync_world_size(self) -> int:
        """Trainer (rank 0) + every worker of every engine."""
        ec = self.config.engine
        return 1 + ec.num_engines * ec.tensor_parallel_size

    async def init_weight_sync(self, host: str, port: int, group_name: str, timeout_s: float | None = None) -> list[int]:
        """Every engine worker joins the trainer's dedicated gloo group (trainer = rank 0, hosting the
        TCPStore at host:port). The trainer joins concurrently (``TrainerClient.init_weight_sync``).
        Returns the workers' ranks."""
        if self.config.refit.backend != "gloo":
            raise ValueError("init_weight_sync builds a gloo group; backend nccl uses vLLM's engine (nccl_*)")
        await self.start()
        if self._refit_lock.locked():
            raise RefitInProgress("cannot re-create the weight-sync group while a refit runs")
        timeout = timeout_s or self.config.refit.step_timeout_s
        tp = self.config.engine.tensor_parallel_size
        world = self.weight_sync_world_size()
        self._weight_sync = None
        calls = [
            e.collective_rpc.remote(
                "rs_weight_sync_init", args=(host, port, world, 1 + i * tp, group_name, timeout), timeout=timeout
            )
            for i, e in enumerate(self.engines)
        ]
        ranks = await asyncio.wait_for(asyncio.gather(*calls), timeout=timeout)
        self._weight_sync = {"host": host, "port": port, "group": group_name, "world_size": world, "timeout_s": timeout}
        return [r for per_engine in ranks for r in per_engine]

    async def close_weight_sync(self) -> None:
        self._weight_sync = None
        await asyncio.gather(*[e.collective_rpc.remote("rs_weight_sync_close") for e in self.engines])

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
            raise RefitInProgress(f"a refit is already running (current version {self.weight_version})")
        async with self._refit_lock:
            await self.start()
            version = str(version)
            if version in self._version_history:
                raise ValueError(f"weight version {version!r} was already used; versions label distinct weights")
            if getattr(transfer, "kind", None) == "collective" and self._weight_sync is None:
                raise WeightSyncNotInitialized("collective transfer needs init_weight_sync first")
            report = await self._refit_locked(
                version,
                transfer,
                self.config.refit.clear_cache if clear_cache is None else bool(clear_cache),
                timeout_s or self.config.refit.step_timeout_s,
                fail_load_after_tensors,
            )
            self._last_report = report.to_dict()
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

    async def _refit_locked(self, version, transfer, clear_cache, timeout, fail_load_after_tensors) -> RefitReport:
        engines = list(self.engines)
        previous = self.weight_version
        report = RefitReport(
            version=version, previous_version=previous, transport=getattr(transfer, "kind", "?"), clear_cache=clear_cache
        )
        aborted_before = await self._sum(engines, "num_aborted", timeout)
        step = "pause"
        load_attempted = False
        labelled = False
        paused: list[Any] = []
        label_s = 0.0
        t_start = time.perf_counter()
        try:
            report.requests_in_flight = await self._sum(engines, "num_in_flight", timeout)

            async def pause(e):
                await e.pause.remote(mode="keep", clear_cache=clear_cache)
                paused.append(e)

            t0 = time.perf_counter()
            await asyncio.wait_for(asyncio.gather(*[pause(e) for e in engines]), timeout)
            report.pause_s = time.perf_counter() - t0

            step = "transfer"
            t0 = time.perf_counter()
            report.bytes, report.worker_receive_s = await transfer.stage(engines, timeout)
            report.transfer_s = time.perf_counter() - t0

            step = "load"
            load_attempted = True
            t0 = time.perf_counter()
            kwargs = {"fail_after_tensors": fail_load_after_tensors} if fail_load_after_tensors is not None else None
            loads = await asyncio.wait_for(
                asyncio.gather(
                    *[e.collective_rpc.remote("rs_load_staged", kwargs=kwargs, timeout=timeout) for e in engines]
                ),
                timeout,
            )
            report.load_s = time.perf_counter() - t0
            report.worker_timings = [w for per_engine in loads for w in per_engine]

            step = "label"
            t0 = time.perf_counter()
            labelled = True
            await asyncio.wait_for(asyncio.gather(*[e.set_weight_version.remote(version) for e in engines]), timeout)
            await asyncio.wait_for(
                asyncio.gather(*[e.collective_rpc.remote("rs_commit", timeout=timeout) for e in engines]), timeout
            )
            self.weight_version = version
            self._version_history.append(version)
            label_s = time.perf_counter() - t0
            report.ok = True
        except BaseException as exc:  # noqa: BLE001 - every failure must end in a consistent, resumed state
            report.failed_step = step
            report.error = _short_error(exc)
            logger.warning("refit to %s failed at %s: %s", version, step, report.error)
            report.rolled_back = await self._recover(engines, previous, load_attempted, labelled, timeout, report)
        finally:
            await self._resume(paused, timeout, report)
            report.resume_s += label_s
            report.total_s = time.perf_counter() - t_start
        report.requests_aborted = max(0, await self._sum(engines, "num_aborted", timeout) - aborted_before)
        return report

    async def _recover(self, engines, previous, load_attempted, labelled, timeout, report) -> bool:
        """Back to the previous weights and label on every engine; an engine that cannot be restored
        stays paused (a half-loaded model must not serve) and is named in the report."""
        broken: list[str] = []

        async def one(i, e):
            try:
                if load_attempted:
                    await asyncio.wait_for(e.collective_rpc.remote("rs_rollback", timeout=timeout), timeout)
                else:
                    await asyncio.wait_for(e.collective_rpc.remote("rs_discard_staged", timeout=timeout), timeout)
                if labelled:
                    await asyncio.wait_for(e.set_weight_version.remote(previous), timeout)
            except Exception as exc:
                broken.append(f"engine {i}: {_short_error(exc)}")
                return e
            return None

        unrestorable = [e for e in await asyncio.gather(*[one(i, e) for i, e in enumerate(engines)]) if e is not None]
        if broken:
            report.error = f"{report.error}; ROLLBACK FAILED, left paused: {'; '.join(broken)}"
            self._unrestorable = unrestorable
        return load_attempted and not broken

    async def _resume(self, paused, timeout, report) -> None:
        keep_paused = set(map(id, getattr(self, "_unrestorable", [])))
        self._unrestorable = []
        t0 = time.perf_counter()
        results = await asyncio.gather(
            *[asyncio.wait_for(e.resume.remote(), timeout) for e in paused if id(e) not in keep_paused],
            return_exceptions=True,
        )
        errors = [f"{type(r).__name__}: {r}" for r in results if isinstance(r, BaseException)]
        if errors:
            report.ok = False
            report.failed_step = report.failed_step or "resume"
            report.error = (report.error + "; " if report.error else "") + "resume failed: " + "; ".join(errors)[:500]
        report.resume_s = time.perf_counter() - t0

    @staticmethod
    async def _sum(engines, method: str, timeout: float) -> int:
        values = await asyncio.wait_for(asyncio.gather(*[getattr(e, method).remote() for e in engines]), timeout)
        return int(sum(values))

    # ------------------------------------------------ GPU: vLLM's NCCL weight transfer
    # Unverified here (no GPU): the VLLMWeightSyncClient calls of vLLM's trainer-side
    # NCCLTrainerWeightTransferEngine, fanned out to every engine (transports.ControllerWeightSyncClient).
    async def nccl_init_weight_transfer_engine(self, init_info: dict) -> None:
        await self.start()
        await asyncio.gather(
            *[e.collective_rpc.remote("init_weight_transfer_engine", kwargs={"init_info": init_info}) for e in self.engines]
        )

    async def nccl_shutdown_weight_transfer_engine(self) -> None:
        await asyncio.gather(*[e.collective_rpc.remote("shutdown_weight_transfer_engine") for e in self.engines])

    async def nccl_start_weight_update(self) -> None:
        if self._refit_lock.locked():
            raise RefitInProgress("a refit is already running")
        await self._refit_lock.acquire()
        try:
            await asyncio.gather(*[e.pause.remote(mode="keep", clear_cache=self.config.refit.clear_cache) for e in self.engines])
            await asyncio.gather(*[e.collective_rpc.remote("start_weight_update") for e in self.engines])
        except BaseException:
            await self._nccl_release()
            raise

    async def nccl_update_weights(self, update_info: dict) -> None:
        try:
            await asyncio.gather(
                *[e.collective_rpc.remote("update_weights", kwargs={"update_info": update_info}) for e in self.engines]
            )
        except BaseException:
            # vLLM loaded part of the weights in place: reload the last good checkpoint, resume.
            await asyncio.gather(
                *[e.collective_rpc.remote("rs_reload_current") for e in self.engines], return_exceptions=True
            )
            await self._nccl_release()
            raise

    async def nccl_finish_weight_update(self, version: str | None) -> None:
        try:
            await asyncio.gather(*[e.collective_rpc.remote("finish_weight_update") for e in self.engines])
            if version is not None:
                await asyncio.gather(*[e.set_weight_version.remote(str(version)) for e in self.engines])
                self.weight_version = str(version)
                self._version_history.append(str(version))
        finally:
            await self._nccl_release()

    async def _nccl_release(self) -> None:
        try:
            await asyncio.gather(*[e.resume.remote() for e in self.engines], return_exceptions=True)
        finally:
            if self._refit_lock.locked():
                self._refit_lock.release()

    async def shutdown(self) -> None:
        import ray

        for e in self.engines:
            try:
                await asyncio.wait_for(e.shutdown.remote(), timeout=20)
            except Exception:
                pass
            ray.kill(e)
        self.engines = []
        self._started = False


def _short_error(exc: BaseException) -> str:
    """One line: the root cause's type and message, without Ray's remote traceback."""
    cause = getattr(exc, "cause", None) or exc
    lines = [ln.strip() for ln in str(cause).splitlines() if ln.strip()]
    if isinstance(exc, asyncio.TimeoutError) or isinstance(cause, asyncio.TimeoutError):
        return "TimeoutError: step timed out"
    return f"{type(cause).__name__}: {lines[-1] if lines else ''}"[:500]


def get_or_create_controller(config: RolloutServiceConfig, *, name: str = CONTROLLER_NAME):
    """The deployment's controller actor, created on first call (detached: it outlives callers)."""
    import ray

    return (
        ray.remote(RefitController)
        .options(
            name=name,
            namespace=CONTROLLER_NAMESPACE,
            lifetime="detached",
            get_if_exists=True,
            num_cpus=0,
            max_concurrency=1000,
        )
        .remote(config.model_dump())
    )


def get_controller(name: str = CONTROLLER_NAME):
    """For trainers: the running service's controller (``ray.get_actor``)."""
    import ray

    return ray.get_actor(name, namespace=CONTROLLER_NAMESPACE)
