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
import dataclasses
import json
import logging
import os
import time
import uuid
from typing import Any, AsyncIterator

from fastapi import Depends, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from ray import serve
from ray.serve.config import RequestRouterConfig

from rollout_service.canary.stats import status_of as canary_status
from rollout_service.config import RolloutServiceConfig
from rollout_service.fleet.routing import effective_policy, make_policy
from rollout_service.serve.protocol.envelope import ServiceError
from rollout_service.serve.protocol.openai import (
    AbortRequest,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ResponsesRequest,
    TokenizeRequest,
)
from rollout_service.serve.dialects import chat, completions, responses, tokens
from rollout_service.serve.dialects.common import RolloutHeaders, RolloutIdPath, rollout_headers, valid_rollout_id
from rollout_service.serve.fanout import check_n, child_sampling, group_turns, merge_answers, merged_stream
from rollout_service.serve.forwarding import ForwardingReplica
from rollout_service.serve.http import (
    ROLLOUT_ERRORS,
    STREAMED,
    TURN_ERRORS,
    VIEWER_HEADERS,
    Guard,
    create_app,
    errors_doc,
    guard_events,
    observed,
    require_api_key,
    safe_stream,
)
from rollout_service.serve.routing import DEPLOYMENT_NAME, ROLLOUT_HEADER, ROUTER_CLASS, SESSION_HEADER_ENV, haproxy_mode
from rollout_service.serve.turn_types import (
    TurnRequest,
    TurnResult,
)

logger = logging.getLogger(__name__)

os.environ.setdefault(SESSION_HEADER_ENV, ROLLOUT_HEADER)  # `serve run <import path>` imports this before ray.init


def resolve_config(args: dict[str, Any] | RolloutServiceConfig | None) -> RolloutServiceConfig:
    """Config from Serve args, with environment overrides for secrets and the Redis URL."""
    cfg = args if isinstance(args, RolloutServiceConfig) else RolloutServiceConfig.from_args(args)
    cfg = cfg.model_copy(deep=True)
    if os.environ.get("ROLLOUT_SERVICE_REDIS_URL"):
        cfg.store.redis_url = os.environ["ROLLOUT_SERVICE_REDIS_URL"]
    if os.environ.get("ROLLOUT_SERVICE_API_KEY"):
        cfg.service.api_key = os.environ["ROLLOUT_SERVICE_API_KEY"]
    return cfg


fastapi_app = create_app()
KEYED = [Depends(require_api_key)]  # every route but /health: probes need no key


