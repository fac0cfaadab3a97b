"""Which engine serves a rollout's turn (``routing.policy``).

A rollout's turns share a prefix, so on an engine with prefix caching its next turn is cheap where
its last one ran. Pure stickiness locks a saturated engine into KV-cache thrash while others idle;
pure least-loaded throws the cache away every turn. The policies:

- ``sticky``: a rollout stays on the engine of its first turn until that engine leaves the serving
  set.
- ``least_loaded``: every turn goes to the least loaded engine (no pins).
- ``sticky_least_loaded`` (default): a rollout stays on its engine while that engine's load is
  within ``routing.load_margin`` requests of the least loaded engine's; past that, the pin moves
  to the least loaded one (a *pin move*: counted, and named on the turn). Without prefix caching
  (``engine.enable_prefix_caching: false``, the parity default) affinity buys nothing, so it
  routes as ``least_loaded``.

An engine's load is the fleet's figure for it (requests in flight at the fleet's last probe, the
same in every process that routes) plus the calls this process started on it since. Ties go to
the lowest slot. Pure (no Ray): tests/test_fleet_client_routing.py drives it directly.
"""

from __future__ import annotations

import hashlib

from dataclasses import dataclass
from typing import Protocol

from rollout_service.fleet.types import Member

POLICIES = ("sticky_least_loaded", "sticky", "least_loaded")


def group_home(members: tuple[Member, ...], group: str) -> Member:
    """The engine a group's rollouts start on under ``group_placement: together``: rendezvous
    hashing of the group over the serving slots, so every data-plane process picks the same one
    without sharing state, and only the groups whose home left the serving set move."""
    def score(m: Member) -> int:
        return int.from_bytes(hashlib.blake2b(f"{group}\x00{m.slot}".encode(), digest_size=8).digest(), "big")

    return max(members, key=score)


def load_of(member: Member, outstanding: dict[tuple[int, int], int]) -> int:
    return member.load + outstanding.get(member.key, 0)


def least_loaded(members: tuple[Member, ...], outstanding: dict[tuple[int, int], int]) -> Member:
    return min(members, key=lambda m: (load_of(m, outstanding), m.slot))


@dataclass(frozen=True)
class Route:
    """A turn's engine, and whether the rollout's pin had to move off a live engine to get there."""

    member: Member
    moved: bool = False


class RoutingPolicy(Protocol):
    pins: bool  # whether the client keeps a pin per rollout

    def choose(self, members: tuple[Member, ...], outstanding: dict[tuple[int, int], int],
               pinned: Member | None) -> Route: ...


class LeastLoaded:
    pins = False

    def choose(self, members, outstanding, pinned=None):
        return Route(least_loaded(members, outstanding))


class Sticky:
    pins = True

    def choose(self, members, outstanding, pinned=None):
        return Route(pinned if pinned is not None else least_loaded(members, outstanding))


class StickyLeastLoaded:
    pins = True

    def __init__(self, margin: int):
        self.margin = margin

    def choose(self, members, outstanding, pinned=None):
        best = least_loaded(members, outstanding)
        if pinned is None:
            return Route(best)
        if load_of(pinned, outstanding) <= load_of(best, outstanding) + self.margin:
            return Route(pinned)
        return Route(best, moved=True)


def make_policy(name: str, *, load_margin: int, prefix_caching: bool) -> RoutingPolicy:
    """The policy ``routing.policy`` names; ``sticky_least_loaded`` without prefix caching routes
    as ``least_loaded`` (see the module docstring)."""
    if name == "least_loaded" or (name == "sticky_least_loaded" and not prefix_caching):
        return LeastLoaded()
    if name == "sticky":
        return Sticky()
    if name == "sticky_least_loaded":
        return StickyLeastLoaded(load_margin)
    raise ValueError(f"routing.policy must be one of {', '.join(POLICIES)}, got {name!r}")


def effective_policy(name: str, prefix_caching: bool) -> str:
    """The name of the policy that routes (status reports it)."""
    return "least_loaded" if name == "sticky_least_loaded" and not prefix_caching else name
