"""Engine health as a pure state machine: no Ray, no I/O, an injectable clock.

The fleet actor (:mod:`rollout_service.fleet.fleet`; its probes in :mod:`rollout_service.fleet.monitor`)
does the I/O — probing engines, killing and starting actors, loading weights — and reports what
happened here; this module only decides what that means: which engines serve, which must be
replaced and when, which are stale, which slot is crash-looping. Every transition is therefore
testable without Ray, a network or an engine, and tests never sleep (they advance the clock).

Per slot (one slot per engine: one GPU / TP group), the states are::

    STARTING ──loaded──▶ HEALTHY ◀──probe ok── SUSPECT
        │                  │  ▲                  │
        │     probe failed │  └──────────────────┘
        │                  ▼            failures ≥ dead_after / silent ≥ unresponsive_after / fatal
        └──failed──▶     DEAD ◀─────────────────────────────────────────────────────────────┘
                          │ backoff elapsed, budget left           budget exhausted
                          ▼                                        ──────────────▶ RETIRED
                       REPLACING ──loaded (current version)──▶ HEALTHY
                          │   └──loaded (older version, or a refit is running)──▶ STALE ──reloaded──▶ HEALTHY
                          └──failed / start timeout──▶ DEAD (longer backoff)

Why these states (after NeMo RL's fleet_health, in our own terms):

- SUSPECT still serves: one slow probe on a busy 2-core box must not drain an engine.
- DEAD never goes back to HEALTHY by answering a probe: a process that was hung (SIGSTOP) and
  comes back holds whatever weights it had and may have lost requests. It is killed and replaced.
- STALE: a replacement is up but on an older weight version (a refit finished while it loaded, or
  it was loaded while a refit was running). It does not serve until it holds the current version,
  so two engines never serve different versions after a refit reported success.
- RETIRED: more than ``max_replacements`` replacements in ``replacement_window_s`` is a crash
  loop: it is reported (stats, logs), not spun. ``revive`` is the operator's way back.

The *epoch* goes up whenever the serving set changes (an engine joins or leaves it), so routers
and the weight-sync path reconcile with one integer comparison.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from enum import Enum
from typing import Callable



VERSION_HISTORY = 256  # committed versions a fleet remembers in order (FleetView.versions)

class EngineState(str, Enum):
    STARTING = "starting"  # first start of the slot's engine: loading, not serving
    HEALTHY = "healthy"  # serving
    SUSPECT = "suspect"  # serving; recent probes failed
    DEAD = "dead"  # not serving; waiting (backoff) for a replacement
    REPLACING = "replacing"  # a replacement is starting / loading the current weights
    STALE = "stale"  # loaded and answering, but not on the current weight version: not serving
    RETIRED = "retired"  # replacement budget exhausted (crash loop): reported, not retried
    DRAINING = "draining"  # retired on purpose (new engine config): finishing its calls, then stopped


SERVING = frozenset({EngineState.HEALTHY, EngineState.SUSPECT})


@dataclass(frozen=True)
class HealthPolicy:
    """Thresholds, each the fleet config's field of the same name (``fleet.*``, where they are
    documented with their defaults): built from it by ``fleet.fleet.health_policy``."""

    probe_interval_s: float  # the fleet probes every engine this often
    probe_timeout_s: float  # a probe that has not answered by then counts as failed
    dead_after_failures: int  # consecutive failed probes -> dead
    unresponsive_after_s: float  # no successful probe for this long -> dead (hung engine)
    start_timeout_s: float  # a (re)start that has not loaded by then has failed
    backoff_initial_s: float  # wait before the first replacement of a slot ...
    backoff_max_s: float  # ... doubling per failed replacement, up to this
    max_replacements: int  # more than this many replacements ...
    replacement_window_s: float  # ... within this window -> RETIRED

    def __post_init__(self):
        if self.dead_after_failures < 1 or self.max_replacements < 0:
            raise ValueError("dead_after_failures must be >= 1 and max_replacements >= 0")


@dataclass
class SlotHealth:
    slot: int
    state: EngineState = EngineState.STARTING
    generation: int = 0  # bumped for every engine actor started in this slot
    since: float = 0.0  # when the slot entered its state
    last_ok: float = 0.0  # last successful probe (or load)
    consecutive_failures: int = 0
    weight_version: str | None = None  # version the slot's engine holds, once loaded
    last_error: str | None = None
    next_replace_at: float = 0.0
    failed_replacements: int = 0  # consecutive; sets the backoff
    replacements: deque = field(default_factory=deque)  # start times of recent replacements
    total_replacements: int = 0

    def to_dict(self) -> dict:
        return {
            "slot": self.slot, "state": self.state.value, "generation": self.generation,
            "weight_version": self.weight_version, "consecutive_failures": self.consecutive_failures,
            "last_error": self.last_error, "replacements": self.total_replacements,
        }


class FleetHealth:
    """The health of every slot of the fleet, driven by events the fleet's I/O reports.

    Events carry the slot's ``generation`` so a late answer from an engine that was already
    replaced (or a probe that started before the kill) is ignored rather than misapplied.
    """

    def __init__(self, num_slots: int, policy: HealthPolicy, *,
                 current_version: str = "0", clock: Callable[[], float] = time.monotonic):
        self.policy = policy
        self.clock = clock
        self.current_version = current_version
        # The versions committed, oldest first, the current one last (at most VERSION_HISTORY): how
        # many refits one version is behind another (the data plane's staleness bound).
        self.versions: list[str] = [current_version]
        self.refitting = False
        self.retiring = False  # set by drain(): the fleet stops every engine next
        self.epoch = 0
        now = clock()
        self.slots = [SlotHealth(i, since=now, last_ok=now) for i in range(num_slots)]

    # ------------------------------------------------------------------ queries
    def serving(self) -> list[int]:
        return [s.slot for s in self.slots if s.state in SERVING]

    def in_state(self, *states: EngineState) -> list[int]:
        return [s.slot for s in self.slots if s.state in states]

    def due_replacements(self) -> list[int]:
        """DEAD slots whose backoff has elapsed: the caller kills the old actor and starts a new one."""
        now = self.clock()
        return [s.slot for s in self.slots if s.state is EngineState.DEAD and now >= s.next_replace_at]

    def stale(self) -> list[int]:
        """Loaded slots that need the current weights before they may serve (not while a refit runs)."""
        return [] if self.refitting else self.in_state(EngineState.STALE)

    def is_current(self, slot: int, generation: int) -> bool:
        return self.slots[slot].generation == generation

    # ------------------------------------------------------------------ events
    def on_loaded(self, slot: int, generation: int, version: str) -> EngineState:
        """The slot's engine is started and holds ``version``: serve it if that is the current
        version and no refit runs; otherwise it is STALE until reloaded."""
        s = self.slots[slot]
        if s.generation != generation or s.state not in (EngineState.STARTING, EngineState.REPLACING, EngineState.STALE):
            return s.state
        s.weight_version = version
        s.last_ok = self.clock()
        s.consecutive_failures = 0
        s.failed_replacements = 0
        if version == self.current_version and not self.refitting:
            self._enter(s, EngineState.HEALTHY)
        else:
            self._enter(s, EngineState.STALE)
        return s.state

    def on_adopted(self, slot: int, generation: int, version: str) -> EngineState:
        """A restarted fleet found the slot's engine alive (generation ``generation``, holding
        ``version``): it serves if that is the current version, else it is STALE until reloaded."""
        s = self.slots[slot]
        s.generation = generation
        s.weight_version = version
        s.last_ok = self.clock()
        s.consecutive_failures = 0
        self._enter(s, EngineState.HEALTHY if version == self.current_version else EngineState.STALE)
        return s.state

    def on_probe_ok(self, slot: int, generation: int) -> EngineState:
        s = self.slots[slot]
        if s.generation != generation:
            return s.state
        s.last_ok = self.clock()
        s.consecutive_failures = 0
        if s.state is EngineState.SUSPECT:
            self._enter(s, EngineState.HEALTHY)
        return s.state

    def on_probe_failed(self, slot: int, generation: int, error: str, *, fatal: bool = False) -> EngineState:
        """A probe failed or timed out. ``fatal``: the actor is known dead (Ray said so)."""
        s = self.slots[slot]
        if s.generation != generation or s.state in (EngineState.DEAD, EngineState.RETIRED):
            return s.state
        s.last_error = error
        if s.state in (EngineState.STARTING, EngineState.REPLACING):
            if fatal:
                self._failed_start(s, error)
            return s.state
        s.consecutive_failures += 1
        if fatal or s.consecutive_failures >= self.policy.dead_after_failures:
            self._die(s, error)
        elif s.state is EngineState.HEALTHY:
            self._enter(s, EngineState.SUSPECT)
        return s.state

    def on_start_failed(self, slot: int, generation: int, error: str) -> EngineState:
        s = self.slots[slot]
        if s.generation == generation and s.state in (EngineState.STARTING, EngineState.REPLACING, EngineState.STALE):
            s.last_error = error
            self._failed_start(s, error)
        return s.state

    def on_replacement_started(self, slot: int) -> int:
        """DEAD -> REPLACING; returns the new generation the caller tags the new actor with."""
        s = self.slots[slot]
        if s.state is not EngineState.DEAD:
            raise ValueError(f"slot {slot} is {s.state.value}, not dead")
        now = self.clock()
        s.generation += 1
        s.weight_version = None
        s.consecutive_failures = 0
        s.replacements.append(now)
        s.total_replacements += 1
        self._enter(s, EngineState.REPLACING)
        return s.generation

    def tick(self) -> list[int]:
        """Time-based transitions: silent serving engines die (hung), slow starts fail.
        Returns the slots that changed state."""
        now = self.clock()
        changed = []
        for s in self.slots:
            if s.state in SERVING and now - s.last_ok >= self.policy.unresponsive_after_s:
                self._die(s, f"no successful probe for {now - s.last_ok:.1f}s (hung)")
                changed.append(s.slot)
            elif s.state in (EngineState.STARTING, EngineState.REPLACING) and now - s.since >= self.policy.start_timeout_s:
                self._failed_start(s, f"not loaded after {now - s.since:.0f}s")
                changed.append(s.slot)
        return changed

    def mark_dead(self, slot: int, generation: int, error: str) -> EngineState:
        """The caller found the engine unusable (e.g. a refit left it half-loaded): replace it."""
        s = self.slots[slot]
        if s.generation == generation and s.state not in (EngineState.DEAD, EngineState.RETIRED):
            if s.state in (EngineState.STARTING, EngineState.REPLACING):
                self._failed_start(s, error)
            else:
                self._die(s, error)
        return s.state

    def drain(self) -> list[int]:
        """Every serving engine leaves the serving set to finish its calls (the fleet stops them next);
        from now on no engine enters it (a load that completes, a refit that ends)."""
        self.retiring = True
        slots = [s for s in self.slots if s.state in SERVING]
        for s in slots:
            self._enter(s, EngineState.DRAINING)
        return [s.slot for s in slots]

    def revive(self, slot: int) -> None:
        """Operator action: give a RETIRED slot a fresh replacement budget."""
        s = self.slots[slot]
        if s.state is EngineState.RETIRED:
            s.replacements.clear()
            s.failed_replacements = 0
            s.next_replace_at = self.clock()
            self._enter(s, EngineState.DEAD)

    # --------------------------------------------------------------- weight versions
    def begin_refit(self) -> list[int]:
        """A refit starts over the serving slots (returned); nothing joins until it ends."""
        self.refitting = True
        return self.serving()

    def end_refit(self, version: str | None) -> None:
        """``version``: the new current version (refit committed), or None (nothing changed).
        Members of the refit now hold it; STALE slots on the current version join."""
        self.refitting = False
        if version is not None and version != self.current_version:
            self.current_version = version
            self.note_version(version)
            for s in self.slots:
                if s.state in SERVING:
                    s.weight_version = version
        for s in self.slots:
            if s.state is EngineState.STALE and s.weight_version == self.current_version:
                self._enter(s, EngineState.HEALTHY)

    def note_version(self, version: str) -> None:
        """``version`` is the newest committed one (a label served again counts from now)."""
        if version in self.versions:
            self.versions.remove(version)
        self.versions.append(version)
        del self.versions[:-VERSION_HISTORY]

    # ------------------------------------------------------------------ internals
    def _enter(self, s: SlotHealth, state: EngineState) -> None:
        if self.retiring and state in SERVING:
            return  # the fleet is stopping these engines: none serves again
        was_serving = s.state in SERVING
        s.state = state
        s.since = self.clock()
        if was_serving != (state in SERVING):
            self.epoch += 1

    def _die(self, s: SlotHealth, error: str) -> None:
        s.last_error = error
        self._enter(s, EngineState.DEAD)
        self._schedule_replacement(s)

    def _failed_start(self, s: SlotHealth, error: str) -> None:
        s.failed_replacements += 1
        s.last_error = error
        self._enter(s, EngineState.DEAD)
        self._schedule_replacement(s)

    def _schedule_replacement(self, s: SlotHealth) -> None:
        now = self.clock()
        window = self.policy.replacement_window_s
        while s.replacements and now - s.replacements[0] > window:
            s.replacements.popleft()
        if len(s.replacements) >= self.policy.max_replacements:
            s.last_error = (f"crash loop: {len(s.replacements)} replacements in {window:.0f}s; "
                            f"last error: {s.last_error}")
            self._enter(s, EngineState.RETIRED)
            return
        # An engine that died while serving is replaced at once; a replacement that itself failed
        # waits backoff_initial_s, doubling per consecutive failure.
        n = s.failed_replacements
        backoff = 0.0 if n == 0 else min(self.policy.backoff_max_s, self.policy.backoff_initial_s * 2 ** (n - 1))
        s.next_replace_at = now + backoff

    def snapshot(self) -> list[dict]:
        return [s.to_dict() for s in self.slots]