def _path_rollout_id(rollout_id: str) -> str:
    return valid_rollout_id(rollout_id, "rollout_id")


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
class RolloutService(ForwardingReplica):
    """HTTP dialects + the turn runner for the rollouts routed to this replica."""

    def __init__(self, config: dict[str, Any]):
        self.config = resolve_config(config)
        Guard.api_key = self.config.service.api_key
        Guard.max_bytes = self.config.service.max_request_bytes
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

                from rollout_service.canary.canary import Canary
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
                routing = self.config.routing
                policy = make_policy(routing.policy, load_margin=routing.load_margin,
                                     prefix_caching=self.config.engine.enable_prefix_caching)
                client = await connect(fleet, policy=policy, resolve=lambda: get_or_create_fleet(self.config),
                                       call_deadline_s=self.config.fleet.call_deadline_s,
                                       call_deadline_s_per_token=self.config.fleet.call_deadline_s_per_token,
                                       nonstream_progress_s=self.config.fleet.nonstream_progress_s,
                                       load_margin=routing.load_margin)
                client.on_fleet_restart.append(lambda: self._reattach(client))
                canary = None
                if self.config.canary.sample_fraction > 0:
                    canary = Canary(self.config.canary, client, self.replica_id, max_top=self.config.engine.max_logprobs,
                                    logprobs_mode=self.config.engine.logprobs_mode)
                runner = TurnRunner(self.config, client, store, tokenizer, canary=canary)
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

    async def _local_events(self, turn: TurnRequest) -> AsyncIterator:
        runner = await self._runner_or_503()
        async for event in runner.run_turn(turn):
            if isinstance(event, TurnResult):
                event.replica = self.replica_id
            yield event

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
        events = guard_events(observed(events, stream))
        first = await events.__anext__()  # an error raises here, before any byte is sent
        if stream:
            return StreamingResponse(safe_stream(dialect, dialect.stream(first, events, req, self.served_name)),
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
        dump = getattr(dialect, "DUMP_OPTIONS", {"exclude_unset": True})
        return Response(body.model_dump_json(**dump), media_type="application/json", headers=headers)

    async def _answer_many(self, calls: list, dialect, req, stream: bool, prompt_of: list[int]):
        """Several choices in one answer (serve/fanout.py): each choice one call (``calls``: their
        event streams, in choice order), answered together; any call's error before the first byte
        is the answer's."""
        tasks = [asyncio.ensure_future(self._answer(events, dialect, req, stream)) for events in calls]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        finally:
            failed = next((t.exception() for t in tasks if t.done() and not t.cancelled() and t.exception()), None)
            if failed is not None or any(not t.done() for t in tasks):  # an error, or this call was cancelled
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                for events in calls:  # the choices' calls end (their engine requests aborted)
                    try:
                        await events.aclose()
                    except Exception:  # already ended with its own error
                        pass
        if failed is not None:
            raise failed
        answers = [t.result() for t in tasks]
        if stream:
            options = getattr(req, "stream_options", None) or {}
            include_usage = bool(options.get("include_usage") if isinstance(options, dict)
                                 else getattr(options, "include_usage", False))
            return StreamingResponse(merged_stream([a.body_iterator for a in answers], prompt_of, include_usage,
                                                   firsts_in_order=dialect is chat),
                                     media_type="text/event-stream", headers={"x-rollout-replica": self.replica_id})
        merged = merge_answers([json.loads(a.body) for a in answers], prompt_of)
        return Response(json.dumps(merged, separators=(",", ":"), ensure_ascii=False), media_type="application/json",
                        headers={"x-rollout-replica": self.replica_id})

    async def _answer_group(self, turn, n: int, request: Request, dialect, body):
        """``n > 1`` choices of one prompt: vLLM's child calls; under a rollout id ``R`` each the first
        call of its own rollout ``R/j``, all of one group (serve/fanout.py)."""
        if turn.rollout_id is None:
            turns = [dataclasses.replace(turn, sampling=child_sampling(turn.sampling, j)) for j in range(n)]
            return await self._answer_many([self._events(t, request) for t in turns], dialect, body, turn.stream,
                                           [0] * n)
        turns = group_turns(turn, n)
        if self.haproxy and request.headers.get(ROLLOUT_HEADER) != turn.rollout_id:
            # HAProxy hashed no rollout id: the call's retry may reach another replica (serve/shared_claims.py)
            turns = [dataclasses.replace(t, shared_claim=True) for t in turns]
        # every member on the group's record before any runs: an abort of the group right after
        # this call started reaches them all (each aborted before its first turn if need be)
        await (await self._runner_or_503()).note_group(turns[0].rollout_group, [t.rollout_id for t in turns], "running")
        # The members' first calls run here, not on their owners: nothing of theirs is cached anywhere
        # yet, the store decides (conditional appends), and one hop per member would only add latency
        # (their later calls reach their owners as any call does).
        return await self._answer_many([self._local_events(t) for t in turns], dialect, body, turn.stream, [0] * n)

    # ------------------------------------------------------------------ routes
    @fastapi_app.post("/v1/chat/completions", responses=TURN_ERRORS, dependencies=KEYED)
    async def chat_completions(self, body: ChatCompletionRequest, request: Request,
                               headers: RolloutHeaders = Depends(rollout_headers)):
        self._check_model(body.model)
        turn = chat.turn_request(body, headers)
        n = check_n(body.n, self.config.service.max_n)
        if n > 1:
            return await self._answer_group(turn, n, request, chat, body)
        return await self._answer(self._events(turn, request), chat, body, body.stream)

    @fastapi_app.post("/v1/responses", responses=TURN_ERRORS, dependencies=KEYED)
    async def responses(self, body: ResponsesRequest, request: Request,
                        headers: RolloutHeaders = Depends(rollout_headers)):
        self._check_model(body.model)
        turn = responses.turn_request(body, headers)
        return await self._answer(self._events(turn, request), responses, body, body.stream)

    @fastapi_app.post("/v1/completions", responses={**STREAMED, **errors_doc(400, 401, 404, 413, 500, 503)}, dependencies=KEYED)
    async def completions(self, body: CompletionRequest):
        self._check_model(body.model)
        runner = await self._runner_or_503()
        call = completions.call(body)
        prompts = body.prompts()
        n = check_n(body.n, self.config.service.max_n, len(prompts))
        if n == 1 and len(prompts) == 1:
            return await self._answer(runner.run_completion(call), completions, body, body.stream)
        calls = [runner.run_completion(dataclasses.replace(call, prompt=prompt, sampling=child_sampling(call.sampling, j)))
                 for prompt in prompts for j in range(n)]
        return await self._answer_many(calls, completions, body, body.stream, [p for p in range(len(prompts)) for _ in range(n)])

    @fastapi_app.post(tokens.ROUTE, responses=TURN_ERRORS, dependencies=KEYED,
                      openapi_extra={"requestBody": {"required": True, "content": {"application/json": {
                          "schema": tokens.REQUEST_SCHEMA}}}})
    async def generate_tokens(self, request: Request, headers: RolloutHeaders = Depends(rollout_headers)):
        """vLLM's token-in-token-out route (docs/data-plane.md "Token in, token out")."""
        turn, body = tokens.turn_request(await tokens.json_body(request), headers, request.headers.get("x-request-id"))
        self._check_model(body.model)
        n = check_n(body.sampling_params.n, self.config.service.max_n, param="sampling_params.n")
        if n > 1:
            return await self._answer_group(turn, n, request, tokens, body)
        return await self._answer(self._events(turn, request), tokens, body, turn.stream)

    @fastapi_app.post("/tokenize", responses=errors_doc(400, 401, 404, 409, 413, 503), dependencies=KEYED)
    async def tokenize(self, body: TokenizeRequest, headers: RolloutHeaders = Depends(rollout_headers)):
        self._check_model(body.model)
        rid = headers.with_body_rollout_id(body.metadata).rollout_id
        body.refuse_unhonoured(rid)
        kwargs = {"rollout_id": rid, "prompt": body.prompt,
                  "add_generation_prompt": body.add_generation_prompt,
                  "continue_final_message": body.continue_final_message,
                  "messages": [m.to_plain() for m in body.messages] if body.messages is not None else None,
                  "tools": [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None,
                  "chat_template_kwargs": body.chat_template_kwargs, "add_special_tokens": body.add_special_tokens,
                  "return_token_strs": body.return_token_strs,
                  "required_prefix_token_ids": body.required_prefix_token_ids}
        return JSONResponse(await self._read("tokenize", kwargs))

    @fastapi_app.post("/detokenize", responses=errors_doc(400, 401, 404, 413, 503), dependencies=KEYED)
    async def detokenize(self, body: DetokenizeRequest):
        self._check_model(body.model)
        return JSONResponse(await self._read("detokenize", {"tokens": body.tokens}))

    @fastapi_app.get("/version", responses=errors_doc(500))
    async def version(self):
        """vLLM's: the version of the vLLM this service serves with."""
        from vllm import __version__

        return JSONResponse({"version": __version__})

    @fastapi_app.get("/v1/rollouts", responses=errors_doc(400, 401, 404, 503), dependencies=KEYED)
    async def list_rollouts(self, limit: int = 100, cursor: str | None = None, group: str | None = None):
        """The most recently appended-to rollouts, newest first, a page at a time (``next_cursor``);
        with ``group``: that group's members (``GET /v1/groups/{id}``'s, one page)."""
        if group is not None:
            doc = await self._read("get_group", {"group_id": group, "param": "group"})
            return JSONResponse({"object": "list", "data": doc["members"], "next_cursor": None, "has_more": False,
                                 "group": group})
        return JSONResponse(await self._read("list_rollouts", {"limit": limit, "cursor": cursor}))

    @fastapi_app.post("/v1/groups/{group_id:path}/abort", responses=ROLLOUT_ERRORS, dependencies=KEYED)
    async def abort_group(self, group_id: RolloutIdPath, body: AbortRequest | None = None):
        """Abort every member of a group, each as ``POST /v1/rollouts/{id}/abort`` does (a member still
        on its first call included). Idempotent; 404 for an unknown group."""
        kwargs = {"group_id": group_id, "reason": body.reason if body is not None else None}
        return JSONResponse(await self._read("abort_group", kwargs))

    @fastapi_app.get("/v1/groups/{group_id:path}", responses=ROLLOUT_ERRORS, dependencies=KEYED)
    async def get_group(self, group_id: RolloutIdPath, trajectories: bool = False):
        """A group of rollouts (a call with ``n > 1`` under a rollout id, or X-Rollout-Group): each
        member's state (running, finished, failed, aborted, stale, missing), turns, first and last
        weight version; with ``trajectories=true`` each member's trajectory too."""
        return JSONResponse(await self._read("get_group", {"group_id": group_id, "trajectories": trajectories}))

    @fastapi_app.get("/rollouts", response_class=HTMLResponse, responses=errors_doc(400, 401, 404, 503), dependencies=KEYED)
    async def rollouts_index(self, limit: int = 50, cursor: str | None = None, group: str | None = None):
        """The recent rollouts as a page for people, each linking to its viewer page; with ``group``:
        that group's members."""
        if group is not None:
            return HTMLResponse(await self._read("group_page", {"group_id": group, "param": "group"}),
                                headers=VIEWER_HEADERS)
        return HTMLResponse(await self._read("rollouts_page", {"limit": limit, "cursor": cursor}),
                            headers=VIEWER_HEADERS)

    @fastapi_app.get("/v1/rollouts/{rollout_id:path}", responses=ROLLOUT_ERRORS, dependencies=KEYED)
    async def get_rollout(self, rollout_id: RolloutIdPath):
        return JSONResponse(await self._read("get_rollout", {"rollout_id": _path_rollout_id(rollout_id)}))

    @fastapi_app.delete("/v1/rollouts/{rollout_id:path}", responses=ROLLOUT_ERRORS, dependencies=KEYED)
    async def delete_rollout(self, rollout_id: RolloutIdPath):
        return JSONResponse(await self._read("delete_rollout", {"rollout_id": _path_rollout_id(rollout_id)}))

    @fastapi_app.post("/v1/rollouts/{rollout_id:path}/abort", responses=ROLLOUT_ERRORS, dependencies=KEYED)
    async def abort_rollout(self, rollout_id: RolloutIdPath, body: AbortRequest | None = None):
        """Abort a rollout: its call in flight ends at its engine's next step (``finish_reason`` abort,
        its tokens so far stored), further calls get 409 ``rollout_aborted``, stored turns stay
        readable. Idempotent; 404 for an unknown rollout."""
        kwargs = {"rollout_id": _path_rollout_id(rollout_id), "reason": body.reason if body is not None else None}
        return JSONResponse(await self._read("abort_rollout", kwargs))

    @fastapi_app.get("/rollouts/{rollout_id:path}/view", response_class=HTMLResponse, responses=ROLLOUT_ERRORS, dependencies=KEYED)
    async def view_rollout(self, rollout_id: RolloutIdPath):
        """The trajectory viewer: one self-contained page; the policy forbids anything external or scripted."""
        page = await self._read("view_rollout", {"rollout_id": _path_rollout_id(rollout_id)})
        return HTMLResponse(page, headers=VIEWER_HEADERS)

    @fastapi_app.get("/v1/status", responses=errors_doc(401, 503), dependencies=KEYED)
    async def status(self):
        """Operator's view (``rollout-service status``): engines, the last refit, stored rollouts.

        Any replica answers. A part that cannot be read (fleet or store down) is reported in
        ``errors`` and the rest is still returned: a status page must work when things are broken."""
        runner = await self._runner_or_503()
        errors: dict[str, str] = {}
        actor = runner.fleet.fleet
        fleet, canary_reports = await asyncio.gather(asyncio.wait_for(actor.stats.remote(), timeout=15),
                                                     asyncio.wait_for(actor.canary_reports.remote(), timeout=15),
                                                     return_exceptions=True)
        for part, value in (("fleet", fleet), ("canary", canary_reports)):
            if isinstance(value, BaseException):
                errors[part] = f"{type(value).__name__}: {value}"[:300]
        fleet = fleet if isinstance(fleet, dict) else {}
        canary_reports = canary_reports if isinstance(canary_reports, list) else []
        stored = None
        try:
            stored = await asyncio.wait_for(runner.count_rollouts(), timeout=30)
        except Exception as exc:
            errors["store"] = f"{type(exc).__name__}: {getattr(exc, 'message', exc)}"[:300]
        durability = await self._durability(runner)
        engines = [{"slot": s.get("slot"), "state": s.get("state"), "weight_version": s.get("weight_version"),
                    "in_flight": s.get("load", 0), "generation": s.get("generation"),
                    "replacements": s.get("replacements", 0), "last_error": s.get("last_error"),
                    "node_id": s.get("node_id")} for s in fleet.get("slots", [])]
        return JSONResponse({
            "object": "service.status", "model": self.served_name, "replica": self.replica_id,
            "weight_version": fleet.get("weight_version"), "fleet_epoch": fleet.get("epoch"),
            "refitting": fleet.get("refitting"), "engines": engines, "backend": self.config.engine.backend,
            "routing": {"policy": effective_policy(self.config.routing.policy, self.config.engine.enable_prefix_caching),
                        "configured": self.config.routing.policy, "load_margin": self.config.routing.load_margin,
                        "pin_moves": fleet.get("pin_moves")},
            "last_refit": fleet.get("last_refit"), "refits": fleet.get("refits"),
            "canary": canary_status(canary_reports, enabled=self.config.canary.sample_fraction > 0,
                                    sample_fraction=self.config.canary.sample_fraction,
                                    threshold=self.config.canary.threshold),
            "rollouts": {"stored": stored, "key_prefix": self.config.store.key_prefix,
                         "in_flight_on_replica": len(runner.in_flight), "durability": durability},
            "errors": errors,
        })

    @fastapi_app.get("/v1/models", responses=errors_doc(401), dependencies=KEYED)
    async def models(self):
        return JSONResponse({"object": "list", "data": [{
            "id": self.served_name, "object": "model", "created": int(time.time()), "owned_by": "rollout-service",
            "root": self.model_root, "parent": None, "max_model_len": self.config.engine.max_model_len,
        }]})

    async def _reattach(self, client) -> None:
        """A restarted fleet learns this app's config and name again (it adopted the engines)."""
        try:
            fleet = client.fleet
            await fleet.ensure_config.remote(self.config.model_dump())
            if self.app_name:
                await fleet.attach_app.remote(self.app_name)
            await fleet.start.remote(wait=False)
        except Exception:
            logger.warning("re-attaching to the restarted fleet failed", exc_info=True)

    @fastapi_app.head("/health", responses=errors_doc(503))  # load balancers probe with either
    @fastapi_app.get("/health", responses=errors_doc(503))
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
        if runner.fleet.fleet_error:
            info["fleet"] = f"unreachable: {runner.fleet.fleet_error}"
        if not store_ok or not info["engines_alive"] or runner.fleet.fleet_error:
            raise ServiceError(503, f"not ready: {info}", type="service_unavailable")
        # Ready, but a store short of the replicas store.durability waits for refuses every append
        # (503 store_unavailable): "degraded", still 200, since every replica shares the store and a
        # probe that took them all out would answer clients with nothing instead of that 503.
        info["store_durability"] = await self._durability(runner)
        return JSONResponse({"status": "ok" if info["store_durability"].get("ok") else "degraded", **info})

    async def _durability(self, runner) -> dict[str, Any]:
        try:
            # Bounded well inside a readiness probe's timeout (k8s: 5 s): a WAIT short of replicas
            # returns after replication_timeout_s; anything slower says the store cannot promise now.
            return await asyncio.wait_for(runner.store.durability_status(),
                                          timeout=min(self.config.store.replication_timeout_s + 1.0, 3.0))
        except Exception as exc:  # unreachable or slow: it cannot promise anything now
            return {"durability": self.config.store.durability, "ok": False,
                    "error": f"{type(exc).__name__}: {getattr(exc, 'message', exc)}"[:300]}


def build_app(args: dict[str, Any] | RolloutServiceConfig | None = None):
    """Serve application builder: ``serve run rollout_service.serve.app:build_app`` or a config file."""
    cfg = resolve_config(args)
    options: dict[str, Any] = {}
    if not haproxy_mode():  # HAProxy refuses a custom router on the ingress; it hashes X-Rollout-Id itself
        options["request_router_config"] = RequestRouterConfig(
            request_router_class=ROUTER_CLASS,  # Ray's ConsistentHashRouter with Ray's routing loop (serve/routing.py)
            request_router_kwargs={"num_fallback_replicas": 0},
        )
    if cfg.service.max_replicas_per_node is not None:
        options["max_replicas_per_node"] = cfg.service.max_replicas_per_node
    deployment = serve.deployment(
        name=DEPLOYMENT_NAME,
        num_replicas=cfg.service.num_affinity_replicas,
        max_ongoing_requests=1024,
        ray_actor_options={"num_cpus": 0},
        logging_config={"enable_access_log": cfg.service.access_log},
        **options,
    )(RolloutService)
    return deployment.bind(cfg.model_dump())
