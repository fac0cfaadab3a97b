"""prime-rl's admin calls answered for a running service (``rollout-service prime-rl-admin``):
the adapter over HTTP (uvicorn on a port, httpx), in front of a Serve app of simulated engines
with its own fleet and refit controller (what is tested is the adapter and the refit it triggers,
not an engine; the path refit on the real engine has its own tests).

``/health`` and ``/v1/models`` are the service's answers; ``/pause`` and ``/resume`` are accepted;
``/update_weights {"weight_dir"}`` refits every engine from that directory under a label of its
name and digest, after which the service's turns carry that version; the same directory again
answers without a refit; another run's step of the same name is another version; a missing,
relative or empty ``weight_dir`` is a 400 (also from the real engine); NCCL and LoRA routes are
404 (prime-rl skips them); without the API key, 401."""

from __future__ import annotations

import contextlib
import shutil
import threading
import time

import httpx
import pytest
import ray

from runtime_fixtures import free_port
from serve_helpers import wait_healthy

APP = "primerl"
KEY = "admin-secret"


def _config(tiny_model_dir, redis_url):
    from rollout_service.config import RolloutServiceConfig

    return RolloutServiceConfig.model_validate({
        "engine": {"model": str(tiny_model_dir), "backend": "simulated", "num_engines": 2, "num_cpus_per_engine": 0,
                   "sim": {"decode_step_s": 0.002, "decode_step_s_per_seq": 0.0001, "prefill_s_per_token": 1e-6}},
        "store": {"redis_url": redis_url, "key_prefix": APP},
        "service": {"instance_name": APP, "num_affinity_replicas": 1},
        "refit": {"step_timeout_s": 30.0},
    })


@contextlib.contextmanager
def _serving(app):
    """The adapter app on a free port (uvicorn in a thread), stopped on the way out; yields its URL."""
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            assert time.monotonic() < deadline, "the adapter did not start"
            time.sleep(0.05)
        yield f"http://127.0.0.1:{server.config.port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


@pytest.fixture(scope="module")
def adapter(service, redis_server, tiny_model_dir):
    from ray import serve

    from rollout_service.fleet.fleet import FLEET_NAMESPACE
    from rollout_service.ops.prime_rl import build_admin_app
    from rollout_service.refit.client import TrainerClient
    from rollout_service.refit.controller import controller_name, get_controller
    from rollout_service.serve.app import build_app

    base = f"{service.url}/{APP}"
    serve.run(build_app(_config(tiny_model_dir, redis_server)), name=APP, route_prefix=f"/{APP}")
    try:
        wait_healthy(f"{base}/health")
        trainer = TrainerClient(get_controller(controller_name(APP)), timeout_s=60)
        with _serving(build_admin_app(trainer, base, api_key=KEY)) as url:
            yield url, base
    finally:
        serve.delete(APP)
        for a in ray.util.list_named_actors(all_namespaces=True):  # the fleet stops with its app; do not wait
            if a["namespace"] == FLEET_NAMESPACE and a["name"].startswith(f"{APP}-"):
                with contextlib.suppress(ValueError):
                    ray.kill(ray.get_actor(a["name"], namespace=FLEET_NAMESPACE), no_restart=True)


