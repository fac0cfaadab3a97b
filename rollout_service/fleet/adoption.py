"""How a fleet actor takes over from its predecessor: a mixin of
:class:`~rollout_service.fleet.fleet.EngineFleet`, whose slots, health, weights and config it uses.

A named fleet names its engines (``<fleet>-engine-<slot>-g<generation>``) and their placement
groups (``<fleet>-placement-<slot>``) and makes them detached, so they outlive the fleet actor.
A new incarnation — restarted by Ray, or created again after the fleet was killed for good —
adopts the live ones before answering anything (docs/reliability.md, "The control plane heals").
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections import Counter
from typing import Any

import ray

from rollout_service.fleet.current_weights import WeightsRecord, short_error
from rollout_service.fleet.types import BASE_VERSION, FLEET_NAMESPACE

logger = logging.getLogger(__name__)


class Adoption:
    async def _recover(self) -> None:
        """Adopt the engines of a previous incarnation (restarted by Ray, or killed and created
        again) before answering anything (once; a first fleet finds none)."""
        if self._adopted:
            return
        async with self._start_lock:
            if not self._adopted:
                await self._adopt()  # raises: the next call tries again (never a second set of engines)
                self._adopted = True

    async def _adopt(self) -> None:
        """Take over the live engines of the previous incarnation, found by name: their slot,
        generation, processes, data channel, config and weight version; the version most of them
        hold is the current one (a refit commits on every engine before the fleet hears of it, and a
        controller that died mid-refit rolls its engines back: rollout_service.refit.controller).
        Engines on another version are STALE (reloaded by the monitor); slots without a live engine
        start one. The epoch jumps, so every router takes the new view at once."""
        from rollout_service.fleet.placement import adopt_engine_placement

        t0 = time.perf_counter()
        found = _named_engines(self._name)
        if not found and not self._reconstructed:
            return  # a first fleet
        timeout = self.health.policy.probe_timeout_s
        adopted: dict[int, tuple[int, Any, dict, Any, dict]] = {}
        for slot, generations in found.items():
            if slot >= len(self.slots):
                for name in generations.values():
                    _kill_named(name)
                _remove_named_placement(placement_name(self._name, slot))
                continue
            newest = max(generations)
            for gen, name in generations.items():
                if gen != newest:
                    _kill_named(name)
            try:
                actor = ray.get_actor(generations[newest], namespace=FLEET_NAMESPACE)
                info = await asyncio.wait_for(actor.health.remote(), timeout)
                processes = await asyncio.wait_for(actor.process_info.remote(), timeout)
                engine_config = await asyncio.wait_for(actor.engine_config.remote(), timeout)
                channel = None
                if self.config.engine.data_channel == "tcp":
                    channel = await asyncio.wait_for(actor.open_channel.remote(), timeout)
            except Exception as exc:  # gone or hung: replaced like any dead engine
                logger.warning("engine %s not adopted: %s", generations[newest], short_error(exc))
                _kill_named(generations[newest])
                continue
            adopted[slot] = (newest, actor, processes, channel, {**info, "config": engine_config})
        if adopted:
            engine_config = next(iter(adopted.values()))[4]["config"]
            self.config = self.config.model_copy(update={"engine": type(self.config.engine).model_validate(engine_config)})
            self._reset_slots()
            versions = Counter(a[4]["weight_version"] for a in adopted.values())
            current = versions.most_common(1)[0][0]
            self.health.current_version = current
            self.weights = WeightsRecord(version=current,
                                         path=self.config.engine.resolved_model() if current == BASE_VERSION else None)
        self.health.epoch = int(time.time())  # distinct from every epoch of the previous incarnation
        for slot, (generation, actor, processes, channel, info) in adopted.items():
            s = self.slots[slot]
            s.generation, s.actor, s.processes, s.channel = generation, actor, processes, channel
            s.load = int(info.get("in_flight", 0))
            s.placement = adopt_engine_placement(self.config.engine, placement_name(self._name, slot))
            self.health.on_adopted(slot, generation, info["weight_version"])
            self.health.slots[slot].since = time.monotonic()
        self._adopted_count = len(adopted)
        self._dependents = _named_dependents(self._name)
        for i in range(len(self.slots)):
            if i not in adopted:  # a fresh engine there is named past every generation seen in the slot
                self.health.slots[i].generation = max(found.get(i, {-1: None})) + 1
                # its placement group (kept across replacements) is reused, not reserved twice by name
                self.slots[i].placement = adopt_engine_placement(self.config.engine, placement_name(self._name, i))
        if adopted:
            self._started = True
            self._startup_s = 0.0
            for i in range(len(self.slots)):
                if i not in adopted:
                    self._launch(i, self.health.slots[i].generation)
            self._monitor = asyncio.get_running_loop().create_task(self._monitor_loop())
        logger.warning("fleet restarted (incarnation %s): adopted %d engine(s) of %d in %.2fs, serving version %s",
                       self.incarnation, len(adopted), len(self.slots), time.perf_counter() - t0,
                       self.health.current_version)
        await self._publish(-1)


def engine_name(fleet: str | None, slot: int, generation: int) -> str | None:
    return f"{fleet}-engine-{slot}-g{generation}" if fleet else None


def placement_name(fleet: str | None, slot: int) -> str | None:
    return f"{fleet}-placement-{slot}" if fleet else None


def _named_engines(fleet: str | None) -> dict[int, dict[int, str]]:
    """Live engine actors named by ``fleet``: slot -> generation -> name."""
    if not fleet:
        return {}
    pattern = re.compile(re.escape(fleet) + r"-engine-(\d+)-g(\d+)$")
    out: dict[int, dict[int, str]] = {}
    for entry in ray.util.list_named_actors(all_namespaces=True):
        m = pattern.match(entry.get("name", "")) if entry.get("namespace") == FLEET_NAMESPACE else None
        if m:
            out.setdefault(int(m.group(1)), {})[int(m.group(2))] = entry["name"]
    return out


def _named_dependents(fleet: str | None) -> list[Any]:
    """The refit controller of this fleet's instance, if one runs (killed with the fleet)."""
    if not fleet or not fleet.endswith("-fleet"):
        return []
    try:
        return [ray.get_actor(fleet[: -len("-fleet")] + "-refit", namespace=FLEET_NAMESPACE)]
    except ValueError:
        return []


def _remove_named_placement(name: str | None) -> None:
    if not name:
        return
    try:
        from ray.util.placement_group import remove_placement_group

        remove_placement_group(ray.util.get_placement_group(name))
    except Exception:  # none by that name
        pass


def kill_named_engines(fleet: str) -> int:
    """Kill every engine actor named by ``fleet`` (an operator's or a launcher's last resort when the
    fleet itself could not stop them); returns how many were found."""
    names = [name for generations in _named_engines(fleet).values() for name in generations.values()]
    for name in names:
        _kill_named(name)
    return len(names)


def _kill_named(name: str) -> None:
    try:
        ray.kill(ray.get_actor(name, namespace=FLEET_NAMESPACE), no_restart=True)
    except Exception:
        pass
