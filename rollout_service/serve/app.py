"""The data plane as one Ray Serve deployment (import path ``rollout_service.serve.app:build_app``).

``RolloutService`` is the FastAPI ingress *and* the owner of the rollouts routed to it: Serve's
HTTP proxy copies the ``X-Rollout-Id`` header into the request's session id
(``RAY_SERVE_SESSION_ID_HEADER_KEY=x-rollout-id``, set by every launch mode, see
``docs/deployment.md``) and ``ConsistentHashRouter`` sends every call of a rollout to the same
replica, which runs the turn in-process (:class:`~rollout_service.serve.turns.TurnRunner`) over
its fleet client and the store. One Serve hop from proxy to rollout.

A turn whose rollout id the proxy did not route on (``X-Session-ID``, ``metadata.rollout_id`` in
the body, or a proxy started without the header setting) is forwarded once, through this
deployment's own handle with the rollout id as session id, to the replica that owns it; the
answer is still formatted here. A forwarded turn the owner has not accepted within
``service.forward_accept_timeout_s``, or whose stream then stays silent that long (the owner sends
a heartbeat every ``service.forward_heartbeat_s`` while a turn is quiet), is cancelled and run
here. Reads (rollout, view, tokenize) and deletes run on the replica that received them, from the
store. Correctness never depends on
the routing: history is in the store and appends are conditional on the turn counter; routing
keeps the per-replica state cache hot and concurrent calls of one rollout on one replica.

The engines are owned by the detached engine fleet (:mod:`rollout_service.fleet`), which each
replica looks up (or creates) on start, so the app works the same under ``serve run`` and
``serve deploy``. The data plane never imports the control plane (``refit/``).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import dataclasses
import logging
import os
import re
import time
import uuid
from typing import Any, AsyncIterator

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from ray import serve
from ray.serve.config import RequestRouterConfig
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from rollout_service.config import RolloutServiceConfig
from rollout_service.metrics import RequestObservation, get_metrics
from rollout_service.protocol.openai import (
    ChatCompletionRequest,
    CompletionRequest,
    ErrorResponse,
    ResponsesRequest,
    ServiceError,
    TokenizeRequest,
    bad_request,
)
from rollout_service.serve.dialects import chat, completions, responses
from rollout_service.serve.dialects.common import RolloutHeaders, RolloutIdPath, rollout_headers, unicode_body
from rollout_service.serve.routing import ROUTER_CLASS
from rollout_service.serve.turn_types import (
    TokenDelta,
    TurnAccepted,
    TurnError,
    TurnHeartbeat,
    TurnRequest,
    TurnResult,
)

logger = logging.getLogger(__name__)

DEPLOYMENT_NAME = "RolloutService"
ROLLOUT_HEADER = "x-rollout-id"
# The Serve proxy reads this before it starts; every launch mode sets it (runtime.RAY_ENV, the
# KubeRay manifests, docs for `serve run` / `serve deploy`).
SESSION_HEADER_ENV = "RAY_SERVE_SESSION_ID_HEADER_KEY"
os.environ.setdefault(SESSION_HEADER_ENV, ROLLOUT_HEADER)  # `serve run <import path>` imports this before ray.init
HAPROXY_ENV = "RAY_SERVE_ENABLE_HA_PROXY"


def haproxy_mode() -> bool:
    """Serve's HAProxy ingress (``RAY_SERVE_ENABLE_HA_PROXY=1`` before Ray starts): HAProxy hashes
    ``X-Rollout-Id`` to a replica that serves HTTP itself; no custom request router is allowed."""
    return os.environ.get(HAPROXY_ENV) == "1"


def resolve_config(args: dict[str, Any] | RolloutServiceConfig | None) -> RolloutServiceConfig:
    """Config from Serve args, with environment overrides for secrets and the Redis URL."""
    cfg = args if isinstance(args, RolloutServiceConfig) else RolloutServiceConfig.from_args(args)
    cfg = cfg.model_copy(deep=True)
    if os.environ.get("ROLLOUT_SERVICE_REDIS_URL"):
        cfg.store.redis_url = os.environ["ROLLOUT_SERVICE_REDIS_URL"]
    if os.environ.get("ROLLOUT_SERVICE_API_KEY"):
        cfg.service.api_key = os.environ["ROLLOUT_SERVICE_API_KEY"]
    return cfg


# ---------------------------------------------------------------------------------------- HTTP app
class _Guard:
    """Pure ASGI middleware: API key and body size, checked before a body is read or parsed."""

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
        if _Guard.api_key and path != "/health" and headers.get("authorization", "") != f"Bearer {_Guard.api_key}":
            return await _send_error(send, ServiceError(401, "invalid or missing API key", type="authentication_error",
                                                        code="invalid_api_key"))
        length = headers.get("content-length")
        limit = _Guard.max_bytes
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


class _BodyTooLarge(Exception):
    pass


def _too_large(limit: int) -> ServiceError:
    return ServiceError(413, f"request body larger than {limit} bytes", code="request_too_large")


async def _send_error(send, exc: ServiceError) -> None:
    body = JSONResponse(exc.envelope()).body
    await send({"type": "http.response.start", "status": exc.status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


_REQUEST: contextvars.ContextVar[RequestObservation | None] = contextvars.ContextVar("rollout_request", default=None)


class _Metered:
    """Pure ASGI middleware, outermost: every HTTP request's route, status and latency, and what its
    call generated (filled in by :func:`_observed`), recorded once it has been answered
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
            get_metrics().request(_route_of(scope), status, time.perf_counter() - obs.t0, obs)


