"""The data plane's routing over the fleet's serving set (FleetClient and routing.policy): pins,
least loaded across the fleet, the sticky_least_loaded margin and its pin moves, the automatic
least-loaded choice without prefix caching, moving a pin off a lost engine, avoiding an engine seen
failing. Pure (no Ray): the routing decisions only read the FleetView; the fault tests run it
against real engines."""

from __future__ import annotations

import pickle

import pytest

from rollout_service.fleet.client import FleetClient
from rollout_service.fleet.routing import LeastLoaded, Sticky, StickyLeastLoaded, effective_policy, make_policy
from rollout_service.fleet.types import FleetView, Member, NoEngineAvailable


class FakeFleet:
    def __init__(self):
        self.reports = []
        self.pin_moves = 0

    @property
    def count_pin_move(self):
        outer = self

        class Remote:
            @staticmethod
            def remote():
                outer.pin_moves += 1

        return Remote

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


def _loaded(client, member, n):
    for _ in range(n):
        client.acquire(member)


def test_sticky_least_loaded_keeps_a_pin_within_the_margin_and_moves_it_past():
    e0, e1 = Member(0, 0, "e0", load=0), Member(1, 0, "e1", load=0)
    client = FleetClient(FakeFleet(), view(1, e0, e1), policy=StickyLeastLoaded(margin=3))
    assert client.route("a").member.slot == 0
    _loaded(client, e0, 3)  # 3 above the least loaded: within the margin
    assert client.route("a") .member.slot == 0 and not client.route("a").moved
    _loaded(client, e0, 1)  # 4 above: past it
    moved = client.route("a")
    assert (moved.member.slot, moved.moved) == (1, True) and client.pins["a"] == (1, 0)
    assert client.pin_moves == 1
    assert client.route("a").member.slot == 1 and not client.route("a").moved  # pinned where it moved
    # The fleet's figure counts as this process's own calls do (the same in every replica).
    client._set_view(view(2, Member(0, 0, "e0", load=0), Member(1, 0, "e1", load=20)))
    client.outstanding.clear()
    assert client.route("a").member.slot == 0 and client.pin_moves == 2


def test_sticky_never_moves_a_pin_off_a_live_engine_and_least_loaded_keeps_none():
    e0, e1 = Member(0, 0, "e0"), Member(1, 0, "e1")
    sticky = FleetClient(FakeFleet(), view(1, e0, e1), policy=Sticky())
    assert sticky.route("a").member.slot == 0
    _loaded(sticky, e0, 100)
    assert sticky.route("a").member.slot == 0 and sticky.pin_moves == 0
    free = FleetClient(FakeFleet(), view(1, e0, e1), policy=LeastLoaded())
    assert free.route("a").member.slot == 0
    _loaded(free, e0, 1)
    assert free.route("a").member.slot == 1 and not free.pins and free.pin_moves == 0


def test_without_prefix_caching_the_default_routes_as_least_loaded():
    assert isinstance(make_policy("sticky_least_loaded", load_margin=4, prefix_caching=False), LeastLoaded)
    assert effective_policy("sticky_least_loaded", False) == "least_loaded"
    cached = make_policy("sticky_least_loaded", load_margin=4, prefix_caching=True)
    assert isinstance(cached, StickyLeastLoaded) and cached.margin == 4
    assert isinstance(make_policy("sticky", load_margin=4, prefix_caching=False), Sticky)  # asked for: kept
    with pytest.raises(ValueError, match="routing.policy"):
        make_policy("round_robin", load_margin=4, prefix_caching=True)


async def test_a_moved_pin_is_named_on_the_route_the_call_took_and_reported_to_the_fleet():
    """generate_with_failover hands the route of each attempt to its caller (the turn records it)."""
    from rollout_service.engine.sampling import SamplingOptions
    from rollout_service.engine.types import GenerateRequest, GenerationChunk

    e0, e1 = Member(0, 0, "e0"), Member(1, 0, "e1")
    fleet = FakeFleet()
    client = FleetClient(fleet, view(1, e0, e1), policy=StickyLeastLoaded(margin=0))
    client.pins["a"] = (0, 0)
    client.acquire(e0)

    async def one_chunk(member, request, stream):
        yield GenerationChunk(token_ids=[1], logprobs=[-0.1], finish_reason="length", engine_index=member.slot)

    client.generate = one_chunk
    routed = []
    request = GenerateRequest(prompt_ids=[1, 2], sampling=SamplingOptions(), max_tokens=1)
    chunks = [c async for c in client.generate_with_failover("a", request, False, routed=routed)]
    assert chunks[0].engine_index == 1 and [(r.member.slot, r.moved) for r in routed] == [(1, True)]
    client.report_pin_move()
    assert fleet.pin_moves == 1


