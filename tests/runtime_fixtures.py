"""Session-wide real components: the tiny model, one local Ray, one vLLM engine actor.

Started once per test session (engine start-up is ~20 s on 2 cores) and shared by every test that
needs them. Nothing here is a mock.
"""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"

from rollout_service.runtime import apply_local_env

apply_local_env()

# KV cache of every test engine (the tiny model needs 1 KiB per token: 128 MiB holds 131k tokens,
# twice max_num_seqs x max_model_len). vLLM touches all of it at start: at the 1 GiB default, the
# engines a session has alive at once came within 5 % of a 24 GiB machine.
TEST_KV_GIB = 0.125


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    from rollout_service.tiny_model import ensure_tiny_model

    return ensure_tiny_model()


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


@pytest.fixture(scope="session")
def ray_session():
    from rollout_service.runtime import start_local_ray

    # Ray's metrics agent on a known port: tests/test_metrics.py scrapes it.
    info = start_local_ray(metrics_port=_free_port())
    yield info
    import ray

    try:
        from ray import serve

        serve.shutdown()
    except Exception:
        pass
    ray.shutdown()


@pytest.fixture(scope="session")
def engine_config(tiny_model_dir):
    from rollout_service.config import EngineConfig

    return EngineConfig(model=str(tiny_model_dir), cpu_kvcache_space_gib=TEST_KV_GIB)


@pytest.fixture(scope="session")
def engine_actor(ray_session, engine_config):
    """One real vLLM engine replica actor, started once."""
    import ray

    from rollout_service.engine.replica import create_engine_actor

    actor = create_engine_actor(engine_config, 0)
    ray.get(actor.start.remote(), timeout=300)
    yield actor
    try:
        ray.get(actor.shutdown.remote(), timeout=30)
    except Exception:
        pass
    ray.kill(actor)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def service(ray_session, redis_server, tiny_model_dir):
    """The whole app: Ray Serve (2 affinity replicas), one vLLM engine, the session's redis-server."""
    from rollout_service.config import EngineConfig, RolloutServiceConfig, ServiceConfig, StoreConfig
    from rollout_service.serve.launcher import LocalService

    cfg = RolloutServiceConfig(
        engine=EngineConfig(model=str(tiny_model_dir), cpu_kvcache_space_gib=TEST_KV_GIB),
        store=StoreConfig(redis_url=redis_server, key_prefix="svc"),
        service=ServiceConfig(num_affinity_replicas=2, default_max_tokens=32),
    )
    svc = LocalService(cfg, port=_free_port(), log=lambda *_: None).start()
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
async def fleet_rig(ray_session, redis_server, tiny_model_dir, tiny_tokenizer):
    """Two real engines owned by a real (anonymous) fleet, the data plane over it, a controller."""
    import ray

    from fleet_helpers import FleetRig, start_rig
    from rollout_service.fleet.client import connect
    from rollout_service.refit.client import TrainerClient
    from rollout_service.serve.turns import TurnRunner
    from rollout_service.store.redis_store import RedisRolloutStore

    cfg, fleet, controller = start_rig(tiny_model_dir, redis_server, tiny_tokenizer)
    store = RedisRolloutStore.from_config(cfg.store)
    client = await connect(fleet)
    runner = TurnRunner(cfg, client, store, tiny_tokenizer)
    trainer = TrainerClient(controller, timeout_s=60)
    yield FleetRig(fleet, controller, runner, store, trainer, cfg)
    client.stop_watching()
    await store.close()
    try:
        ray.get(fleet.shutdown.remote(), timeout=60)
    finally:
        ray.kill(controller)
        ray.kill(fleet)