def _route_of(scope) -> str:
    """The route's path template (``/v1/rollouts/{rollout_id}``: bounded label values); for a request
    refused before routing (401, 413) the route it would have reached; ``unmatched`` for none."""
    path = getattr(scope.get("route"), "path", None)
    if path:
        return path
    for route in getattr(scope.get("app"), "routes", ()):
        try:
            if route.matches(scope)[0] != Match.NONE:
                return route.path
        except Exception:
            continue
    return "unmatched"


async def _observed(events: AsyncIterator, stream: bool) -> AsyncIterator:
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


async def _with_heartbeats(events: AsyncIterator, every_s: float) -> AsyncIterator:
    """``events``, with a :class:`TurnHeartbeat` whenever ``every_s`` seconds pass without one."""
    pending: asyncio.Future | None = None
    try:
        while True:
            pending = asyncio.ensure_future(events.__anext__())
            while not (await asyncio.wait({pending}, timeout=every_s))[0]:
                yield TurnHeartbeat()
            done, pending = pending, None
            try:
                event = done.result()
            except StopAsyncIteration:
                return
            yield event
    finally:
        if pending is not None:  # closed or cancelled while waiting: stop the turn (its finally blocks run)
            pending.cancel()
            await asyncio.gather(pending, return_exceptions=True)
        await events.aclose()


async def _next_within(events: AsyncIterator, timeout: float):
    """The next event of a forwarded call, or ``asyncio.TimeoutError`` after ``timeout`` seconds.
    Unlike ``asyncio.wait_for`` it does not wait for the abandoned read to finish cancelling: a read
    of Serve's handle generator is not promised to give up promptly, and the sender's deadline is
    the point of the timeout."""
    read = asyncio.ensure_future(events.__anext__())
    try:
        done, _ = await asyncio.wait({read}, timeout=timeout)
    except asyncio.CancelledError:
        read.cancel()
        raise
    if not done:
        read.cancel()
        read.add_done_callback(lambda t: t.cancelled() or t.exception())  # its late outcome, unheard
        raise asyncio.TimeoutError
    return read.result()


