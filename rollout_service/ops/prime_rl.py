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
  (absolute; transport ``path``: every engine node reads ``D``; prime-rl's filesystem broadcast
  writes one per step), answered when every engine serves it. Its weight version is the directory's
  name and a digest (``step_12-3f9a0c1b2d``, :func:`version_label`): the same step of another run,
  or a directory written again, is another version. The directory that is already the current
  version: 200 without a refit (a retried call; one asked again while its refit runs waits for
  that refit); a directory loaded before and replaced since: loaded again as ``<label>~2``.
- ``POST /pause``, ``POST /resume``: 200, nothing to do. The refit pauses every engine in keep mode
  and resumes it itself; tokens generated between prime-rl's pause and the refit carry the weights
  that made them (per-token weight versions, and ``kv_version`` where a refit kept older KV under
  them), so nothing is off-policy unlabelled.
- ``GET /health``, ``GET /v1/models``: the service's own answers, relayed.
- Not served (404, which prime-rl skips with a warning for the first three): ``/init_broadcaster``
  (NCCL broadcast: use the service's own weight sync, docs/trainer-integration.md),
  ``/load_lora_adapter``, ``/reload_weights``, ``/metrics`` (the service's Prometheus endpoint is
  its own; prime-rl's adaptive concurrency then needs fixed in-flight limits).

Errors use the OpenAI envelope: 400 for a missing, relative or unreadable ``weight_dir``, 409 for a
refit of another directory still running, 401 without the API key (``--api-key``), 502/503 when
the service or its controller cannot be reached, 500 for a refit that failed in the engines (every
engine then serves the previous weights), 404 for the routes it does not serve.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import sys
from pathlib import PurePosixPath
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger(__name__)

RELAY_TIMEOUT_S = 30.0
MAX_RELOADS = 100  # one directory loaded again after others, this many times at most


def _error(status: int, message: str, type_: str, code: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": type_, "param": None, "code": code}},
                        status_code=status)


def _missing_checkpoint(report: dict[str, Any]) -> bool:
    """A refit that failed at staging because the engines cannot read the directory (a client
    mistake). The real engine's worker errors reach the controller as vLLM's "Call to
    collective_rpc method failed: <message>", so the messages are matched, not only the types."""
    error = str(report.get("error") or "")
    return report.get("failed_step") == "transfer" and any(
        s in error for s in ("checkpoint directory not found", "FileNotFoundError", "No such file",
                             "NotADirectoryError", "Not a directory", "PermissionError", "Permission denied"))


def version_label(weight_dir: str) -> str:
    """The weight version a checkpoint directory is loaded under: its name (prime-rl's ``step_N``)
    and a digest of its absolute path and, where this process can read them, its files' names,
    sizes and times. The same directory gives the same label (a retried call is recognized); the
    same step of another run, or a step directory written again, gives another (versions label
    distinct weights and are never reused)."""
    import hashlib
    import os

    path = os.path.normpath(weight_dir)
    digest = hashlib.sha256(path.encode())
    try:
        for entry in sorted(os.scandir(path), key=lambda e: e.name):
            if entry.is_file():
                st = entry.stat()
                digest.update(f"\0{entry.name}\0{st.st_size}\0{st.st_mtime_ns}".encode())
    except OSError:
        pass  # not visible here (the engines' nodes read it): the path alone
    return f"{PurePosixPath(path).name}-{digest.hexdigest()[:10]}"


def build_admin_app(trainer, service_url: str, *, api_key: str | None = None, service_api_key: str | None = None):
    """The adapter's FastAPI app over ``trainer`` (a :class:`~rollout_service.refit.client.TrainerClient`)
    and the service at ``service_url``."""
    import httpx

    from rollout_service.refit.types import RefitFailed, RefitInProgress

    app = FastAPI(title="rollout-service: prime-rl admin adapter")
    bearer = HTTPBearer(auto_error=False)
    relay_headers = {"Authorization": f"Bearer {service_api_key}"} if service_api_key else {}
    base = service_url.rstrip("/")
    running: dict[str, asyncio.Future] = {}  # version -> its refit, while it runs

    async def load(version: str, weight_dir: str) -> tuple[str, dict[str, Any]]:
        """The refit, under ``version``; a directory loaded before (and replaced since) again under
        ``version~2``, ``~3``, ...: the controller never reuses a label."""
        for n in range(1, MAX_RELOADS + 1):
            label = version if n == 1 else f"{version}~{n}"
            try:
                return label, await trainer.arefit(label, weight_dir, transport="path")
            except ValueError as exc:
                if "already used" not in str(exc) or n == MAX_RELOADS:
                    raise
        raise AssertionError("unreachable")

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, exc):  # unknown routes and methods: the OpenAI envelope too
        return _error(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", "invalid_request_error",
                      "not_found" if exc.status_code == 404 else None)

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
        if not weight_dir.startswith("/"):
            return _error(400, f"weight_dir must be an absolute path (the engines' nodes read it), got {weight_dir!r}",
                          "invalid_request_error", "bad_weight_dir")
        version = await asyncio.to_thread(version_label, weight_dir)
        try:
            current = await asyncio.wait_for(_aget(trainer.controller.current_version.remote()), RELAY_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - the controller is unreachable
            return _error(503, f"the refit controller did not answer: {type(exc).__name__}: {exc}"[:500],
                          "service_unavailable", "controller_unreachable")
        if current == version or str(current).startswith(f"{version}~"):
            return {"status": "ok", "weight_version": current, "refit": None}
        task = running.get(version)  # the same directory asked again while its refit runs: one refit
        if task is None:
            task = running[version] = asyncio.ensure_future(load(version, weight_dir))
            task.add_done_callback(lambda _t, v=version: running.pop(v, None))
        try:
            version, report = await asyncio.shield(task)
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
    controller, serve until Ctrl-C. Without an API key it listens on loopback only: its
    ``/update_weights`` loads any checkpoint into every engine."""
    import ray
    import uvicorn

    from rollout_service.refit.client import TrainerClient
    from rollout_service.refit.controller import CONTROLLER_NAME, CONTROLLER_NAMESPACE, controller_name

    if not api_key and host not in ("127.0.0.1", "localhost", "::1"):
        print("rollout-service prime-rl-admin: refusing to listen on a non-loopback address without an API key "
              "(--api-key, $ROLLOUT_SERVICE_ADMIN_API_KEY or $ROLLOUT_SERVICE_API_KEY)", file=sys.stderr)
        return 2
    try:
        ray.init(address=ray_address or "auto", log_to_driver=False, ignore_reinit_error=True)
    except (ConnectionError, RuntimeError) as exc:
        print(f"rollout-service prime-rl-admin: no Ray cluster at {ray_address or 'auto'}: {exc}", file=sys.stderr)
        return 2
    name = controller_name(instance_name) if instance_name else CONTROLLER_NAME
    try:
        controller = ray.get_actor(name, namespace=CONTROLLER_NAMESPACE)
    except ValueError:
        print(f"rollout-service prime-rl-admin: no refit controller {name!r} in this Ray cluster "
              "(is the service up? --instance-name names another one)", file=sys.stderr)
        return 2
    app = build_admin_app(TrainerClient(controller), service_url, api_key=api_key, service_api_key=service_api_key)
    print(f"prime-rl admin adapter for {service_url} on http://{host}:{port} "
          f"(prime-rl: admin_base_url = [\"http://{host}:{port}/v1\"])", flush=True)
    # Ctrl-C: stop within seconds (a refit in flight runs to its end in the controller regardless).
    uvicorn.run(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=5)
    return 0
