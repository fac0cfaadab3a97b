"""The fleet's monitor: probes the engines, declares the dead and the hung dead, kills them, has
them replaced and reloads the stale; a mixin of :class:`~rollout_service.fleet.fleet.EngineFleet`,
whose slots, health, weights and config it uses.

What the probes and deaths *mean* is decided by the pure state machine in
:mod:`rollout_service.fleet.health`; this is its I/O. A replacement is started by
:mod:`rollout_service.fleet.bring_up` and loads the current weights through
:mod:`rollout_service.fleet.current_weights`. Callers' reports of a failed call (``report_failure``)
and the control plane's verdicts (``mark_dead``) come in here too.
"""

from __future__ import annotations

import asyncio
import logging
import time

from rollout_service.config import RolloutServiceConfig
from rollout_service.fleet.bring_up import Slot
from rollout_service.fleet.current_weights import short_error
from rollout_service.fleet.health import SERVING, EngineState
from rollout_service.fleet.lifecycle import kill_processes
from rollout_service.metrics import get_metrics

logger = logging.getLogger("rollout_service.fleet.fleet")


class Monitor:
    config: RolloutServiceConfig

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
        await self._end_bracket_past_its_lease()
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

    def _kill(self, s: Slot) -> None:
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

    # ------------------------------------------------------------------ what callers report
    async def report_failure(self, slot: int, generation: int, error: str, fatal: bool = False) -> None:
        """A caller saw a call on this engine fail: ``fatal`` (Ray says the actor died) declares it
        dead now; otherwise (unreachable for a moment) it is probed now instead of at the next round."""
        await self._adopt_inherited_engines()
        if 0 <= slot < len(self.slots) and self.health.is_current(slot, generation):
            await self._probe(slot, fatal_error=error if fatal else None)

    async def mark_dead(self, slot: int, generation: int, error: str) -> None:
        """The control plane found this engine unusable (e.g. a rollback failed): replace it."""
        await self._adopt_inherited_engines()
        before = self.health.epoch
        self.health.mark_dead(slot, generation, error)
        self._on_dead(slot, generation)
        await self._publish(before)

    async def revive(self, slot: int) -> None:
        """Operator: give a retired (crash-looping) slot a fresh replacement budget."""
        self.health.revive(slot)
