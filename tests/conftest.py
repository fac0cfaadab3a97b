"""Session-wide fixtures shared by every test module; keep them generic.

Heavier real components (tiny model, Ray, vLLM engine actor) live in ``runtime_fixtures.py`` and are
registered here as a plugin.
"""

from __future__ import annotations

import importlib.util

import pytest

from rollout_service.store.embedded import embedded_redis

pytest_plugins = [m for m in ("runtime_fixtures",) if importlib.util.find_spec(m) is not None]


# What each heavy fixture starts, as markers: a test is marked by the fixtures it uses (directly
# or through another fixture), so `-m "not engine and not serve and not cluster"` selects only
# tests that start no engine, no Serve app and no Ray cluster. A test that starts its own cluster
# or service without a fixture (a subprocess) carries its marks by hand.
FIXTURE_MARKS = {
    "ray_session": ("cluster",),
    "service": ("cluster", "engine", "serve"),
    "fleet_rig": ("cluster", "engine"),
    "sim_rig": ("cluster",),  # stand-in engines
    "refit_controller": ("cluster", "engine"),
    "raw_prefix_controller": ("cluster", "engine"),
    "placement_probe": ("cluster",),  # its own three-node Ray cluster, in a subprocess
    "ray_driver_run": ("cluster",),  # a Ray driver in a subprocess
}


# Tests that share a heavy session fixture run back to back, so it can be released right after its
# last user (runtime_fixtures.release_after_last_user) instead of idling through the rest.
GROUPED_FIXTURES = ("sim_rig", "fleet_rig", "refit_controller", "raw_prefix_controller")


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(config, items):
    for item in items:
        names = set(getattr(item, "fixturenames", ()))
        for fixture, marks in FIXTURE_MARKS.items():
            if fixture in names:
                for mark in marks:
                    item.add_marker(mark)
    items[:] = run_order(items)


def run_order(items: list) -> list:
    """The order the suite runs in: the tests that start nothing first; then the ones that start a
    Ray cluster of their own (in a subprocess), on a machine no session engine competes for; then
    the session's Ray: each fixture of GROUPED_FIXTURES's users back to back and before the rest, so
    it is released before the session service starts idling beside it (a ``leaves_rig_healing`` test
    last among them); then the rest. Otherwise the collection order (stable)."""

    def kind(item) -> int:
        if item.get_closest_marker("cluster") is None:
            return 0
        return 1 if "ray_session" not in getattr(item, "fixturenames", ()) else 2

    out = [i for i in items if kind(i) == 0] + [i for i in items if kind(i) == 1]
    rest = [i for i in items if kind(i) == 2]
    for fixture in GROUPED_FIXTURES:
        users = [i for i in rest if fixture in getattr(i, "fixturenames", ())]
        # A test that leaves an engine of the rig still being replaced goes last: no later user waits for it.
        users.sort(key=lambda i: i.get_closest_marker("leaves_rig_healing") is not None)
        out += users
        rest = [i for i in rest if fixture not in getattr(i, "fixturenames", ())]
    return out + rest


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    """URL of a real redis-server (AOF on) started once per test session on 127.0.0.1.

    Shared by every module: isolate tests by key prefix or rollout id, never FLUSHALL.
    """
    with embedded_redis(tmp_path_factory.mktemp("redis")) as server:
        yield server.url
