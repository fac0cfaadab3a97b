"""The engine fleet: the one owner of the engine actors.

One named, detached actor per service (``rollout-service-fleet`` in namespace ``rollout-service``),
restarted by Ray when it dies; its engines are named and detached too, so a new incarnation adopts
them (:mod:`rollout_service.fleet.adoption`) instead of starting afresh (docs/reliability.md, "The control plane heals").
It creates the engines from the config (one per GPU / TP group, placed by
:mod:`rollout_service.fleet.placement`), probes them, replaces the dead and the hung on the
current weights, and publishes the serving set with an epoch (:class:`FleetView`).

This module is the actor and its life cycle (start, a restart on a new engine config, drain,
shutdown, the Serve apps it serves), its views and stats. The rest is in rooms of its own, mixins
of :class:`EngineFleet`: :mod:`~rollout_service.fleet.monitor` (probes, deaths, replacements: the
I/O of the pure state machine :mod:`~rollout_service.fleet.health`),
:mod:`~rollout_service.fleet.bring_up` (starting an engine in a slot),
:mod:`~rollout_service.fleet.refit_bracket` (the refit bracket and the durable record of it),
:mod:`~rollout_service.fleet.adoption` (a new incarnation takes over its predecessor's engines) and
:mod:`~rollout_service.fleet.current_weights` (where a replacement loads the weights from). What the
data plane's replicas report for the status page (canary figures, pin moves) is theirs, kept here
in a :class:`~rollout_service.fleet.data_plane_reports.DataPlaneReports`.

Who talks to it:

- the data plane holds a :class:`~rollout_service.fleet.client.FleetClient` (a long-poll on
  :meth:`EngineFleet.view`) and routes turns to the members;
- the control plane (the refit controller) brackets every refit with ``begin_refit`` /
  ``end_refit`` (:mod:`rollout_service.fleet.refit_bracket`).

The Serve apps the fleet serves and the processes it kills: :mod:`rollout_service.fleet.lifecycle`.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Any

import ray

from rollout_service.config import FleetConfig, RolloutServiceConfig
from rollout_service.fleet.adoption import Adoption
from rollout_service.fleet.bring_up import BringUp, Slot
from rollout_service.fleet.current_weights import CurrentWeights, WeightsRecord, short_error
from rollout_service.fleet.data_plane_reports import DataPlaneReports
from rollout_service.fleet.health import EngineState, FleetHealth, HealthPolicy
from rollout_service.fleet.ledger import FleetLedger
from rollout_service.fleet.lifecycle import wait_until_apps_gone
from rollout_service.fleet.monitor import Monitor
from rollout_service.fleet.refit_bracket import RefitBracket
from rollout_service.fleet.types import BASE_VERSION, FLEET_NAMESPACE, FleetView, Member, actor_identity, is_actor_dead
from rollout_service.metrics import get_metrics

logger = logging.getLogger(__name__)

FLEET_NAME = "rollout-service-fleet"  # fleet_name(default instance_name)


def health_policy(fc: FleetConfig) -> HealthPolicy:
    return HealthPolicy(**{k: getattr(fc, k) for k in HealthPolicy.__dataclass_fields__})


class EngineFleet(CurrentWeights, Adoption, Monitor, BringUp, RefitBracket):
    def __init__(self, config: RolloutServiceConfig | dict):
        self.config = config if isinstance(config, RolloutServiceConfig) else RolloutServiceConfig.model_validate(config)
        self.incarnation = uuid.uuid4().hex[:12]
        # A named fleet (get_or_create_fleet) names its engines and their placement groups and makes
        # them detached, so they outlive a death of this actor; Ray restarts it (max_restarts) and the
        # new incarnation adopts them (Adoption) instead of starting afresh. An anonymous fleet (tests,
        # scripts) owns its engines the plain way: they die with it.
        # A named fleet looks for engines of its name once, whether Ray restarted it or it was created
        # afresh after its predecessor was killed for good: they are adopted, never left running.
        self._name, self._reconstructed = actor_identity()
        self._adopted = self._name is None
        self._init_state()
        self._apps: set[str] = set()
        self._dependents: list[Any] = []
        self._config_lock = asyncio.Lock()
        self._watch_task: asyncio.Task | None = None
        self._init_refit_record()
        self.data_plane = DataPlaneReports()  # the data plane's, kept here for its replicas to reach
        self._adopted_count: int | None = None  # engines a restarted incarnation took over (None: a first one)
        self._last_drain: dict | None = None  # the last drain of a restart on a new engine config
        self.ledger = FleetLedger(self._name, self.config.fleet.ledger_timeout_s)
        self._version_source: str | None = None  # how a restarted incarnation knew the current version
        if self._reconstructed:  # restarted by Ray: adopt now, not at the first call (none may come)
            try:
                self._adopting = asyncio.get_running_loop().create_task(self._adopt_inherited_engines_soon())
            except RuntimeError:  # constructed outside an event loop: the first call adopts
                pass

    def _init_state(self) -> None:
        self._reset_slots()
        self._changed = asyncio.Condition()
        self._started = False
        self._start_lock = asyncio.Lock()
        self._monitor: asyncio.Task | None = None
        self._startup_s: float | None = None
        self._closing = False
        self._reset_bracket()
        self._first_starts: list[asyncio.Task] = []

    def _reset_slots(self) -> None:
        ec = self.config.engine
        before = [h.generation for h in self.health.slots] if hasattr(self, "health") else []
        self.health = FleetHealth(ec.num_engines, health_policy(self.config.fleet), current_version=BASE_VERSION)
        for h, generation in zip(self.health.slots, before):
            h.generation = generation + 1  # engine names (<fleet>-engine-<slot>-g<generation>) are never reused
        self.slots = [Slot() for _ in range(ec.num_engines)]
        self.weights = WeightsRecord(version=BASE_VERSION, path=ec.resolved_model())

    # ------------------------------------------------------------------ life cycle
    async def start(self, wait: bool = True) -> float:
        """Start every slot's engine (idempotent); with ``wait``, until every *first* start ended
        (later replacements are not waited for: a caller must not stall on a fault)."""
        await self._adopt_inherited_engines()
        async with self._start_lock:
            if not self._started:
                self._started = True
                self._closing = False
                t0 = time.perf_counter()
                for i in range(len(self.slots)):
                    self._launch(i, self.health.slots[i].generation)
                self._first_starts = [s.task for s in self.slots]
                self._monitor = asyncio.get_running_loop().create_task(self._monitor_loop())
                self._t0 = t0
                await self._persist()
        if wait:
            await asyncio.gather(*self._first_starts, return_exceptions=True)
            if self._startup_s is None:
                self._startup_s = time.perf_counter() - self._t0
                if not self.health.serving():
                    errors = "; ".join(f"slot {s.slot}: {s.last_error}" for s in self.health.slots)
                    raise RuntimeError(f"no engine could be started (the fleet keeps retrying): {errors}")
        return self._startup_s or 0.0

    async def ensure_config(self, config: dict) -> list[str]:
        """Redeploys call this with their config. A different *engine* config restarts the fleet on it
        (the old engines are stopped, not silently kept). Returns the differing fields (empty: same).
        Other sections (fleet thresholds, ...) are taken over in place."""
        await self._adopt_inherited_engines()
        async with self._config_lock:
            return await self._ensure_config(RolloutServiceConfig.model_validate(config))

    async def _ensure_config(self, new: RolloutServiceConfig) -> list[str]:
        old_engine = self.config.engine.model_dump()
        changed = [k for k, v in new.engine.model_dump().items() if old_engine.get(k) != v]
        same_model = new.engine.resolved_model() == self.config.engine.resolved_model()
        if not changed:
            self.config = new
            self.health.policy = health_policy(new.fleet)
            return []
        logger.warning("engine config changed (%s): restarting the fleet", ", ".join(changed))
        async with self._start_lock:
            await self._stop_engines(drain=True)
            # Read after the drain: a refit that committed while the engines finished their calls counts.
            keep = self.weights if same_model else None
            keep_version = self.health.current_version if same_model else BASE_VERSION
            versions = list(self.health.versions)
            self.config = new
            self._init_state()
            self.health.versions = versions  # the staleness bound counts refits across a restart too
            self.health.note_version(BASE_VERSION if keep is None else keep_version)
            if keep is not None and keep_version != BASE_VERSION:
                self.weights = keep
                self.health.current_version = keep_version
        await self.start()
        return changed

    async def attach_app(self, app_name: str) -> None:
        """A Serve application uses this fleet: when every attached app is deleted, the fleet stops."""
        await self._adopt_inherited_engines()
        if app_name not in self._apps:
            self._apps.add(app_name)
            await self._persist()
        self._watch_apps_started()

    def _watch_apps_started(self) -> None:
        if self._watch_task is None and self._apps:
            self._watch_task = asyncio.get_running_loop().create_task(self._watch_apps())

    def add_dependent(self, actor) -> None:
        """An actor that lives only as long as the fleet (the refit controller): killed with it."""
        self._dependents.append(actor)

    async def shutdown(self) -> None:
        """Stop every engine and the monitor (the fleet actor itself stays until killed); a later
        ``start`` begins afresh."""
        await self._adopt_inherited_engines()  # a restarted fleet stops the engines it inherited too
        async with self._start_lock:
            await self._stop_engines()
            self._init_state()
            await self._persist()

    async def _stop_engines(self, drain: bool = False) -> None:
        """Stop every engine. ``drain`` (a restart on a new engine config): they leave the serving set
        first and finish the calls they run, for up to ``fleet.drain_timeout_s``."""
        self._closing = True
        if self.weights.exporting is not None:
            self.weights.exporting.cancel()
        if self._monitor is not None:
            self._monitor.cancel()
            self._monitor = None
        # An engine inside its start answers no call before the start ends (a model load blocks it):
        # it is killed at once, not asked to stop. Read before the cancels below end those starts.
        starting = {i for i, s in enumerate(self.slots) if s.starting}
        for s in self.slots:  # no start, replacement or reload may bring an engine back into service now
            if s.task is not None:
                s.task.cancel()
        if drain:
            await self._drain()

        async def stop(i: int, s: Slot):
            if s.actor is None:
                return
            if i not in starting:
                try:
                    await asyncio.wait_for(s.actor.shutdown.remote(), timeout=20)
                except Exception:
                    pass
            self._kill(s)
            if s.placement is not None:
                from rollout_service.fleet.placement import release_engine_placement

                placement, s.placement = s.placement, None
                try:
                    release_engine_placement(placement)
                except Exception:
                    pass

        await asyncio.gather(*[stop(i, s) for i, s in enumerate(self.slots)])
        async with self._changed:
            self._changed.notify_all()

    async def _drain(self) -> None:
        slots = self.health.drain()
        if not slots:
            return
        async with self._changed:
            self._changed.notify_all()  # the routers' long polls see the empty serving set now
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        deadline = t0 + self.config.fleet.drain_timeout_s
        # The routers learn of the empty serving set through their long poll: a call routed just
        # before must reach its engine before an idle reading counts.
        settle = t0 + min(1.0, self.config.fleet.drain_timeout_s)
        pending = {i for i in slots if self.slots[i].actor is not None}

        async def running(i: int) -> int:
            try:
                return await asyncio.wait_for(self.slots[i].actor.num_in_flight.remote(),
                                              timeout=max(0.1, min(self.health.policy.probe_timeout_s, deadline - loop.time())))
            except asyncio.TimeoutError:
                return 1  # too busy or stalled to answer: not known to be idle
            except Exception:  # the actor is gone: nothing left to wait for
                return 0

        while pending and loop.time() < deadline:
            order = sorted(pending)
            counts = await asyncio.gather(*(running(i) for i in order))
            if loop.time() >= settle:
                pending -= {i for i, n in zip(order, counts) if n == 0}
            if pending:
                await asyncio.sleep(0.2)
        took = loop.time() - t0
        self._last_drain = {"slots": slots, "seconds": round(took, 3), "unfinished": sorted(pending)}
        logger.warning("engines %s drained in %.1fs%s", slots, took,
                       f"; {sorted(pending)} still had calls at fleet.drain_timeout_s" if pending else "")

    # ------------------------------------------------------------------ views
    def _view(self) -> FleetView:
        members = tuple(
            Member(i, self.slots[i].generation, self.slots[i].actor, self.slots[i].load, self.slots[i].channel)
            for i in self.health.serving()
        )
        draining = tuple((i, self.slots[i].generation) for i in self.health.in_state(EngineState.DRAINING))
        return FleetView(self.health.epoch, self.health.current_version, members, self.health.refitting,
                         self.incarnation, draining, tuple(self.health.versions))

    async def view(self, known_epoch: int | None = None, wait_s: float = 0.0) -> FleetView:
        """The serving set. With ``known_epoch``, wait up to ``wait_s`` for a different epoch (long poll)."""
        await self._adopt_inherited_engines()
        if known_epoch is not None and wait_s > 0 and known_epoch == self.health.epoch:
            async with self._changed:
                try:
                    await asyncio.wait_for(self._changed.wait_for(lambda: self.health.epoch != known_epoch), wait_s)
                except asyncio.TimeoutError:
                    pass
        return self._view()

    async def _publish(self, epoch_before: int) -> None:
        self._record_metrics()
        if self.health.epoch != epoch_before:
            logger.info("fleet epoch %d -> %d: serving %s", epoch_before, self.health.epoch, self.health.serving())
            async with self._changed:
                self._changed.notify_all()

    def _metrics_name(self) -> str:
        """The ``fleet`` label: the actor's name (``<instance_name>-fleet``), or its id when anonymous."""
        if getattr(self, "_metrics_label", None) is None:
            try:
                import ray

                ctx = ray.get_runtime_context()
                self._metrics_label = ctx.get_actor_name() or ctx.get_actor_id()[:12]
            except Exception:  # not in an actor (unit use)
                self._metrics_label = "local"
        return self._metrics_label

    def _record_metrics(self) -> None:
        """Engine states and the version served, on every change and every monitor round (metrics)."""
        metrics = get_metrics()
        metrics.engines((s.state.value for s in self.health.slots), self._metrics_name())
        metrics.weight_version(self.health.current_version, self._metrics_name())

    # ------------------------------------------------------------------ control calls
    async def fan_out(self, method: str, *args: Any, timeout_s: float = 60.0, **kwargs: Any) -> dict[int, Any]:
        """Call an engine method (``pause``, ``resume``, ``collective_rpc``, ``set_weight_version``, ...)
        on every serving engine: ``{slot: result}``. An engine that died on the way is declared dead
        (and replaced) and answers ``{"error": ...}`` instead of failing the whole call.

        The refit's own steps fan out over the members of its ``FleetView`` in the controller's
        process (one hop less on every step of the stall); this is for every other control call."""
        await self._adopt_inherited_engines()

        view = self._view()

        async def one(m: Member):
            try:
                return await asyncio.wait_for(getattr(m.handle, method).remote(*args, **kwargs), timeout_s)
            except Exception as exc:
                if is_actor_dead(exc):
                    await self.report_failure(m.slot, m.generation, short_error(exc), True)
                return {"error": short_error(exc)}

        results = await asyncio.gather(*[one(m) for m in view.members])
        return {m.slot: r for m, r in zip(view.members, results)}

    # ------------------------------------------------------------------ stats
    async def stats(self) -> dict[str, Any]:
        await self._adopt_inherited_engines()
        slots = self.health.snapshot()
        for d, s in zip(slots, self.slots):
            d["load"] = s.load
            d["node_id"] = (s.processes or {}).get("node_id")
        w = self.weights
        return {
            "epoch": self.health.epoch,
            "weight_version": self.health.current_version,
            "refitting": self.health.refitting,
            "serving": self.health.serving(),
            "slots": slots,
            "startup_s": self._startup_s,
            "weights_source": "path" if w.path else ("object_store" if w.ref is not None else "peer"),
            "apps": sorted(self._apps),
            "last_refit": dict(self._last_refit) if self._last_refit else None,
            "refits": dict(self._refits),
            "backend": self.config.engine.backend,
            "pin_moves": self.data_plane.pin_moves,
            "incarnation": self.incarnation,
            "adopted": self._adopted_count,
            "last_drain": dict(self._last_drain) if self._last_drain else None,
            "ledger": self.ledger.status(),
            "version_source": self._version_source,
        }

    # ------------------------------------------------------------------ the data plane's reports
    def count_pin_move(self) -> None:
        """A data-plane process moved a rollout off a live engine (:class:`DataPlaneReports`)."""
        self.data_plane.count_pin_move()

    def report_canary(self, replica: str, report: dict) -> None:
        """A data-plane replica's parity canary figures (:meth:`DataPlaneReports.report_canary`)."""
        self.data_plane.report_canary(replica, report)

    def canary_reports(self) -> list[dict]:
        """The replicas' last canary reports (:class:`DataPlaneReports`)."""
        return self.data_plane.canary_reports()

    # ------------------------------------------------------------------ config
    def engine_config(self) -> dict:
        return self.config.engine.model_dump()

    def service_config(self) -> dict:
        return self.config.model_dump()

    # ------------------------------------------------------------------ app watch
    async def _watch_apps(self) -> None:
        """Stop the engines, the dependents and this actor once every attached Serve app is gone."""
        await wait_until_apps_gone(lambda: self._apps, self.config.fleet.app_watch_interval_s)
        logger.warning("Serve app(s) %s deleted: stopping the engine fleet", sorted(self._apps))
        await self.shutdown()
        await self.ledger.clear()
        for actor in self._dependents:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:
                pass
        ray.kill(ray.get_runtime_context().current_actor, no_restart=True)


def fleet_name(instance_name: str) -> str:
    return f"{instance_name}-fleet"


def get_or_create_fleet(config: RolloutServiceConfig, *, detached: bool = True):
    """The service's fleet actor (``<service.instance_name>-fleet``), created on first call
    (detached: it outlives the callers)."""
    import ray

    # max_restarts: Ray restarts a fleet that died (killed, its node lost); the new incarnation adopts
    # the engines (Adoption) and every handle to it keeps working.
    opts: dict[str, Any] = dict(name=fleet_name(config.service.instance_name), namespace=FLEET_NAMESPACE, get_if_exists=True, num_cpus=0,
                                max_concurrency=1000, max_restarts=-1)
    if detached:
        opts["lifetime"] = "detached"
    return ray.remote(EngineFleet).options(**opts).remote(config.model_dump())


def get_fleet(name: str = FLEET_NAME):
    import ray

    return ray.get_actor(name, namespace=FLEET_NAMESPACE)

