"""Every transition of the fleet's health state machine, without Ray: a fake clock, no sleeping."""

from __future__ import annotations

import pytest

from rollout_service.fleet.health import EngineState as S
from rollout_service.fleet.health import FleetHealth, HealthPolicy


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t

    def advance(self, dt):
        self.t += dt


POLICY = HealthPolicy(probe_interval_s=1, probe_timeout_s=1, dead_after_failures=3, unresponsive_after_s=10,
                      start_timeout_s=60, backoff_initial_s=2, backoff_max_s=16, max_replacements=3,
                      replacement_window_s=100)


@pytest.fixture
def clock():
    return Clock()


def fleet(clock, n=2, **policy):
    h = FleetHealth(n, HealthPolicy(**{**POLICY.__dict__, **policy}), clock=clock)
    for i in range(n):
        assert h.on_loaded(i, 0, "0") is S.HEALTHY
    return h


def test_slots_start_not_serving_and_join_when_loaded(clock):
    h = FleetHealth(2, POLICY, clock=clock)
    assert [s.state for s in h.slots] == [S.STARTING, S.STARTING] and h.serving() == [] and h.epoch == 0
    h.on_loaded(0, 0, "0")
    assert h.serving() == [0] and h.epoch == 1
    h.on_loaded(1, 0, "0")
    assert h.serving() == [0, 1] and h.epoch == 2


def test_one_failed_probe_makes_suspect_but_still_serving(clock):
    h = fleet(clock)
    epoch = h.epoch
    assert h.on_probe_failed(0, 0, "timeout") is S.SUSPECT
    assert h.serving() == [0, 1] and h.epoch == epoch  # one slow probe must not drain an engine
    assert h.on_probe_ok(0, 0) is S.HEALTHY and h.slots[0].consecutive_failures == 0


def test_consecutive_failures_declare_dead_and_leave_the_serving_set(clock):
    h = fleet(clock)
    epoch = h.epoch
    h.on_probe_failed(1, 0, "timeout")
    h.on_probe_failed(1, 0, "timeout")
    assert h.on_probe_failed(1, 0, "timeout") is S.DEAD
    assert h.serving() == [0] and h.epoch == epoch + 1 and h.slots[1].last_error == "timeout"


def test_fatal_failure_is_dead_at_once(clock):
    h = fleet(clock)
    assert h.on_probe_failed(0, 0, "ActorDiedError", fatal=True) is S.DEAD
    assert h.due_replacements() == [0]  # an engine that died while serving is replaced at once


def test_a_silent_engine_is_declared_hung_after_unresponsive_after_s(clock):
    h = fleet(clock)
    clock.advance(9)
    h.on_probe_ok(0, 0)
    assert h.tick() == [] and h.serving() == [0, 1]
    clock.advance(1)  # slot 1: 10 s without a successful probe
    assert h.tick() == [1] and h.slots[1].state is S.DEAD and "hung" in h.slots[1].last_error
    assert h.slots[0].state is S.HEALTHY


def test_dead_never_returns_to_healthy_by_answering_a_probe(clock):
    h = fleet(clock)
    h.on_probe_failed(0, 0, "gone", fatal=True)
    assert h.on_probe_ok(0, 0) is S.DEAD  # a SIGCONTed hung process is not reused
    assert h.on_loaded(0, 0, "0") is S.DEAD


def test_replacement_gets_a_new_generation_and_late_events_of_the_old_one_are_ignored(clock):
    h = fleet(clock)
    h.on_probe_failed(0, 0, "gone", fatal=True)
    gen = h.on_replacement_started(0)
    assert gen == 1 and h.slots[0].state is S.REPLACING and h.serving() == [1]
    assert h.on_probe_failed(0, 0, "late failure of the old actor", fatal=True) is S.REPLACING
    assert h.on_loaded(0, 0, "0") is S.REPLACING  # the old generation's load does not count
    assert h.on_loaded(0, gen, "0") is S.HEALTHY and h.serving() == [0, 1]


