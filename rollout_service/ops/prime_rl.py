"""prime-rl's inference-server admin calls answered for a running rollout-service
(``rollout-service prime-rl-admin``).

prime-rl's orchestrator sends its generations to ``[orchestrator.model.client] base_url`` (the
service's token-in route) and its admin calls to ``admin_base_url`` (``base_url`` without ``/v1``
when unset): ``GET /health`` and ``GET /v1/models`` at start, then for every new policy
``POST /pause``, ``POST /update_weights {"weight_dir": ...}``, ``POST /resume``. The service takes
weights from its refit controller (a Ray handle), never over its data plane's HTTP port; this
adapter is the bridge, a small HTTP server wherever the Ray cluster is reachable (beside the
orchestrator or the trainer):

- ``POST /update_weights {"weight_dir": D}``: a refit from the HF checkpoint directory ``D``
  (transport ``path``: every engine node reads ``D``; prime-rl's filesystem broadcast writes one per
  step), labelled with the directory's name (``step_12``), answered when every engine serves it.
  The directory that is already the current version: 200 without a refit (a retried call).
- ``POST /pause``, ``POST /resume``: 200, nothing to do. The refit pauses every engine in keep mode
  and resumes it itself; tokens generated between prime-rl's pause and the refit carry the weights
  that made them (per-token weight versions), so nothing is off-policy unlabelled.
- ``GET /health``, ``GET /v1/models``: the service's own answers, relayed.
- Not served (404, which prime-rl skips with a warning for the first three): ``/init_broadcaster``
  (NCCL broadcast: use the service's own weight sync, docs/trainer-integration.md),
  ``/load_lora_adapter``, ``/reload_weights``, ``/metrics`` (the service's Prometheus endpoint is
  its own; prime-rl's adaptive concurrency then needs fixed in-flight limits).

Errors use the OpenAI envelope: 400 for a missing or unreadable ``weight_dir``, 409 for a refit
already running or a directory name already used for other weights, 401 without the API key
(``--api-key``), 502/503 when the service or its controller cannot be reached, 500 for a refit that
failed in the engines (every engine then serves the previous weights).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from pathlib import PurePosixPath
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

logger = logging.getLogger(__name__)

RELAY_TIMEOUT_S = 30.0


def _error(status: int, message: str, type_: str, code: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": type_, "param": None, "code": code}},
                        status_code=status)


def _missing_checkpoint(report: dict[str, Any]) -> bool:
    """A refit that failed at staging because the directory holds no checkpoint (a client mistake)."""
    error = str(report.get("error") or "")
    return report.get("failed_step") == "transfer" and any(
        s in error for s in ("FileNotFoundError", "No such file", "NotADirectoryError", "no safetensors",
                             "no checkpoint"))


def build_admin_app(trainer, service_url: str, *, api_key: str | None = None, service_api_key: str | None = None):
    """The adapter's FastAPI app over ``trainer`` (a :class:`~rollout_service.refit.client.TrainerClient`)
    and the service at ``service_url``."""
    import httpx

    from rollout_service.refit.types import RefitFailed, RefitInProgress

    app = FastAPI(title="rollout-service: prime-rl admin adapter")
    bearer = HTTPBearer(auto_error=False)
    relay_headers = {"Authorization": f"Bearer {service_api_key}"} if service_api_key else {}
    base = service_url.rstrip("/")

    class Unauthorized(Exception):
        pass

    @app.exception_handler(Unauthorized)
    async def _unauthorized(request, exc):
        return _error(401, "a valid API key is required (Authorization: Bearer ...)", "authentication_error",
                      "invalid_api_key")

    async def keyed(credentials: HTTPAuthorizationCredentials | None = Depends(bearer)) -> None:
        if api_key and (credentials is None or not secrets.compare_digest(credentials.credentials, api_key)):
            raise Unauthorized()

    async def relay(path: str) -> Response:
        try:
            async with httpx.AsyncClient(timeout=RELAY_TIMEOUT_S) as client:
                r = await client.get(f"{base}{path}", headers=relay_headers)
        except httpx.HTTPError as exc:
            return _error(502, f"the service at {base} did not answer: {type(exc).__name__}: {exc}",
                          "service_unavailable", "upstream_unreachable")
        return Response(r.content, status_code=r.status_code, media_type=r.headers.get("content-type"))

    @app.get("/health")
    async def health():
        return await relay("/health")

    @app.get("/v1/models", dependencies=[Depends(keyed)])
    async def models():
        return await relay("/v1/models")

    @app.post("/pause", dependencies=[Depends(keyed)])
    async def pause():
        return {"status": "ok", "paused": False,
                "note": "rollout-service pauses its engines (keep mode) during the refit itself"}

    @app.post("/resume", dependencies=[Depends(keyed)])
    async def resume():
        return {"status": "ok"}

    @app.post("/update_weights", dependencies=[Depends(keyed)])
    async def update_weights(request: Request):
        try:
            body = await request.json()
        except ValueError:
            return _error(400, "the body must be JSON: {\"weight_dir\": \"/path/to/step_N\"}", "invalid_request_error")
        weight_dir = body.get("weight_dir") if isinstance(body, dict) else None
        if not isinstance(weight_dir, str) or not weight_dir.strip():
            return _error(400, "weight_dir is required: the HF checkpoint directory to load (prime-rl's filesystem "
                          "weight broadcast); NCCL broadcast goes through the service's own weight sync",
                          "invalid_request_error", "missing_weight_dir")
        version = PurePosixPath(weight_dir.rstrip("/")).name or weight_dir
        try:
            current = await asyncio.wait_for(_aget(trainer.controller.current_version.remote()), RELAY_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - the controller is unreachable
            return _error(503, f"the refit controller did not answer: {type(exc).__name__}: {exc}"[:500],
                          "service_unavailable", "controller_unreachable")
        if current == version:
            return {"status": "ok", "weight_version": version, "refit": None}
        try:
            report = await trainer.arefit(version, weight_dir, transport="path")
        except RefitInProgress as exc:
            return _error(409, f"a refit is already running: {exc}", "conflict_error", "refit_in_progress")
        except RefitFailed as exc:
            report = exc.report or {}
            if _missing_checkpoint(report):
                return _error(400, f"weight_dir {weight_dir!r} holds no checkpoint the engines can read: "
                              f"{report.get('error')}"[:1000], "invalid_request_error", "bad_weight_dir")
            return _error(500, f"the refit failed; every engine serves the previous weights: {exc}"[:1000],
                          "server_error", "refit_failed")
        except ValueError as exc:  # the label was used before (other weights under the same name)
            return _error(409, f"{exc}"[:1000], "conflict_error", "version_used")
        except Exception as exc:  # noqa: BLE001 - Ray could not reach the controller
            if "already used" in str(exc):
                return _error(409, f"{exc}"[:1000], "conflict_error", "version_used")
            return _error(503, f"the refit controller did not answer: {type(exc).__name__}: {exc}"[:500],
                          "service_unavailable", "controller_unreachable")
        return JSONResponse({"status": "ok", "weight_version": version,
                             "refit": {k: report.get(k) for k in ("stall_s", "transfer_s", "load_s", "engines")}})

    return app


async def _aget(ref):
    return await ref


def run_admin(*, service_url: str, host: str, port: int, ray_address: str | None, instance_name: str | None,
              api_key: str | None, service_api_key: str | None) -> int:
    """``rollout-service prime-rl-admin``: connect to the service's Ray cluster, find its refit
    controller, serve until Ctrl-C."""
    import ray
    import uvicorn

    from rollout_service.refit.client import TrainerClient
    from rollout_service.refit.controller import CONTROLLER_NAME, CONTROLLER_NAMESPACE, controller_name

    ray.init(address=ray_address or "auto", log_to_driver=False, ignore_reinit_error=True)
    name = controller_name(instance_name) if instance_name else CONTROLLER_NAME
    try:
        controller = ray.get_actor(name, namespace=CONTROLLER_NAMESPACE)
    except ValueError:
        print(f"rollout-service prime-rl-admin: no refit controller {name!r} in this Ray cluster "
              "(is the service up? --instance-name names another one)")
        return 2
    app = build_admin_app(TrainerClient(controller), service_url, api_key=api_key, service_api_key=service_api_key)
    print(f"prime-rl admin adapter for {service_url} on http://{host}:{port} "
          f"(prime-rl: admin_base_url = [\"http://{host}:{port}/v1\"])", flush=True)
    uvicorn.run(app, host=host, port=port, log_level="warning")
    return 0
