"""Session-wide real components: the tiny model, one local Ray, the service (one vLLM engine), a
two-engine fleet rig, a one-engine refit controller.

Started once per test session (engine start-up is ~20 s on 2 cores) and shared by every test that
needs them; the refit controller is stopped after its last user. Nothing here is a mock.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"

from rollout_service.ops.runtime import apply_local_env

apply_local_env()
# Ray's processes export their metrics every 10 s by default; the session's Ray every 2 s, so that
# tests/test_metrics.py waits for a settled scrape a fifth as long (the raylet and every worker
# read this when the session's Ray starts).
os.environ.setdefault("RAY_metrics_report_interval_ms", "2000")

# KV cache of every test engine (the tiny model needs 1 KiB per token: 128 MiB holds 131k tokens,
# twice max_num_seqs x max_model_len). vLLM touches all of it at start: at the 1 GiB default, the
# engines a session has alive at once came within 5 % of a 24 GiB machine.
TEST_KV_GIB = 0.125


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    from rollout_service.models.tiny_model import ensure_tiny_model

    return ensure_tiny_model()


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


@pytest.fixture(scope="session")
def ray_session():
    from rollout_service.ops.runtime import start_local_ray

    # Ray's metrics agent on a known port: tests/test_metrics.py scrapes it.
    info = start_local_ray(metrics_port=free_port())
    yield info
    import ray

    try:
        from ray import serve

        serve.shutdown()
    except Exception:
        pass
    ray.shutdown()


@pytest.fixture(scope="session")
def engine_actor(service):
    """The session service's vLLM engine actor (its fleet's one engine), called directly.

    Not an engine of its own: one engine start (~20-30 s) and ~2 GiB less per session, and no
    second idle engine competing with every later test for the 2 cores. The tests that use it
    leave it as they found it: base weights, version "0", resumed (refits go to other engines).
    """
    import ray

    from rollout_service.fleet.fleet import fleet_name, get_fleet

    fleet = get_fleet(fleet_name(service.config.service.instance_name))
    (actor,) = ray.get(fleet.view.remote(), timeout=60).handles()
    return actor


# Session resources released right after the last test that uses them, not at session end: an
# idle engine left running competes with every later test for the 2 cores (and holds ~2 GiB).
_RELEASE_AFTER: dict[str, list] = {}  # nodeid of the last user -> closers


def release_after_last_user(request, fixture: str, close) -> None:
    users = [item.nodeid for item in request.session.items if fixture in getattr(item, "fixturenames", ())]
    if users:
        _RELEASE_AFTER.setdefault(users[-1], []).append(close)


@pytest.hookimpl(trylast=True)  # after pytest's own teardown of the test's module fixtures
def pytest_runtest_teardown(item, nextitem):
    for close in _RELEASE_AFTER.pop(item.nodeid, ()):
        close()


@pytest.fixture(scope="session")
def refit_controller(ray_session, tiny_model_dir, request):
    """One engine (the default parity config) behind a standalone RefitController, for the refit
    modules that need an engine of their own (test_refit.py, test_refit_async_trainer.py, and
    test_refit_nccl_lease.py's stand-in controller over its fleet); stopped after the last of them."""
    import contextlib

    from refit_helpers import running_controller

    stack = contextlib.ExitStack()
    actor = stack.enter_context(running_controller(tiny_model_dir))
    release_after_last_user(request, "refit_controller", stack.close)
    yield actor
    stack.close()


@pytest.fixture(scope="session")
def raw_prefix_controller(ray_session, tiny_model_dir, request):
    """One engine with prefix caching on and raw logprobs, behind a standalone RefitController: two
    ways to break parity for the canary (test_canary.py), and the prefix cache across a refit
    (test_refit_prefix_cache.py, at T = 1 where raw and processed logprobs agree). One engine start
    for both; stopped after the last of them."""
    import contextlib

    from refit_helpers import running_controller

    stack = contextlib.ExitStack()
    actor = stack.enter_context(running_controller(tiny_model_dir, enable_prefix_caching=True,
                                                   logprobs_mode="raw_logprobs"))
    release_after_last_user(request, "raw_prefix_controller", stack.close)
    yield actor
    stack.close()


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def service(ray_session, redis_server, tiny_model_dir):
    """The whole app: Ray Serve (2 affinity replicas), one vLLM engine, the session's redis-server."""
    from rollout_service.config import CanaryConfig, EngineConfig, RolloutServiceConfig, ServiceConfig, StoreConfig
    from rollout_service.ops.launcher import LocalService

    cfg = RolloutServiceConfig(
        engine=EngineConfig(model=str(tiny_model_dir), cpu_kvcache_space_gib=TEST_KV_GIB),
        store=StoreConfig(redis_url=redis_server, key_prefix="svc"),
        service=ServiceConfig(num_affinity_replicas=2, default_max_tokens=32),
        # Off here: a re-scoring would add to the engine's own counters that tests count exactly
        # (test_serve_canary.py deploys an app with it on beside this one).
        canary=CanaryConfig(sample_fraction=0.0),
    )
    svc = LocalService(cfg, port=free_port(), log=lambda *_: None).start()
    yield svc
    svc.stop()


@pytest.fixture(scope="session")
def openai_client(service):
    import openai

    return openai.OpenAI(base_url=f"{service.url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def http(service):
    import httpx

    with httpx.Client(base_url=service.url, timeout=120) as client:
        yield client


@pytest.fixture(scope="session")
async def fleet_rig(ray_session, redis_server, tiny_model_dir, tiny_tokenizer, request):
    """Two real engines owned by a real (anonymous) fleet, the data plane over it, a controller;
    stopped after the last test that uses it."""
    async for rig in _rig(redis_server, tiny_model_dir, tiny_tokenizer, request, "fleet_rig", simulated=False):
        yield rig


@pytest.fixture(scope="session")
async def sim_rig(ray_session, redis_server, tiny_model_dir, tiny_tokenizer, request):
    """``fleet_rig`` on two stand-in engines (``engine.backend: simulated``): for the fault drills
    whose subject is the fleet, the controller and the data plane, not the engine (each engine
    behaviour they touch keeps its test on ``fleet_rig``); stopped after its last user."""
    async for rig in _rig(redis_server, tiny_model_dir, tiny_tokenizer, request, "sim_rig", simulated=True):
        yield rig


async def _rig(redis_server, tiny_model_dir, tiny_tokenizer, request, name: str, *, simulated: bool):
    import ray

    from fleet_helpers import FleetRig, start_rig
    from rollout_service.fleet.client import connect
    from rollout_service.refit.client import TrainerClient
    from rollout_service.serve.turns import TurnRunner
    from rollout_service.store.redis_store import RedisRolloutStore

    cfg, fleet, controller = start_rig(tiny_model_dir, redis_server, tiny_tokenizer, simulated=simulated)
    store = RedisRolloutStore.from_config(cfg.store)
    client = await connect(fleet, nonstream_progress_s=cfg.fleet.nonstream_progress_s)  # as the app's replicas
    runner = TurnRunner(cfg, client, store, tiny_tokenizer)
    trainer = TrainerClient(controller, timeout_s=60)
    stopped = []

    def stop() -> None:
        if stopped:
            return
        stopped.append(True)
        client.stop_watching()
        client.close_channels()
        try:
            ray.get(fleet.shutdown.remote(), timeout=60)
        finally:
            ray.kill(controller)
            ray.kill(fleet)

    release_after_last_user(request, name, stop)
    yield FleetRig(fleet, controller, runner, store, trainer, cfg)
    await store.close()
    stop()
