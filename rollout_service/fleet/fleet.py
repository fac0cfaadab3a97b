"""The engine fleet: the one owner of the engine actors.

One named, detached actor per service (``rollout-service-fleet`` in namespace ``rollout-service``),
restarted by Ray when it dies; its engines are named and detached too, so a new incarnation adopts
them (:mod:`rollout_service.fleet.adoption`) instead of starting afresh (docs/reliability.md, "The control plane heals").
It creates the engines from the config (one per GPU / TP group, placed by
:mod:`rollout_service.fleet.placement`), probes them, replaces the dead and the hung on the
current weights, and publishes the serving set with an epoch (:class:`FleetView`). What the probes
and deaths *mean* is decided by the pure state machine in :mod:`rollout_service.fleet.health`;
this module is its I/O.

Who talks to it:

- the data plane holds a :class:`~rollout_service.fleet.client.FleetClient` (a long-poll on
  :meth:`EngineFleet.view`) and routes turns to the members;
- the control plane (the refit controller) brackets every refit with :meth:`begin_refit` /
  :meth:`end_refit`: no engine joins the serving set while a refit runs, and a replacement only
  joins once it holds the version the refit committed.

Weights of a replacement: :mod:`rollout_service.fleet.current_weights`. The Serve apps the fleet
serves and the processes it kills: :mod:`rollout_service.fleet.lifecycle`.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any

import ray

from rollout_service.config import FleetConfig, RolloutServiceConfig
from rollout_service.fleet.types import FleetView, Member, actor_identity, is_actor_dead
from rollout_service.fleet.adoption import Adoption, engine_name, placement_name
from rollout_service.fleet.current_weights import CurrentWeights, WeightsRecord, short_error
from rollout_service.fleet.types import BASE_VERSION, FLEET_NAMESPACE
from rollout_service.fleet.ledger import FleetLedger
from rollout_service.fleet.lifecycle import kill_processes, wait_until_apps_gone
from rollout_service.fleet.health import SERVING, EngineState, FleetHealth, HealthPolicy
from rollout_service.metrics import get_metrics

logger = logging.getLogger(__name__)

FLEET_NAME = "rollout-service-fleet"  # fleet_name(default instance_name)
MAX_CANARY_REPORTS = 256  # data-plane replicas whose parity canary figures the fleet keeps (docs/canary.md)


@dataclass
class _Slot:
    generation: int = -1
    actor: Any = None
    placement: Any = None
    processes: dict[str, Any] | None = None  # node_id + (pid, create_time) of the engine's processes
    channel: Any = None  # the engine's data channel address (engine.channel.ChannelAddress), if it has one
    load: int = 0
    task: asyncio.Task | None = None  # the start / load running for this slot
    paused_since: float | None = None  # first probe that found it paused while no refit ran


def health_policy(fc: FleetConfig) -> HealthPolicy:
    return HealthPolicy(**{k: getattr(fc, k) for k in HealthPolicy.__dataclass_fields__})


class EngineFleet(CurrentWeights, Adoption):
    def __init__(self, config: RolloutServiceConfig | dict):
        self.config = config if isinstance(config, RolloutServiceConfig) else RolloutServiceConfig.model_validate(config)
        self.incarnation = uuid.uuid4().hex[:12]
        # A named fleet (get_or_create_fleet) names its engines and their placement groups and makes
        # them detached, so they outlive a death of this actor; Ray restarts it (max_restarts) and the
        # new incarnation adopts them (_adopt) instead of starting afresh. An anonymous fleet (tests,
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
        # The last refit bracket, for operators (``stats()``, ``GET /v1/status``); kept across restarts.
        self._last_refit: dict[str, Any] | None = None
        self._refits = {"committed": 0, "not_committed": 0}
        self._pin_moves = 0  # rollouts the data plane moved off a live engine (routing.policy)
        self._canary_reports: dict[str, dict] = {}  # data-plane replica -> its parity canary's last report
        self._adopted_count: int | None = None  # engines a restarted incarnation took over (None: a first one)
        self._last_drain: dict | None = None  # the last drain of a restart on a new engine config
        self.ledger = FleetLedger(self._name, self.config.fleet.ledger_timeout_s)
        self._version_source: str | None = None  # how a restarted incarnation knew the current version
        if self._reconstructed:  # restarted by Ray: adopt now, not at the first call (none may come)
            try:
                self._recovering = asyncio.get_running_loop().create_task(self._recover_soon())
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
        self._refit_deadline = float("inf")
        self._refit_members: list[tuple[int, int]] = []  # (slot, generation) of the open bracket's engines
        self._first_starts: list[asyncio.Task] = []

    def _reset_slots(self) -> None:
        ec = self.config.engine
        before = [h.generation for h in self.health.slots] if hasattr(self, "health") else []
        self.health = FleetHealth(ec.num_engines, health_policy(self.config.fleet), current_version=BASE_VERSION)
        for h, generation in zip(self.health.slots, before):
            h.generation = generation + 1  # engine names (<fleet>-engine-<slot>-g<generation>) are never reused
        self.slots = [_Slot() for _ in range(ec.num_engines)]
        self.weights = WeightsRecord(version=BASE_VERSION, path=ec.resolved_model())

    # ------------------------------------------------------------------ life cycle
    async def start(self, wait: bool = True) -> float:
        """Start every slot's engine (idempotent); with ``wait``, until every *first* start ended
        (later replacements are not waited for: a caller must not stall on a fault)."""
        await self._recover()
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
        await self._recover()
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
            self.config = new
            self._init_state()
            if keep is not None and keep_version != BASE_VERSION:
                self.weights = keep
                self.health.current_version = keep_version
        await self.start()
        return changed

    async def attach_app(self, app_name: str) -> None:
        """A Serve application uses this fleet: when every attached app is deleted, the fleet stops."""
        await self._recover()
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
        await self._recover()  # a restarted fleet stops the engines it inherited too
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
        for s in self.slots:  # no start, replacement or reload may bring an engine back into service now
            if s.task is not None:
                s.task.cancel()
        if drain:
            await self._drain()

        async def stop(s: _Slot):
            if s.actor is None:
                return
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

        await asyncio.gather(*[stop(s) for s in self.slots])
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
        await self._recover()
        if known_epoch is not None and wait_s > 0 and known_epoch == self.health.epoch:
            async with self._changed:
                try:
                    await asyncio.wait_for(self._changed.wait_for(lambda: self.health.epoch != known_epoch), wait_s)
                except asyncio.TimeoutError:
                    pass
        return self._view()

    async def loaded_members(self) -> tuple[Member, ...]:
        """The engines a restarted refit controller brings back to one version: the serving ones,
        and while a refit bracket is open, every live engine the bracket's refit ran over (a
        restarted fleet keeps those that carry a label it never recorded out of the serving set,
        STALE). Other STALE engines (a replacement still reloading) are the fleet's own business."""
        await self._recover()
        members = set(self.health.serving())
        if self.health.refitting:
            members |= {slot for slot, generation in self._refit_members
                        if self.health.slots[slot].generation == generation
                        and self.health.slots[slot].state in (*SERVING, EngineState.STALE)}
        return tuple(Member(i, self.slots[i].generation, self.slots[i].actor, self.slots[i].load, self.slots[i].channel)
                     for i in sorted(members) if self.slots[i].actor is not None)

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

    async def report_failure(self, slot: int, generation: int, error: str, fatal: bool = False) -> None:
        """A caller saw a call on this engine fail: ``fatal`` (Ray says the actor died) declares it
        dead now; otherwise (unreachable for a moment) it is probed now instead of at the next round."""
        await self._recover()
        if 0 <= slot < len(self.slots) and self.health.is_current(slot, generation):
            await self._probe(slot, fatal_error=error if fatal else None)

    async def mark_dead(self, slot: int, generation: int, error: str) -> None:
        """The control plane found this engine unusable (e.g. a rollback failed): replace it."""
        await self._recover()
        before = self.health.epoch
        self.health.mark_dead(slot, generation, error)
        self._on_dead(slot, generation)
        await self._publish(before)

    async def revive(self, slot: int) -> None:
        """Operator: give a retired (crash-looping) slot a fresh replacement budget."""
        self.health.revive(slot)

    async def fan_out(self, method: str, *args: Any, timeout_s: float = 60.0, **kwargs: Any) -> dict[int, Any]:
        """Call an engine method (``pause``, ``resume``, ``collective_rpc``, ``set_weight_version``, ...)
        on every serving engine: ``{slot: result}``. An engine that died on the way is declared dead
        (and replaced) and answers ``{"error": ...}`` instead of failing the whole call.

        The refit's own steps fan out over the members of its ``FleetView`` in the controller's
        process (one hop less on every step of the stall); this is for every other control call."""
        await self._recover()

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

    # ------------------------------------------------------------------ refit bracket
    async def begin_refit(self, lease_s: float = 3600.0) -> FleetView:
        """A refit starts over the returned members; nothing joins the serving set until ``end_refit``
        or until ``lease_s`` passes (a controller that died mid-refit does not block joins forever)."""
        await self._recover()
        if self.health.refitting:
            raise RuntimeError("a refit is already bracketed on the fleet")
        self.health.begin_refit()
        self._refit_deadline = time.monotonic() + lease_s
        self._refit_members = [(i, self.health.slots[i].generation) for i in self.health.serving()]
        self._last_refit = {"outcome": "running", "from_version": self.health.current_version, "version": None,
                            "started_at": time.time(), "ended_at": None, "duration_s": None}
        exporting = self.weights.exporting
        if exporting is not None and not exporting.done():
            exporting.cancel()  # an export must not race the refit's load
        await self._persist()  # a restarted fleet keeps the bracket (and so does not resume a paused load)
        return self._view()

    async def end_refit(self, version: str | None = None, path: str | None = None) -> FleetView:
        """End the bracket. ``version``: the refit committed it on every member (``path``: the
        checkpoint directory it came from, if any); None: nothing changed."""
        await self._recover()
        before = self.health.epoch
        if version is not None and version != self.health.current_version:
            self.weights = WeightsRecord(version=version, path=path)
        if self.health.refitting:
            self._record_refit_end(version)
        self.health.end_refit(version)
        await self._persist()  # the committed version, read back by a restarted fleet
        if self.weights.path is None and self.weights.ref is None and self.config.fleet.keep_weights_copy:
            self._start_export()
        await self._publish(before)
        return self._view()

    def _record_refit_end(self, version: str | None) -> None:
        """``committed`` (the bracket ended on a new version) or ``not_committed`` (the refit failed or
        was abandoned: nothing changed); ``lease_expired`` when the fleet ended it for a lost controller."""
        last = self._last_refit or {"from_version": None, "started_at": None}
        now = time.time()
        expired = time.monotonic() > self._refit_deadline
        outcome = "committed" if version is not None else ("lease_expired" if expired else "not_committed")
        self._refits["committed" if version is not None else "not_committed"] += 1
        started = last.get("started_at")
        self._last_refit = {**last, "outcome": outcome, "version": version, "ended_at": now,
                            "duration_s": round(now - started, 3) if started else None}

    # ------------------------------------------------------------------ stats
    async def stats(self) -> dict[str, Any]:
        await self._recover()
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
            "pin_moves": self._pin_moves,
            "incarnation": self.incarnation,
            "adopted": self._adopted_count,
            "last_drain": dict(self._last_drain) if self._last_drain else None,
            "ledger": self.ledger.status(),
            "version_source": self._version_source,
        }

    def count_pin_move(self) -> None:
        """A data-plane process moved a rollout off a live engine (routing.policy)."""
        self._pin_moves += 1

    def report_canary(self, replica: str, report: dict) -> None:
        """A data-plane replica's parity canary figures (cumulative: a report replaces the replica's
        previous one unless it is older, by its ``seq``). The reports of the MAX_CANARY_REPORTS replicas
        heard from last are kept (those of replicas gone since too: their turns were checked)."""
        old = self._canary_reports.pop(replica, None)
        if old is not None and old.get("seq", 0) > report.get("seq", 0):
            report = old
        self._canary_reports[replica] = report
        while len(self._canary_reports) > MAX_CANARY_REPORTS:
            self._canary_reports.pop(next(iter(self._canary_reports)))

    def canary_reports(self) -> list[dict]:
        """The replicas' last canary reports."""
        return list(self._canary_reports.values())

    def engine_config(self) -> dict:
        return self.config.engine.model_dump()

    def service_config(self) -> dict:
        return self.config.model_dump()

    # ------------------------------------------------------------------ monitor
    async def _monitor_loop(self) -> None:
        while not self._closing:
            try:
                await self._monitor_once()
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.exception("fleet monitor step failed")
            await asyncio.sleep(self.health.policy.probe_interval_s)

    async def _monitor_once(self) -> None:
        probed = [i for i in self.health.in_state(*SERVING, EngineState.STALE) if self.slots[i].actor is not None]
        await asyncio.gather(*[self._probe(i) for i in probed])
        if self.health.refitting and time.monotonic() > self._refit_deadline:
            logger.warning("refit bracket not ended within its lease: ending it (no version change)")
            await self.end_refit(None)
        if self.ledger.dirty:  # a write failed: the record must not stay behind what is true
            await self._persist()
        before = self.health.epoch
        for i in self.health.tick():
            self._on_dead(i, self.health.slots[i].generation)
        for i in self.health.due_replacements():
            old = self.health.slots[i].generation
            self._kill(self.slots[i])  # idempotent: a dead slot's old actor is gone for good
            generation = self.health.on_replacement_started(i)
            get_metrics().engine_replaced(self._metrics_name())
            logger.warning("replacing engine slot %d (generation %d -> %d): %s", i, old, generation,
                           self.health.slots[i].last_error)
            self._launch(i, generation)
        for i in self.health.stale():
            s = self.slots[i]
            if s.task is None or s.task.done():
                s.task = asyncio.get_running_loop().create_task(self._load_current(i, self.health.slots[i].generation))
        await self._publish(before)

    async def _probe(self, slot: int, fatal_error: str | None = None) -> None:
        import ray.exceptions as rex

        s, h = self.slots[slot], self.health.slots[slot]
        generation = h.generation
        before = self.health.epoch
        if s.actor is None:
            return
        if fatal_error is not None:
            self.health.on_probe_failed(slot, generation, fatal_error, fatal=True)
        else:
            try:
                info = await asyncio.wait_for(s.actor.health.remote(), self.health.policy.probe_timeout_s)
                s.load = int(info.get("in_flight", 0))
                self.health.on_probe_ok(slot, generation)
                await self._resume_if_left_paused(slot, bool(info.get("paused")))
            except asyncio.TimeoutError:
                self.health.on_probe_failed(slot, generation, f"probe timed out after {self.health.policy.probe_timeout_s}s")
            except (rex.RayActorError, rex.ActorUnavailableError) as exc:
                self.health.on_probe_failed(slot, generation, f"{type(exc).__name__}: actor died", fatal=True)
            except Exception as exc:  # EngineUnavailable (vLLM engine errored) and the like
                self.health.on_probe_failed(slot, generation, short_error(exc), fatal=True)
        if self.health.slots[slot].state in (EngineState.DEAD, EngineState.RETIRED) and self.health.is_current(slot, generation):
            self._on_dead(slot, generation)
        await self._publish(before)

    def _on_dead(self, slot: int, generation: int) -> None:
        s = self.slots[slot]
        if s.generation == generation:
            logger.warning("engine slot %d (generation %d) is dead: %s", slot, generation,
                           self.health.slots[slot].last_error)
            self._kill(s)

    def _kill(self, s: _Slot) -> None:
        """Kill the slot's actor and make sure its processes are gone (a SIGSTOPped engine ignores
        everything but SIGKILL, and ``ray.kill`` leaves it, and its EngineCore child, for a while)."""
        import ray

        actor, processes = s.actor, s.processes
        s.actor, s.processes, s.load, s.channel = None, None, 0, None
        if actor is None:
            return
        try:
            ray.kill(actor, no_restart=True)
        except Exception:
            pass
        if processes:
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            kill_processes.options(
                scheduling_strategy=NodeAffinitySchedulingStrategy(processes["node_id"], soft=False)
            ).remote(processes["processes"])

    async def _resume_if_left_paused(self, slot: int, paused: bool) -> None:
        """Resume an engine paused for ``fleet.resume_unbracketed_pause_s`` while no refit runs: a
        pause that landed after the refit that sent it was over (its controller died, or the call
        outlived its timeout) is nobody's to undo but this."""
        s = self.slots[slot]
        if not paused or self.health.refitting:
            s.paused_since = None
            return
        now = time.monotonic()
        if s.paused_since is None:
            s.paused_since = now
        elif now - s.paused_since >= self.config.fleet.resume_unbracketed_pause_s:
            logger.warning("engine slot %d paused for %.0fs with no refit running: resuming it", slot, now - s.paused_since)
            s.paused_since = None
            try:
                await asyncio.wait_for(s.actor.resume.remote(), self.health.policy.probe_timeout_s)
            except Exception as exc:
                logger.warning("resuming engine slot %d failed: %s", slot, short_error(exc))

    # ------------------------------------------------------------------ bring-up
    def _launch(self, slot: int, generation: int) -> None:
        s = self.slots[slot]
        if s.task is not None and not s.task.done():
            s.task.cancel()  # a start of an earlier generation that never ended
        s.task = asyncio.get_running_loop().create_task(self._bring_up(slot, generation))

    async def _bring_up(self, slot: int, generation: int) -> None:
        """Start an engine in ``slot`` and bring it to the current weights; failures go to the state machine."""
        from rollout_service.engine.replica import create_engine_actor

        s = self.slots[slot]
        ec = self.config.engine
        timeout = self.health.policy.start_timeout_s
        try:
            if s.placement is None:  # kept across replacements: a replacement gets the same GPUs / node
                s.placement = await reserve(ec, slot, timeout, **self._detached(placement_name(self._name, slot)))
            actor = create_engine_actor(ec, slot, placement=s.placement, initial_weight_version=BASE_VERSION,
                                        **self._detached(engine_name(self._name, slot, generation),
                                                         namespace=FLEET_NAMESPACE))
            s.generation, s.actor = generation, actor
            await asyncio.wait_for(actor.start.remote(), timeout)
            s.processes = await asyncio.wait_for(actor.process_info.remote(), 60)
            if ec.data_channel == "tcp":
                channel = await asyncio.wait_for(actor.open_channel.remote(), 60)
                if s.actor is actor:
                    s.channel = channel
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            logger.warning("engine slot %d failed to start: %s", slot, short_error(exc))
            await self._failed(slot, generation, short_error(exc))
            return
        await self._load_current(slot, generation)

    async def _failed(self, slot: int, generation: int, error: str) -> None:
        before = self.health.epoch
        self.health.on_start_failed(slot, generation, error)
        if self.slots[slot].generation == generation:
            self._kill(self.slots[slot])
        await self._publish(before)

    def _detached(self, name: str | None, **extra: Any) -> dict[str, Any]:
        """Options that let an engine (or its placement group) outlive this actor, when it is named."""
        return {"name": name, "lifetime": "detached", **extra} if self._name is not None else {}

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
    # the engines (EngineFleet._adopt) and every handle to it keeps working.
    opts: dict[str, Any] = dict(name=fleet_name(config.service.instance_name), namespace=FLEET_NAMESPACE, get_if_exists=True, num_cpus=0,
                                max_concurrency=1000, max_restarts=-1)
    if detached:
        opts["lifetime"] = "detached"
    return ray.remote(EngineFleet).options(**opts).remote(config.model_dump())


def get_fleet(name: str = FLEET_NAME):
    import ray

    return ray.get_actor(name, namespace=FLEET_NAMESPACE)


async def reserve(config, slot: int, timeout: float, **options: Any):
    """Reserve an engine's placement group in a thread. If the bring-up is cancelled while the
    thread waits (fleet stop, a config restart), the thread still finishes: the group it then
    holds is removed instead of keeping its GPUs until the fleet actor dies."""
    from rollout_service.fleet.placement import release_engine_placement, reserve_engine_placement

    reservation = asyncio.ensure_future(asyncio.to_thread(reserve_engine_placement, config, slot, timeout_s=timeout,
                                                          **options))
    try:
        return await asyncio.shield(reservation)
    except asyncio.CancelledError:
        def release_abandoned(done: asyncio.Future) -> None:
            if not done.cancelled() and done.exception() is None:
                release_engine_placement(done.result())

        reservation.add_done_callback(release_abandoned)
        raise
