"""How a fleet actor takes over from its predecessor: a mixin of
:class:`~rollout_service.fleet.fleet.EngineFleet`, whose slots, health, weights and config it uses.

A named fleet names its engines (``<fleet>-engine-<slot>-g<generation>``) and their placement
groups (``<fleet>-placement-<slot>``) and makes them detached, so they outlive the fleet actor.
A new incarnation — restarted by Ray, or created again after the fleet was killed for good —
adopts the live ones before answering anything (docs/reliability.md, "The control plane heals").
What the engines cannot tell it (the committed version, the Serve apps, an open refit bracket) it
reads from the fleet's durable record (:mod:`rollout_service.fleet.ledger`), which every incarnation
keeps up to date (``_persist``, :mod:`rollout_service.fleet.refit_bracket`).
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
    async def _adopt_inherited_engines(self) -> None:
        """Adopt the engines of a previous incarnation (restarted by Ray, or killed and created
        again) before answering anything (once; a first fleet finds none)."""
        if self._adopted:
            return
        async with self._start_lock:
            if not self._adopted:
                await self._adopt()  # raises: the next call tries again (never a second set of engines)
                self._adopted = True

    async def _adopt_inherited_engines_soon(self) -> None:
        """A restarted incarnation adopts at once (the Serve apps it served may be gone, so no call
        need ever come), retrying with a growing pause while that fails; calls run it too."""
        pause = 0.5
        while not self._adopted:
            try:
                await self._adopt_inherited_engines()
            except Exception as exc:
                logger.warning("fleet restarted: adoption failed, retrying in %.1fs: %s", pause, short_error(exc))
                await asyncio.sleep(pause)
                pause = min(pause * 2, 30.0)

    async def _adopt(self) -> None:
        """Take over the live engines of the previous incarnation, found by name: their slot,
        generation, processes, data channel, config and weight version. The current version is the
        one the durable record says was last committed (engine labels alone cannot tell a committed
        version from one a refit labelled but never committed); without a record, the one most
        engines are labelled with. Engines on another version are STALE (not serving; brought back by
        the restarted refit controller's recovery or reloaded by the monitor); slots without a live
        engine start one. A refit bracket the record says is open is kept until it ends or its lease
        runs out; the Serve apps it names are watched again. The epoch jumps, so every router takes
        the new view at once."""
        from rollout_service.fleet.placement import adopt_engine_placement

        t0 = time.perf_counter()
        found = _named_engines(self._name)
        if not found and not self._reconstructed:
            return  # a first fleet
        record = await self.ledger.read()
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
        labels = Counter(a[4]["weight_version"] for a in adopted.values())
        bracket = (record or {}).get("refit")
        lease_left = 0.0
        if bracket:
            until = bracket.get("lease_until")
            lease_left = float("inf") if until is None else until - time.time()
        open_bracket = bool(bracket and adopted and lease_left > 0)
        current, path, self._version_source = _current_version(record, labels, open_bracket,
                                                                self.config.engine.resolved_model())
        self.health.current_version = current
        self.health.versions = [v for v in (record or {}).get("versions") or [] if isinstance(v, str)]
        self.health.note_version(current)
        self.weights = WeightsRecord(version=current, path=path)
        if record:
            self._last_refit, self._refits = record.get("last_refit"), record.get("refits") or self._refits
            self._apps |= set(record.get("apps") or [])
        if open_bracket:  # the refit goes on (or its controller's recovery ends it)
            self.health.begin_refit()
            self._refit_deadline = time.monotonic() + lease_left
            self._refit_members = [(int(slot), int(gen)) for slot, gen in bracket.get("members") or []]
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
            if (not self.health.refitting and self.weights.path is None and self.config.fleet.keep_weights_copy):
                self._start_export()  # the kept copy was owned by the dead incarnation
        self._watch_apps_started()
        logger.warning("fleet restarted (incarnation %s): adopted %d engine(s) of %d in %.2fs, serving version %s "
                       "(from the %s)%s", self.incarnation, len(adopted), len(self.slots), time.perf_counter() - t0,
                       self.health.current_version, self._version_source,
                       "; a refit bracket is open" if self.health.refitting else "")
        await self._persist()
        await self._publish(-1)


def _current_version(record: dict | None, labels: Counter, open_bracket: bool,
                     model_path: str) -> tuple[str, str | None, str]:
    """(version, checkpoint path, where it came from) for a restarted fleet. The record wins when its
    weights can still be had: the base model, a checkpoint, an engine labelled with it, or engines
    in a refit whose bracket is still open (its controller, or a restarted one, ends it and rolls
    them back to it). Otherwise a version whose weights died with every engine that held them is
    not claimed: the labels (or the base model) are."""
    if record and record.get("version"):
        version, path = str(record["version"]), record.get("path")
        if version == BASE_VERSION or path or (labels and (open_bracket or labels.get(version))):
            return version, path or (model_path if version == BASE_VERSION else None), "ledger"
        logger.error("the committed version %s is held by no live engine and no checkpoint: it is lost; serving %s "
                     "until the next refit", version, labels.most_common(1)[0][0] if labels else BASE_VERSION)
    if labels:
        version = labels.most_common(1)[0][0]
        return version, model_path if version == BASE_VERSION else None, "labels"
    return BASE_VERSION, model_path, "base model"


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
