"""The data plane's routing over the fleet's serving set (FleetClient): pins, least loaded across
the fleet, moving a pin off a lost engine, avoiding an engine seen failing. Pure (no Ray): the
routing decisions only read the FleetView; the fault tests run it against real engines."""

from __future__ import annotations

import pickle

import pytest

from rollout_service.fleet.client import FleetClient
from rollout_service.fleet.types import FleetView, Member, NoEngineAvailable


class FakeFleet:
    def __init__(self):
        self.reports = []

    @property
    def report_failure(self):
        outer = self

        class Remote:
            @staticmethod
            def remote(*args):
                outer.reports.append(args)

        return Remote


def view(epoch, *members):
    return FleetView(epoch, "v", tuple(members))


def test_new_rollouts_go_to_the_least_loaded_engine_across_the_fleet_and_stay_pinned():
    client = FleetClient(FakeFleet(), view(1, Member(0, 0, "e0", load=5), Member(1, 0, "e1", load=1)))
    first = client.pick("a")
    assert first.slot == 1
    client.acquire(first)
    for _ in range(5):
        client.acquire(client.pick(None))  # stateless calls take load too
    assert client.pick("a").slot == 1  # pinned, whatever the load now
    assert client.pick("b").slot == 0  # 5 (fleet) vs 1 + 6 (this process's calls since)


def test_a_pin_to_an_engine_that_left_the_serving_set_moves_to_a_live_one():
    client = FleetClient(FakeFleet(), view(1, Member(0, 0, "e0"), Member(1, 0, "e1")))
    client.pins["a"] = (1, 0)
    client._set_view(view(2, Member(0, 0, "e0")))
    assert client.pick("a").slot == 0 and client.pins["a"] == (0, 0)
    # The replacement (same slot, new generation) joins: the moved pin stays, new rollouts use it.
    client.acquire(client.pick("a"))
    client._set_view(view(3, Member(0, 0, "e0"), Member(1, 1, "e1'")))
    assert client.pick("a").key == (0, 0)
    assert client.pick("b").key == (1, 1)


def test_an_engine_seen_failing_is_avoided_here_and_reported_to_the_fleet():
    fleet = FakeFleet()
    client = FleetClient(fleet, view(1, Member(0, 0, "e0"), Member(1, 0, "e1")))
    client.report_lost(Member(1, 0, "e1"), RuntimeError("boom"))
    assert fleet.reports and fleet.reports[0][:2] == (1, 0) and fleet.reports[0][3] is False
    assert [m.slot for m in client.members()] == [0]
    client.lost[(1, 0)] -= client.avoid_lost_s  # time passes; the fleet's view still lists it
    client._set_view(view(1, Member(0, 0, "e0"), Member(1, 0, "e1")))
    assert [m.slot for m in client.members()] == [0, 1]  # it was only unreachable for a moment


def test_no_serving_engine_is_a_clear_error():
    client = FleetClient(FakeFleet(), view(4))
    with pytest.raises(NoEngineAvailable):
        client.pick("a")


def test_the_client_is_pickle_safe_and_ships_its_view_not_its_local_state():
    client = FleetClient("fleet-handle", view(7, Member(0, 0, "e0")))
    client.pins["a"] = (0, 0)
    clone = pickle.loads(pickle.dumps(client))
    assert clone.view.epoch == 7 and clone.fleet == "fleet-handle" and not clone.pins
