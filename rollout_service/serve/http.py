"""The HTTP layer of the data plane, apart from its routes: the ASGI guard (API key, body size) and
metering, the API key as FastAPI's bearer security scheme (so OpenAPI documents it), the OpenAI
error envelope for every error (ours, Starlette's, FastAPI's validation), and the OpenAPI schema's
error documentation.

Errors are raised as :class:`~rollout_service.serve.protocol.envelope.ServiceError`, which carries its
HTTP status and code; this layer only renders them.
"""

from __future__ import annotations

import contextvars
import logging
import re
import secrets
import time
from typing import Any, AsyncIterator

from fastapi import Depends, FastAPI, Request, Security
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from rollout_service.fleet.types import is_engine_death
from rollout_service.metrics import RequestObservation, get_metrics
from rollout_service.serve.dialects.common import unicode_body
from rollout_service.serve.protocol.envelope import ErrorResponse, ServiceError, bad_request
from rollout_service.serve.turn_types import TokenDelta, TurnResult

logger = logging.getLogger(__name__)


class Guard:
    """Pure ASGI middleware, before routing and before a body is read or parsed: the API key (every
    path but ``/health``: 401), then the body size (413, by its declared length or, when chunked, as
    soon as the bytes received pass the limit).

    Its settings are class attributes set by the deployment: Serve serves a pickled copy of the
    FastAPI app, which shares classes (pickled by reference) but not the app's ``state``."""

    api_key: str | None = None
    max_bytes: int = 8 * 1024 * 1024

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        path, root = scope["path"], scope.get("root_path", "")
        if root and path.startswith(root):
            path = path[len(root):]
        if path != "/health":
            refused = key_refused(headers.get("authorization"))
            if refused is not None:
                return await _send_error(send, refused)
        length = headers.get("content-length")
        limit = Guard.max_bytes
        if length is not None and (not length.isdigit() or int(length) > limit):
            return await _send_error(send, _too_large(limit))
        seen = 0

        async def counted():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise _BodyTooLarge()
            return message

        try:
            return await self.app(scope, counted, send)
        except _BodyTooLarge:
            return await _send_error(send, _too_large(limit))


def key_refused(authorization: str | None) -> ServiceError | None:
    """``Authorization: Bearer <key>`` against the configured key, compared in constant time (no key
    configured: every call passes)."""
    expected = Guard.api_key
    if not expected:
        return None
    if secrets.compare_digest((authorization or "").encode("utf-8"), f"Bearer {expected}".encode("utf-8")):
        return None
    return ServiceError(401, "invalid or missing API key", type="authentication_error", code="invalid_api_key")


class _BodyTooLarge(Exception):
    pass


def _too_large(limit: int) -> ServiceError:
    return ServiceError(413, f"request body larger than {limit} bytes", code="request_too_large")