def test_replacement_start_must_come_from_dead(clock):
    h = fleet(clock)
    with pytest.raises(ValueError):
        h.on_replacement_started(0)


def test_failed_replacements_back_off_exponentially_up_to_the_cap(clock):
    h = fleet(clock, max_replacements=10, replacement_window_s=1000)
    h.on_probe_failed(0, 0, "gone", fatal=True)
    waits = []
    for _ in range(5):
        gen = h.on_replacement_started(0)
        h.on_start_failed(0, gen, "OOM while loading")
        waits.append(h.slots[0].next_replace_at - clock())
        assert h.due_replacements() == []
        clock.advance(waits[-1])
        assert h.due_replacements() == [0]
    assert waits == [2, 4, 8, 16, 16]


def test_a_successful_load_resets_the_backoff(clock):
    h = fleet(clock, max_replacements=10, replacement_window_s=1000)
    h.on_probe_failed(0, 0, "gone", fatal=True)
    gen = h.on_replacement_started(0)
    h.on_start_failed(0, gen, "x")
    clock.advance(2)
    gen = h.on_replacement_started(0)
    h.on_loaded(0, gen, "0")
    h.on_probe_failed(0, gen, "gone", fatal=True)
    assert h.due_replacements() == [0]


def test_crash_loop_retires_the_slot_instead_of_spinning(clock):
    h = fleet(clock)  # max 3 replacements per 100 s
    for _ in range(3):
        h.on_probe_failed(0, h.slots[0].generation, "segfault", fatal=True)
        assert h.slots[0].state is S.DEAD
        clock.advance(h.slots[0].next_replace_at - clock())
        gen = h.on_replacement_started(0)
        h.on_loaded(0, gen, "0")
        clock.advance(5)
    assert h.on_probe_failed(0, h.slots[0].generation, "segfault", fatal=True) is S.RETIRED
    assert h.due_replacements() == [] and "crash loop" in h.slots[0].last_error
    assert h.serving() == [1]
    h.revive(0)  # operator action
    assert h.slots[0].state is S.DEAD and h.due_replacements() == [0]


def test_replacements_older_than_the_window_do_not_count(clock):
    h = fleet(clock)
    for _ in range(6):
        h.on_probe_failed(0, h.slots[0].generation, "rare crash", fatal=True)
        gen = h.on_replacement_started(0)
        h.on_loaded(0, gen, "0")
        clock.advance(60)  # one death a minute: 2 in any 100 s window
    assert h.slots[0].state is S.HEALTHY and h.slots[0].total_replacements == 6


def test_a_start_that_never_loads_times_out(clock):
    h = FleetHealth(1, POLICY, clock=clock)
    clock.advance(59)
    assert h.tick() == []
    clock.advance(1)
    assert h.tick() == [0] and h.slots[0].state is S.DEAD and "not loaded" in h.slots[0].last_error


def test_a_fatal_probe_during_start_fails_the_start(clock):
    h = FleetHealth(1, POLICY, clock=clock)
    assert h.on_probe_failed(0, 0, "timeout") is S.STARTING  # a loading engine may be slow to answer
    assert h.on_probe_failed(0, 0, "ActorDiedError", fatal=True) is S.DEAD


def test_a_replacement_on_an_old_version_is_stale_and_does_not_serve(clock):
    h = fleet(clock)
    h.begin_refit()
    h.end_refit("1")
    assert all(s.weight_version == "1" for s in h.slots)
    h.on_probe_failed(1, 0, "gone", fatal=True)
    gen = h.on_replacement_started(1)
    assert h.on_loaded(1, gen, "0") is S.STALE and h.serving() == [0] and h.stale() == [1]
    assert h.on_loaded(1, gen, "1") is S.HEALTHY and h.serving() == [0, 1]


