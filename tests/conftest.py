"""Session-wide fixtures shared by every test module; keep them generic.

Heavier real components (tiny model, Ray, vLLM engine actor) live in ``runtime_fixtures.py`` and are
registered here as a plugin.
"""

from __future__ import annotations

import importlib.util

import pytest

from rollout_service.store.embedded import embedded_redis

pytest_plugins = [m for m in ("runtime_fixtures",) if importlib.util.find_spec(m) is not None]


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    """URL of a real redis-server (AOF on) started once per test session on 127.0.0.1.

    Shared by every module: isolate tests by key prefix or rollout id, never FLUSHALL.
    """
    with embedded_redis(tmp_path_factory.mktemp("redis")) as server:
        yield server.url