async def _send_error(send, exc: ServiceError) -> None:
    body = JSONResponse(exc.envelope()).body
    await send({"type": "http.response.start", "status": exc.status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


_BEARER = HTTPBearer(auto_error=False, scheme_name="ApiKey",
                     description="The service's API key (`service.api_key` or ROLLOUT_SERVICE_API_KEY) as a bearer "
                                 "token; required only when the service is configured with one.")


async def require_api_key(request: Request, authorization: HTTPAuthorizationCredentials | None = Security(_BEARER)):
    """The routes' security dependency, as OpenAPI documents it (FastAPI's bearer scheme). The guard
    has already refused a call without the key before its body was read; this checks again, at the
    route, with the same constant-time comparison."""
    refused = key_refused(request.headers.get("authorization"))
    if refused is not None:
        raise refused


_REQUEST: contextvars.ContextVar[RequestObservation | None] = contextvars.ContextVar("rollout_request", default=None)


class Metered:
    """Pure ASGI middleware, outermost: every HTTP request's route, status and latency, and what its
    call generated (filled in by :func:`observed`), recorded once it has been answered
    (:mod:`rollout_service.metrics`). A call forwarded to the replica owning its rollout is counted
    here, where the HTTP request arrived; its turn is counted by the owner's runner."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        obs = RequestObservation(time.perf_counter())
        token = _REQUEST.set(obs)
        status = 500  # the app raised before answering: Starlette's error middleware sends a 500

        async def sent(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sent)
        finally:
            _REQUEST.reset(token)
            get_metrics().request(route_of(scope), status, time.perf_counter() - obs.t0, obs)


def route_of(scope) -> str:
    """The route's path template (``/v1/rollouts/{rollout_id}``: bounded label values); for a request
    refused before routing (401, 413) the route it would have reached; ``unmatched`` for none."""
    path = getattr(scope.get("route"), "path", None)
    if path:
        return _template(path)
    partial = None  # the path matches, the method does not (a 405 to be)
    for route in getattr(scope.get("app"), "routes", ()):
        try:
            match = route.matches(scope)[0]
        except Exception:
            continue
        if match == Match.FULL:
            return _template(route.path)
        if match == Match.PARTIAL and partial is None:
            partial = route.path
    return _template(partial) if partial is not None else "unmatched"


def _template(path: str) -> str:
    """``/v1/rollouts/{rollout_id:path}`` as ``/v1/rollouts/{rollout_id}`` (no converter in the label)."""
    return _CONVERTER.sub(r"{\1}", path)


_CONVERTER = re.compile(r"\{(\w+):\w+\}")


async def observed(events: AsyncIterator, stream: bool) -> AsyncIterator:
    """Pass a call's events through, noting its first generated token and its result for the metrics."""
    obs = _REQUEST.get()
    if obs is not None:
        obs.stream = stream
    async for event in events:
        if obs is not None:
            if isinstance(event, TokenDelta):
                if event.token_ids:
                    obs.first_token(time.perf_counter())
            elif isinstance(event, TurnResult):
                if event.generation_token_ids:
                    obs.first_token(time.perf_counter())
                obs.result(len(event.prompt_token_ids), len(event.generation_token_ids), event.replayed,
                           event.weight_versions)
        yield event


def error_response(exc: ServiceError) -> JSONResponse:
    return JSONResponse(exc.envelope(), status_code=exc.status)


def _param_of(loc) -> str | None:
    """``messages[1].content`` from pydantic's location, without the body and the union-member tags
    pydantic puts in it (``tool_choice.literal['auto','none','required']``, ``prompt.list[int]``)."""
    parts = [str(p) for p in loc if p not in ("body",) and not _UNION_TAG.fullmatch(str(p))]
    out = ""
    for p in parts:
        out += f"[{p}]" if p.isdigit() else (f".{p}" if out else p)
    return out or None


_UNION_TAG = re.compile(r"str|int|float|bool|none|[A-Z]\w*|[\w-]+\[.*\]")


# What each error status means, as the OpenAPI schema documents it per route (every one carries
# the OpenAI error envelope: ErrorResponse).
ERROR_MEANINGS = {
    400: "A client mistake (the message names the field): nothing was run or stored.",
    401: "Missing or wrong API key (when the service is configured with one).",
    404: "Unknown model, or no such rollout.",
    409: "The history contradicts the rollout's stored one under X-History-Policy: reject (or echo fields "
         "contradict it): nothing was stored.",
    413: "The request body is larger than the service accepts.",
    422: "Idempotency-Key reused with a different request on this rollout.",
    500: "An unexpected failure of the service: nothing was stored; retrying is safe.",
    503: "Not ready, or no engine or store available right now: nothing was stored; retry.",
    507: "The rollout store is full: the turn was not stored.",
}


def errors_doc(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """``responses=`` of a route: the error statuses it can answer, each with the envelope's schema."""
    return {status: {"model": ErrorResponse, "description": ERROR_MEANINGS[status]} for status in statuses}


# With "stream": true a generation answers server-sent events.
STREAMED = {200: {"description": "The answer; server-sent events with \"stream\": true.",
                   "content": {"text/event-stream": {"schema": {"type": "string"}}}}}
TURN_ERRORS = {**STREAMED, **errors_doc(400, 401, 404, 409, 413, 422, 500, 503, 507)}
ROLLOUT_ERRORS = errors_doc(400, 401, 404, 503)


def openapi_without_validation_errors(app: FastAPI):
    """FastAPI documents a 422 with its own validation-error body on every route with parameters;
    this service answers validation errors as a 400 with the OpenAI envelope (``_validation``), so
    those are dropped (a route's own 422, an Idempotency-Key reuse, stays)."""
    default = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = default()
            for ops in schema.get("paths", {}).values():
                for op in ops.values():
                    answer = op.get("responses", {}).get("422", {})
                    ref = answer.get("content", {}).get("application/json", {}).get("schema", {}).get("$ref")
                    if ref == "#/components/schemas/HTTPValidationError":
                        del op["responses"]["422"]
                    for status, answer in op.get("responses", {}).items():  # errors are JSON on HTML routes too
                        content = answer.get("content", {})
                        if int(status) >= 400 and "text/html" in content:
                            content["application/json"] = content.pop("text/html")
            for name in ("HTTPValidationError", "ValidationError"):
                schema.get("components", {}).get("schemas", {}).pop(name, None)
            app.openapi_schema = schema
        return app.openapi_schema

    return openapi


def create_app() -> FastAPI:
    app = FastAPI(title="rollout-service", version="0.2.0",
                  description="OpenAI-compatible generations for RL rollouts, exactly on-policy at the token level.",
                  dependencies=[Depends(unicode_body)])
    app.add_middleware(Guard)
    app.add_middleware(Metered)  # added last: outermost, so refusals by the guard are counted too

    @app.exception_handler(ServiceError)
    async def _service_error(request: Request, exc: ServiceError):
        return error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        headers = exc.headers
        if exc.status_code == 405:  # Allow (RFC 9110): every method of the path, not only its first route's
            methods = {m for r in request.app.routes if r.matches(request.scope)[0] != Match.NONE
                       for m in (getattr(r, "methods", None) or ())}
            headers = {**(headers or {}), "Allow": ", ".join(sorted(methods))} if methods else headers
        return JSONResponse({"error": {"message": str(exc.detail), "type": kind, "param": None, "code": None}},
                            status_code=exc.status_code, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        errors = exc.errors()
        err = errors[0] if errors else {}
        param = _param_of(err.get("loc", ()))
        msg = str(err.get("msg", "invalid request"))
        if err.get("type") == "json_invalid":
            return error_response(bad_request(f"request body is not valid JSON: {msg}", code="invalid_json"))
        if err.get("type") == "missing" and param is None:
            return error_response(bad_request("request body is required"))
        return error_response(bad_request(f"{param}: {msg}" if param else msg, param=param))

    app.openapi = openapi_without_validation_errors(app)
    return app


async def guard_events(events: AsyncIterator) -> AsyncIterator:
    """Unexpected failures of a call as ServiceErrors: 503 when an engine or replica is gone, else 500."""
    try:
        async for event in events:
            yield event
    except ServiceError:
        raise
    except Exception as exc:
        status, envelope = unexpected_error(exc)
        raise ServiceError.from_result({"__error__": status, **envelope}) from None


async def safe_stream(dialect, frames: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """A failure while formatting a stream ends it with the dialect's error event, not a cut connection."""
    try:
        async for frame in frames:
            yield frame
    except Exception as exc:
        status, envelope = unexpected_error(exc)
        yield dialect.error_frame(ServiceError.from_result({"__error__": status, **envelope}))


def unexpected_error(exc: Exception) -> tuple[int, dict[str, Any]]:
    """An exception no layer mapped: 503 when a replica or engine is gone (retry), else a logged 500."""
    if is_engine_death(exc):  # Ray's actor errors (a replica or an engine) and a lost engine channel
        err = ServiceError(503, f"a replica or engine became unavailable, retry: {type(exc).__name__}",
                           type="service_unavailable", code="replica_unavailable")
    else:
        logger.exception("unhandled error", exc_info=exc)
        err = ServiceError(500, f"{type(exc).__name__}: {exc}"[:500], type="server_error")
    return err.status, err.envelope()


# The viewer's page loads nothing and runs nothing: token text is escaped, and this makes sure.
VIEWER_HEADERS = {"content-security-policy": "default-src 'none'; style-src 'unsafe-inline'",
                   "x-content-type-options": "nosniff"}