def test_prime_rls_admin_calls_refit_the_service_and_its_turns_carry_the_new_version(adapter, tiny_model_dir, tmp_path):
    url, base = adapter
    auth = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(timeout=120) as http:
        assert http.get(f"{url}/health").status_code == 200  # prime-rl polls it without a key check
        models = http.get(f"{url}/v1/models", headers=auth)
        assert models.status_code == 200 and models.json()["data"][0]["id"] == "tiny-qwen3"
        assert http.post(f"{url}/update_weights", json={"weight_dir": "/x"}).status_code == 401

        step = tmp_path / "broadcasts" / "step_1"
        step.mkdir(parents=True)
        shutil.copy(tiny_model_dir / "model.safetensors", step / "model.safetensors")
        assert http.post(f"{url}/pause", params={"mode": "keep", "clear_cache": "false"}, headers=auth).status_code == 200
        r = http.post(f"{url}/update_weights", json={"weight_dir": str(step)}, headers=auth)
        assert r.status_code == 200, r.text
        v1 = r.json()["weight_version"]
        assert v1.startswith("step_1-") and sorted(r.json()["refit"]["engines"]) == [0, 1], r.text
        assert http.post(f"{url}/resume", headers=auth).status_code == 200

        status = http.get(f"{base}/v1/status").json()
        assert status["weight_version"] == v1 and status["refits"]["committed"] == 1, status
        turn = http.post(f"{base}/v1/chat/completions", headers={"X-Rollout-Id": "primerl-after"}, json={
            "model": "tiny-qwen3", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "seed": 1})
        assert turn.status_code == 200, turn.text
        traj = http.get(f"{base}/v1/rollouts/primerl-after").json()
        assert {s["version"] for s in traj["segments"][0]["weight_versions"]} == {v1}

        # a retried call: no second refit
        again = http.post(f"{url}/update_weights", json={"weight_dir": str(step) + "/"}, headers=auth)
        assert again.status_code == 200 and again.json() == {"status": "ok", "weight_version": v1, "refit": None}
        assert http.get(f"{base}/v1/status").json()["refits"]["committed"] == 1

        # client mistakes: 400, and nothing changed
        for body in ({}, {"weight_dir": None}, {"weight_dir": ""}, {"weight_dir": 3}, {"weight_dir": "step_2"}):
            bad = http.post(f"{url}/update_weights", json=body, headers=auth)
            assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error", (body, bad.text)
        missing = http.post(f"{url}/update_weights", json={"weight_dir": str(tmp_path / "nowhere" / "step_2")},
                            headers=auth)
        assert missing.status_code == 400 and missing.json()["error"]["code"] == "bad_weight_dir", missing.text
        assert http.get(f"{base}/v1/status").json()["weight_version"] == v1

        # the same step of another run is other weights: another version; the first directory
        # loaded again after it: a third version (labels are never reused)
        other = tmp_path / "other-run" / "step_1"
        other.mkdir(parents=True)
        shutil.copy(tiny_model_dir / "model.safetensors", other / "model.safetensors")
        r2 = http.post(f"{url}/update_weights", json={"weight_dir": str(other)}, headers=auth)
        assert r2.status_code == 200 and r2.json()["weight_version"] not in (v1, None), r2.text
        r3 = http.post(f"{url}/update_weights", json={"weight_dir": str(step)}, headers=auth)
        assert r3.status_code == 200 and r3.json()["weight_version"] == f"{v1}~2", r3.text
        assert http.get(f"{base}/v1/status").json()["weight_version"] == f"{v1}~2"
        again = http.post(f"{url}/update_weights", json={"weight_dir": str(step)}, headers=auth)
        assert again.status_code == 200 and again.json()["refit"] is None

        for path in ("/init_broadcaster", "/load_lora_adapter", "/reload_weights"):
            gone = http.post(f"{url}{path}", json={}, headers=auth)
            assert gone.status_code == 404 and gone.json()["error"]["code"] == "not_found", gone.text


def test_a_checkpoint_the_real_engines_cannot_read_is_a_400_and_changes_nothing(service, tmp_path):
    """The real vLLM engine reports a missing directory through vLLM's collective RPC (its own
    message, not the error's type): still a client mistake, 400, the engines on their weights."""
    from rollout_service.ops.prime_rl import build_admin_app
    from rollout_service.refit.client import TrainerClient
    from rollout_service.refit.controller import get_controller

    app = build_admin_app(TrainerClient(get_controller(), timeout_s=60), service.url)
    with _serving(app) as url, httpx.Client(timeout=120) as http:
        before = http.get(f"{service.url}/v1/status").json()["weight_version"]
        r = http.post(f"{url}/update_weights", json={"weight_dir": str(tmp_path / "step_9")})
        assert r.status_code == 400 and r.json()["error"]["code"] == "bad_weight_dir", r.text
        assert "checkpoint directory not found" in r.json()["error"]["message"]
        assert http.get(f"{service.url}/v1/status").json()["weight_version"] == before