def test_nothing_joins_during_a_refit(clock):
    h = fleet(clock)
    h.on_probe_failed(1, 0, "gone", fatal=True)
    gen = h.on_replacement_started(1)
    assert h.begin_refit() == [0]
    assert h.on_loaded(1, gen, "0") is S.STALE  # loaded the old version while the refit runs
    assert h.stale() == []  # no reload while the refit runs
    h.end_refit("1")  # the refit committed: the replacement must load "1" before it serves
    assert h.slots[1].state is S.STALE and h.stale() == [1] and h.serving() == [0]


def test_a_failed_refit_lets_a_replacement_on_the_current_version_join(clock):
    h = fleet(clock)
    h.on_probe_failed(1, 0, "gone", fatal=True)
    gen = h.on_replacement_started(1)
    h.begin_refit()
    h.on_loaded(1, gen, "0")
    epoch = h.epoch
    h.end_refit(None)
    assert h.slots[1].state is S.HEALTHY and h.serving() == [0, 1] and h.epoch == epoch + 1


def test_stale_reload_failure_goes_back_to_dead(clock):
    h = fleet(clock)
    h.begin_refit()
    h.end_refit("1")
    h.on_probe_failed(0, 0, "gone", fatal=True)
    gen = h.on_replacement_started(0)
    h.on_loaded(0, gen, "0")
    assert h.on_start_failed(0, gen, "no source for version 1") is S.DEAD


def test_mark_dead_from_the_control_plane(clock):
    h = fleet(clock)
    assert h.mark_dead(0, 0, "rollback failed") is S.DEAD and h.serving() == [1]
    assert h.mark_dead(0, 0, "again") is S.DEAD  # idempotent


def test_epoch_changes_only_when_the_serving_set_changes(clock):
    h = fleet(clock)
    e = h.epoch
    h.on_probe_failed(0, 0, "slow")  # suspect: still serving
    h.on_probe_ok(0, 0)
    h.begin_refit()
    h.end_refit("1")
    assert h.epoch == e
    h.on_probe_failed(0, 0, "gone", fatal=True)
    assert h.epoch == e + 1


def test_an_adopted_engine_serves_on_the_current_version_and_is_stale_on_another(clock):
    """A restarted fleet takes over live engines with their generations (Adoption._adopt)."""
    h = FleetHealth(3, POLICY, clock=clock, current_version="v7")
    assert h.on_adopted(0, 4, "v7") is S.HEALTHY and h.slots[0].generation == 4
    assert h.on_adopted(1, 0, "v6") is S.STALE
    assert h.serving() == [0] and h.slots[2].state is S.STARTING
    assert h.on_probe_ok(0, 3) is S.HEALTHY and h.slots[0].generation == 4  # an older generation's answer: ignored
    clock.advance(20)
    assert h.on_probe_failed(0, 4, "x", fatal=True) is S.DEAD  # and it is replaced like any engine
    assert h.on_replacement_started(0) == 5


def test_a_drain_takes_every_engine_out_and_nothing_joins_the_serving_set_after_it(clock):
    """A restart on a new engine config: the serving engines drain; a replacement that finishes
    loading, or a stale engine a refit would have caught up, does not join (the fleet stops them all)."""
    h = FleetHealth(3, POLICY, clock=clock)
    h.on_loaded(0, 0, "0")
    h.on_loaded(1, 0, "0")
    epoch = h.epoch
    assert h.drain() == [0, 1] and h.serving() == [] and h.epoch > epoch
    assert [s.state for s in h.slots[:2]] == [S.DRAINING, S.DRAINING]
    assert h.on_loaded(2, 0, "0") is not S.HEALTHY and h.serving() == []  # a start that completes now
    h.begin_refit()
    h.end_refit("1")
    assert h.current_version == "1" and h.serving() == []  # the committed version is kept, nothing joins
    assert h.on_probe_ok(0, 0) is S.DRAINING