async def test_a_failing_fleet_is_reported_a_restarted_one_reattaches_and_a_dead_one_is_resolved_again():
    """What /health and the app's re-attachment read: the last refresh's error, the new
    incarnation's callbacks, and ``resolve`` for a fleet actor dead for good."""
    import asyncio

    import ray.exceptions as rex

    class Fleet:
        def __init__(self, answers):
            self.answers = answers

        @property
        def view(self):
            outer = self

            class Remote:
                @staticmethod
                async def remote(*args):
                    await asyncio.sleep(0.005)  # a long poll waits
                    answer = outer.answers.pop(0) if len(outer.answers) > 1 else outer.answers[0]  # the last repeats
                    if isinstance(answer, BaseException):
                        raise answer
                    return answer

            return Remote

    dead = rex.ActorDiedError()
    first = Fleet([FleetView(1, "v", (Member(0, 0, "e0"),), incarnation="a"), dead])
    second = Fleet([FleetView(900, "v", (Member(0, 0, "e0"),), incarnation="b")])
    client = FleetClient(first, resolve=lambda: second)
    restarted = []

    async def on_restart():
        restarted.append(client.view.incarnation)

    client.on_fleet_restart.append(on_restart)
    await client.refresh()
    assert client.fleet_error is None
    client.poll_s = 0.01
    client.start_watching()
    try:
        for _ in range(100):  # the watch loop: the dead fleet's error is recorded, then resolved again
            await asyncio.sleep(0.005)
            if client.fleet_error:
                break
        assert "ActorDiedError" in client.fleet_error
        assert [m.slot for m in client.members()] == [0]  # the last view keeps routing meanwhile
        for _ in range(400):
            await asyncio.sleep(0.005)
            if restarted:
                break
        assert client.fleet is second and client.fleet_error is None
        assert restarted == ["b"] and client.view.epoch == 900
    finally:
        client.stop_watching()


def test_a_groups_rollouts_start_together_on_its_home_engine_in_every_replica():
    """routing.group_placement together: the rollouts of one group start on the group's home engine
    (rendezvous hash over the serving slots), which two data-plane processes agree on without talking;
    groups spread over the engines; a home more than load_margin above the least loaded is passed
    over; a home that leaves the serving set gives its groups a new common home; spread (the
    default) starts each rollout on the least loaded engine."""
    members = [Member(s, 0, f"e{s}") for s in range(4)]
    replicas = [FleetClient(FakeFleet(), view(1, *members), policy=StickyLeastLoaded(4),
                            load_margin=4)
                for _ in range(2)]
    homes = {}
    for g in range(12):
        group = f"prompt-{g}"
        starts = {replicas[i % 2].route(f"{group}-r{i}", group).member.slot for i in range(8)}
        assert len(starts) == 1, (group, starts)  # every rollout of the group, on either replica
        homes[group] = starts.pop()
    assert len(set(homes.values())) >= 3  # 12 groups over 4 engines
    # later calls of a rollout follow its pin, not the group
    one = replicas[0]
    assert one.route("prompt-0-r0").member.slot == homes["prompt-0"]
    # an overloaded home: a new rollout of the group starts on the least loaded engine instead
    home = next(m for m in members if m.slot == homes["prompt-1"])
    _loaded(one, home, 5)
    assert one.route("prompt-1-new", "prompt-1").member.slot != home.slot
    # the home leaves: the group's new rollouts agree on another engine, in both replicas
    rest = [m for m in members if m.slot != homes["prompt-2"]]
    for r in replicas:
        r._set_view(view(2, *rest))
    new_home = {r.route(f"prompt-2-late-{i}", "prompt-2").member.slot for i, r in enumerate(replicas)}
    assert len(new_home) == 1 and homes["prompt-2"] not in new_home
    # the margin holds under policy sticky too (it has none of its own for pins)
    sticky = FleetClient(FakeFleet(), view(1, *members), policy=Sticky(), load_margin=2)
    home = sticky.route("g9-a", "g9").member
    _loaded(sticky, home, 3)
    assert sticky.route("g9-b", "g9").member.slot != home.slot
    # spread (the turn runner passes no group): the least loaded engine
    spread = FleetClient(FakeFleet(), view(1, *members), policy=StickyLeastLoaded(4))
    firsts = []
    for i in range(4):
        m = spread.route(f"s-{i}").member
        spread.acquire(m)
        firsts.append(m.slot)
    assert sorted(firsts) == [0, 1, 2, 3]