def _abandon(events) -> None:
    """Cancel a forwarded call without blocking this replica's loop: Serve's
    ``DeploymentResponseGenerator.cancel`` resolves the replica synchronously and calls ``ray.cancel``,
    so it runs on a worker thread (the handle's router lives in its own loop: thread-safe)."""

    def cancel() -> None:
        try:
            events.cancel()
        except Exception as exc:  # already finished, or the owner is gone
            logger.debug("cancelling a forwarded call: %s", exc)

    asyncio.get_running_loop().run_in_executor(None, cancel)


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
_ERROR_MEANINGS = {
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


def _errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """``responses=`` of a route: the error statuses it can answer, each with the envelope's schema."""
    return {status: {"model": ErrorResponse, "description": _ERROR_MEANINGS[status]} for status in statuses}


# With "stream": true a generation answers server-sent events.
_STREAMED = {200: {"description": "The answer; server-sent events with \"stream\": true.",
                   "content": {"text/event-stream": {"schema": {"type": "string"}}}}}
_TURN_ERRORS = {**_STREAMED, **_errors(400, 401, 404, 409, 413, 422, 500, 503, 507)}
_ROLLOUT_ERRORS = _errors(400, 401, 404, 503)


def _openapi_without_validation_errors(app: FastAPI):
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
    app.add_middleware(_Guard)
    app.add_middleware(_Metered)  # added last: outermost, so refusals by _Guard are counted too

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

    app.openapi = _openapi_without_validation_errors(app)
    return app


fastapi_app = create_app()


async def _guard_events(events: AsyncIterator) -> AsyncIterator:
    """Unexpected failures of a call as ServiceErrors: 503 when an engine or replica is gone, else 500."""
    try:
        async for event in events:
            yield event
    except ServiceError:
        raise
    except Exception as exc:
        status, envelope = _unexpected(exc)
        raise ServiceError.from_result({"__error__": status, **envelope}) from None


async def _safe_stream(dialect, frames: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """A failure while formatting a stream ends it with the dialect's error event, not a cut connection."""
    try:
        async for frame in frames:
            yield frame
    except Exception as exc:
        status, envelope = _unexpected(exc)
        yield dialect.error_frame(ServiceError.from_result({"__error__": status, **envelope}))


def _unexpected(exc: Exception) -> tuple[int, dict[str, Any]]:
    import ray.exceptions as rex

    from rollout_service.fleet.client import is_engine_death

    if isinstance(exc, (rex.RayActorError, rex.ActorUnavailableError)) or is_engine_death(exc):
        err = ServiceError(503, f"a replica or engine became unavailable, retry: {type(exc).__name__}",
                           type="service_unavailable", code="replica_unavailable")
    else:
        logger.exception("unhandled error", exc_info=exc)
        err = ServiceError(500, f"{type(exc).__name__}: {exc}"[:500], type="server_error")
    return err.status, err.envelope()


# The viewer's page loads nothing and runs nothing: token text is escaped, and this makes sure.
_VIEWER_HEADERS = {"content-security-policy": "default-src 'none'; style-src 'unsafe-inline'",
                   "x-content-type-options": "nosniff"}


def _path_rollout_id(rollout_id: str) -> str:
    from rollout_service.serve.dialects.common import _valid_rollout_id

    return _valid_rollout_id(rollout_id, "rollout_id")


def _cached(store, max_rollouts: int):
    """The replica's bounded in-memory state cache over the durable store (when enabled)."""
    if not max_rollouts:
        return store
    try:
        from rollout_service.store.cache import CachedRolloutStore
    except ImportError:  # pragma: no cover
        return store
    return CachedRolloutStore(store, max_rollouts=max_rollouts)


# ---------------------------------------------------------------------------------------- deployment
@serve.ingress(fastapi_app)
class RolloutService:
    """HTTP dialects + the turn runner for the rollouts routed to this replica."""

    def __init__(self, config: dict[str, Any]):
        self.config = resolve_config(config)
        _Guard.api_key = self.config.service.api_key
        _Guard.max_bytes = self.config.service.max_request_bytes
        self.served_name = self.config.engine.resolved_served_name()
        self.model_root = self.config.engine.resolved_model()
        self._runner = None
        self._init_lock = asyncio.Lock()
        self._self_handle = None
        self._warned_routing = False
        self.forwarded = 0
        self.forward_fallbacks = 0  # forwarded turns given up (not accepted in time, or gone silent)
        self.haproxy = haproxy_mode()
        try:
            context = serve.get_replica_context()
            self.replica_id, self.app_name = context.replica_id.unique_id, context.app_name
        except Exception:
            self.replica_id, self.app_name = uuid.uuid4().hex[:8], None
        try:  # warm up now (tokenizer, fleet, store), not on the first request
            self._warmup = asyncio.get_running_loop().create_task(self._ready())
        except RuntimeError:
            self._warmup = None

    async def _ready(self):
        if self._runner is not None:
            return self._runner
        async with self._init_lock:
            if self._runner is None:
                from transformers import AutoTokenizer

                from rollout_service.fleet.client import connect
                from rollout_service.fleet.fleet import get_or_create_fleet
                from rollout_service.serve.turns import TurnRunner
                from rollout_service.store.redis_store import RedisRolloutStore

                if not self.config.store.redis_url:
                    raise ServiceError(503, "store.redis_url is not configured", type="service_unavailable")
                fleet = get_or_create_fleet(self.config)
                changed = await fleet.ensure_config.remote(self.config.model_dump())
                if changed:
                    logger.warning("engine config changed (%s): the fleet restarted its engines", ", ".join(changed))
                if self.app_name:
                    await fleet.attach_app.remote(self.app_name)
                await fleet.start.remote()
                tokenizer = AutoTokenizer.from_pretrained(self.config.engine.resolved_model())
                store = _cached(RedisRolloutStore.from_config(self.config.store), self.config.service.state_cache_rollouts)
                runner = TurnRunner(self.config, await connect(fleet), store, tokenizer)
                try:
                    await asyncio.to_thread(runner.warm)
                except Exception:  # a cold first call is slower, not wrong
                    logger.warning("warm-up of the turn runner failed", exc_info=True)
                self._runner = runner
        return self._runner

    async def _runner_or_503(self):
        try:
            return await self._ready()
        except ServiceError:
            raise
        except Exception as exc:
            raise ServiceError(503, f"not ready: {type(exc).__name__}: {exc}"[:500], type="service_unavailable") from None

    # ------------------------------------------------------------------ routing
    def _owns(self, rollout_id: str) -> bool:
        """True when the router placed this request by its rollout id (we are the owning replica).

        Under HAProxy every replica owns what reaches it: HAProxy's hash is the only placement (a
        handle call could not reach the replica it picked), and the store keeps a call on another
        replica exact."""
        if self.haproxy:
            return True
        try:
            session = serve.context._get_serve_request_context().session_id
        except Exception:
            return False
        return session == rollout_id

    def _owner(self, rollout_id: str, *, stream: bool):
        if self._self_handle is None:
            self._self_handle = serve.get_deployment_handle(DEPLOYMENT_NAME, app_name=self.app_name)
        self.forwarded += 1
        return self._self_handle.options(session_id=rollout_id, stream=stream)

    def _note_forward(self, request: Request, rollout_id: str) -> None:
        if not self._warned_routing and request.headers.get(ROLLOUT_HEADER) == rollout_id:
            self._warned_routing = True
            logger.warning("the Serve proxy did not route X-Rollout-Id to its replica: start Ray with %s=%s (every "
                           "call now takes one extra internal hop)", SESSION_HEADER_ENV, ROLLOUT_HEADER)

    async def _events(self, turn: TurnRequest, request: Request) -> AsyncIterator:
        """The runner's events for a turn, run here or on the replica that owns its rollout."""
        if turn.rollout_id is None or self._owns(turn.rollout_id):
            async for event in self._local_events(turn):
                yield event
            return
        self._note_forward(request, turn.rollout_id)
        timeout = self.config.service.forward_accept_timeout_s
        # The owner starts the turn only before half the timeout has passed, so an acceptance is back
        # here before this side gives up: the turn never runs on both (clocks of one cluster agree to
        # well under that; if they did not, one of the two conditional appends would lose: a 409).
        events = self._owner(turn.rollout_id, stream=True).run_forwarded.remote(
            turn, time.time() + timeout / 2, self.config.service.forward_heartbeat_s)
        try:
            await _next_within(events, timeout)  # run_forwarded's TurnAccepted
        except (asyncio.TimeoutError, StopAsyncIteration):
            # No acceptance in time. Measured (docs/data-plane.md): about 1 in 200 forwarded turns
            # whose owner ran and stored the turn but whose streamed events never came back through
            # Serve's handle; or the call was refused there as too late.
            _abandon(events)
            async for event in self._fallback_events(turn, "not-accepted",
                                                     f"not accepted by its owner within {timeout:.1f} s"):
                yield event
            return
        streamed = answered = False
        while True:
            # The owner sends a heartbeat whenever the turn is quiet for forward_heartbeat_s, so
            # silence for the whole timeout means the stream is lost, not that the turn is slow.
            try:
                event = await _next_within(events, timeout)
            except StopAsyncIteration:
                return
            except asyncio.TimeoutError:
                if answered:  # only the stream's end is missing: the answer is here
                    return
                _abandon(events)  # the owner's turn stops there (its engine call is aborted) if it is still running
                if streamed:  # the client has part of the answer: it must retry (answered from the store)
                    self.forward_fallbacks += 1
                    logger.warning("forwarded turn of rollout %s: its owner's stream went silent for %.1f s after "
                                   "deltas were sent: ending the stream with a retryable error", turn.rollout_id,
                                   timeout)
                    raise ServiceError(503, f"the replica owning rollout {turn.rollout_id!r} stopped answering; retry "
                                       "(a turn it stored is answered from the store)", type="service_unavailable",
                                       code="forward_lost")
                async for event in self._fallback_events(turn, "silent", f"its owner's stream silent for {timeout:.1f} s"):
                    yield event
                return
            if isinstance(event, TurnHeartbeat):
                continue
            if isinstance(event, TurnError):
                raise ServiceError.from_result({"__error__": event.status, **event.envelope})
            if isinstance(event, TokenDelta):
                streamed = True
            elif isinstance(event, TurnResult):
                answered = True
            yield event

    async def _fallback_events(self, turn: TurnRequest, reason: str, why: str) -> AsyncIterator:
        """A forwarded turn given up (``reason``: not-accepted | silent) runs here, exact from the
        store: a turn the owner stored is answered from it (replayed), never run twice or forked; one
        the owner is still running (its cancellation lost too) meets the conditional append: one of
        the two is a 409, and a retry is answered from the store."""
        self.forward_fallbacks += 1
        logger.warning("forwarded turn of rollout %s %s: running it here", turn.rollout_id, why)
        async for event in self._local_events(dataclasses.replace(turn, replay_if_stored=True)):
            if isinstance(event, TurnResult):
                event.forward_fallback = reason
            yield event

    async def _local_events(self, turn: TurnRequest) -> AsyncIterator:
        runner = await self._runner_or_503()
        async for event in runner.run_turn(turn):
            if isinstance(event, TurnResult):
                event.replica = self.replica_id
            yield event

    async def run_forwarded(self, turn: TurnRequest, accept_by: float | None = None, heartbeat_s: float | None = None):
        """A turn forwarded by another replica (this one owns its rollout); errors travel as data.
        The first event says it was accepted (:class:`TurnAccepted`); after ``accept_by`` (epoch
        seconds) it is refused with no event: the sender runs it itself. Then the turn's events,
        with a :class:`TurnHeartbeat` after every ``heartbeat_s`` without one."""
        if accept_by is not None and time.time() > accept_by:
            logger.warning("forwarded turn of rollout %s arrived %.3f s after its acceptance deadline: left to "
                           "the replica that received it", turn.rollout_id, time.time() - accept_by)
            return
        yield TurnAccepted(self.replica_id)
        try:
            events = self._local_events(turn)
            if heartbeat_s:
                events = _with_heartbeats(events, heartbeat_s)
            async with contextlib.aclosing(events):
                async for event in events:
                    yield event
        except ServiceError as exc:
            yield TurnError(exc.status, exc.envelope())
        except Exception as exc:
            yield TurnError(*_unexpected(exc))

    async def _read(self, op: str, kwargs: dict[str, Any]):
        """A rollout read / delete / tokenize, on this replica: the store is the truth (an owner's
        cached copy is revalidated against it on its next load), so these are never forwarded."""
        return await getattr(await self._runner_or_503(), op)(**kwargs)

    # ------------------------------------------------------------------ dialect plumbing
    def _check_model(self, model: str | None) -> None:
        if model is not None and model not in (self.served_name, self.model_root):
            raise ServiceError(404, f"The model `{model}` does not exist; this service serves `{self.served_name}`.",
                               type="not_found_error", param="model", code="model_not_found")

    async def _answer(self, events: AsyncIterator, dialect, req, stream: bool):
        events = _guard_events(_observed(events, stream))
        first = await events.__anext__()  # an error raises here, before any byte is sent
        if stream:
            return StreamingResponse(_safe_stream(dialect, dialect.stream(first, events, req, self.served_name)),
                                     media_type="text/event-stream",
                                     headers={"x-rollout-replica": self.replica_id})
        event = first
        try:
            while not isinstance(event, TurnResult):
                event = await events.__anext__()
        finally:
            await events.aclose()  # the call's cleanup runs now, not whenever the generator is collected
        body = dialect.response(event, req, self.served_name)
        headers = {"x-rollout-replica": self.replica_id}
        if event.replica:
            headers["x-rollout-owner"] = event.replica
        if event.forward_fallback:
            headers["x-rollout-forward"] = "fallback"
            headers["x-rollout-forward-reason"] = event.forward_fallback
        return Response(body.model_dump_json(exclude_unset=True), media_type="application/json", headers=headers)

    # ------------------------------------------------------------------ routes
    @fastapi_app.post("/v1/chat/completions", responses=_TURN_ERRORS)
    async def chat_completions(self, body: ChatCompletionRequest, request: Request,
                               headers: RolloutHeaders = Depends(rollout_headers)):
        self._check_model(body.model)
        turn = chat.turn_request(body, headers)
        return await self._answer(self._events(turn, request), chat, body, body.stream)

    @fastapi_app.post("/v1/responses", responses=_TURN_ERRORS)
    async def responses(self, body: ResponsesRequest, request: Request,
                        headers: RolloutHeaders = Depends(rollout_headers)):
        self._check_model(body.model)
        turn = responses.turn_request(body, headers)
        return await self._answer(self._events(turn, request), responses, body, body.stream)

    @fastapi_app.post("/v1/completions", responses={**_STREAMED, **_errors(400, 401, 404, 413, 500, 503)})
    async def completions(self, body: CompletionRequest):
        self._check_model(body.model)
        runner = await self._runner_or_503()
        return await self._answer(runner.run_completion(completions.call(body)), completions, body, body.stream)

    @fastapi_app.post("/tokenize", responses=_errors(400, 401, 404, 409, 413, 503))
    async def tokenize(self, body: TokenizeRequest, headers: RolloutHeaders = Depends(rollout_headers)):
        self._check_model(body.model)
        body.refuse_unhonoured()
        rid = headers.with_body_rollout_id(body.metadata).rollout_id
        kwargs = {"rollout_id": rid, "prompt": body.prompt,
                  "messages": [m.to_plain() for m in body.messages] if body.messages is not None else None,
                  "tools": [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None,
                  "chat_template_kwargs": body.chat_template_kwargs, "add_special_tokens": body.add_special_tokens,
                  "return_token_strs": body.return_token_strs,
                  "required_prefix_token_ids": body.required_prefix_token_ids}
        return JSONResponse(await self._read("tokenize", kwargs))

    @fastapi_app.get("/v1/rollouts/{rollout_id}", responses=_ROLLOUT_ERRORS)
    async def get_rollout(self, rollout_id: RolloutIdPath):
        return JSONResponse(await self._read("get_rollout", {"rollout_id": _path_rollout_id(rollout_id)}))

    @fastapi_app.delete("/v1/rollouts/{rollout_id}", responses=_ROLLOUT_ERRORS)
    async def delete_rollout(self, rollout_id: RolloutIdPath):
        return JSONResponse(await self._read("delete_rollout", {"rollout_id": _path_rollout_id(rollout_id)}))

    @fastapi_app.get("/rollouts/{rollout_id}/view", response_class=HTMLResponse, responses=_ROLLOUT_ERRORS)
    async def view_rollout(self, rollout_id: RolloutIdPath):
        """The trajectory viewer: one self-contained page; the policy forbids anything external or scripted."""
        page = await self._read("view_rollout", {"rollout_id": _path_rollout_id(rollout_id)})
        return HTMLResponse(page, headers=_VIEWER_HEADERS)

    @fastapi_app.get("/v1/status", responses=_errors(401, 503))
    async def status(self):
        """Operator's view (``rollout-service status``): engines, the last refit, stored rollouts.

        Any replica answers. A part that cannot be read (fleet or store down) is reported in
        ``errors`` and the rest is still returned: a status page must work when things are broken."""
        runner = await self._runner_or_503()
        errors: dict[str, str] = {}
        fleet: dict[str, Any] = {}
        try:
            fleet = await asyncio.wait_for(runner.fleet.fleet.stats.remote(), timeout=15)
        except Exception as exc:
            errors["fleet"] = f"{type(exc).__name__}: {exc}"[:300]
        stored = None
        try:
            stored = await asyncio.wait_for(runner.count_rollouts(), timeout=30)
        except Exception as exc:
            errors["store"] = f"{type(exc).__name__}: {getattr(exc, 'message', exc)}"[:300]
        engines = [{"slot": s.get("slot"), "state": s.get("state"), "weight_version": s.get("weight_version"),
                    "in_flight": s.get("load", 0), "generation": s.get("generation"),
                    "replacements": s.get("replacements", 0), "last_error": s.get("last_error"),
                    "node_id": s.get("node_id")} for s in fleet.get("slots", [])]
        return JSONResponse({
            "object": "service.status", "model": self.served_name, "replica": self.replica_id,
            "weight_version": fleet.get("weight_version"), "fleet_epoch": fleet.get("epoch"),
            "refitting": fleet.get("refitting"), "engines": engines,
            "last_refit": fleet.get("last_refit"), "refits": fleet.get("refits"),
            "rollouts": {"stored": stored, "key_prefix": self.config.store.key_prefix,
                         "in_flight_on_replica": len(runner.in_flight)},
            "errors": errors,
        })

    @fastapi_app.get("/v1/models", responses=_errors(401))
    async def models(self):
        return JSONResponse({"object": "list", "data": [{
            "id": self.served_name, "object": "model", "created": int(time.time()), "owned_by": "rollout-service",
            "root": self.model_root, "parent": None, "max_model_len": self.config.engine.max_model_len,
        }]})

    @fastapi_app.head("/health", responses=_errors(503))  # load balancers probe with either
    @fastapi_app.get("/health", responses=_errors(503))
    async def health(self):
        try:
            runner = await asyncio.wait_for(self._ready(), timeout=30)
            store_ok = await runner.store.ping()
        except Exception as exc:
            raise ServiceError(503, f"not ready: {type(exc).__name__}: {exc}"[:500], type="service_unavailable") from None
        view = runner.fleet.view
        info = {"replica": self.replica_id, "store": store_ok, "engines_alive": len(runner.fleet.members()),
                "fleet_epoch": view.epoch if view else None, "weight_version": view.version if view else None,
                "forwarded_calls": self.forwarded, "forward_fallbacks": self.forward_fallbacks, "ingress": "haproxy" if self.haproxy else "serve"}
        if not store_ok or not info["engines_alive"]:
            raise ServiceError(503, f"not ready: {info}", type="service_unavailable")
        return JSONResponse({"status": "ok", **info})


def build_app(args: dict[str, Any] | RolloutServiceConfig | None = None):
    """Serve application builder: ``serve run rollout_service.serve.app:build_app`` or a config file."""
    cfg = resolve_config(args)
    options: dict[str, Any] = {}
    if not haproxy_mode():  # HAProxy refuses a custom router on the ingress; it hashes X-Rollout-Id itself
        options["request_router_config"] = RequestRouterConfig(
            request_router_class=ROUTER_CLASS,  # Ray's ConsistentHashRouter with Ray's routing loop (serve/routing.py)
            request_router_kwargs={"num_fallback_replicas": 0},
        )
    deployment = serve.deployment(
        name=DEPLOYMENT_NAME,
        num_replicas=cfg.service.num_affinity_replicas,
        max_ongoing_requests=1024,
        ray_actor_options={"num_cpus": 0},
        logging_config={"enable_access_log": cfg.service.access_log},
        **options,
    )(RolloutService)
    return deployment.bind(cfg.model_dump())
