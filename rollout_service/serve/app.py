"""Ray Serve application (import path ``rollout_service.serve.app:build_app``).

Two deployments: ``Ingress`` (FastAPI, HTTP) and ``RolloutAffinity`` (a fixed pool; every request
of a rollout is routed to the same replica by consistent hashing on its rollout id). The engines
are owned by the detached engine fleet (:mod:`rollout_service.fleet`), which the affinity replicas
look up (or create) on start, so the app works the same under ``serve run`` and ``serve deploy``.
Each affinity replica holds a :class:`~rollout_service.fleet.client.FleetClient` (the serving
engines, followed by long poll); the data plane never imports the control plane (``refit/``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
import uuid
from typing import Any, AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve
from ray.serve.config import RequestRouterConfig

from rollout_service.config import RolloutServiceConfig
from rollout_service.protocol.openai import (
    ChatCompletionRequest,
    CompletionRequest,
    ResponsesRequest,
    ServiceError,
    TokenizeRequest,
    bad_request,
)
from rollout_service.protocol.responses import input_to_messages, output_items, response_object, tools_to_chat
from rollout_service.serve.ingress import (
    chat_completion_body,
    chat_logprobs,
    chat_payload,
    create_app,
    error_response,
    read_model,
    rollout_id_of,
    sse,
    tool_choice_payload,
)

logger = logging.getLogger(__name__)

AFFINITY_NAME = "RolloutAffinity"
INGRESS_NAME = "Ingress"


def resolve_config(args: dict[str, Any] | RolloutServiceConfig | None) -> RolloutServiceConfig:
    """Config from Serve args, with environment overrides for secrets and the Redis URL."""
    cfg = args if isinstance(args, RolloutServiceConfig) else RolloutServiceConfig.from_args(args)
    cfg = cfg.model_copy(deep=True)
    if os.environ.get("ROLLOUT_SERVICE_REDIS_URL"):
        cfg.store.redis_url = os.environ["ROLLOUT_SERVICE_REDIS_URL"]
    if os.environ.get("ROLLOUT_SERVICE_API_KEY"):
        cfg.service.api_key = os.environ["ROLLOUT_SERVICE_API_KEY"]
    return cfg


class RolloutAffinity:
    """Hosts a TurnRunner: the on-policy logic for the rollouts routed here. No durable state."""

    def __init__(self, config: dict[str, Any]):
        self.config = RolloutServiceConfig.model_validate(config)
        self._runner = None
        self._init_lock = asyncio.Lock()
        try:
            context = serve.get_replica_context()
            self.replica_id, self.app_name = context.replica_id.unique_id, context.app_name
        except Exception:
            self.replica_id, self.app_name = uuid.uuid4().hex[:8], None
        try:  # warm up now (tokenizer, engine handles, store), not on the first request
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
                store = RedisRolloutStore.from_config(self.config.store)
                self._runner = TurnRunner(self.config, await connect(fleet), store, tokenizer)
        return self._runner

    async def call(self, payload: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        try:
            runner = await self._ready()
        except ServiceError as exc:
            yield exc.to_result()
            return
        source = runner.run_completion(payload) if payload.get("kind") == "completion" else runner.run_call(payload)
        async for event in source:
            event["replica"] = self.replica_id
            if payload.get("want_token_strs") and event.get("kind") in ("delta", "final"):
                event["token_strs"] = _token_strs(runner.tokenizer, event)
            yield event

    async def tokenize(self, payload: dict[str, Any]) -> dict[str, Any]:
        return await (await self._ready()).tokenize(payload)

    async def get_rollout(self, rollout_id: str) -> dict[str, Any]:
        return await (await self._ready()).get_rollout(rollout_id)

    async def delete_rollout(self, rollout_id: str) -> dict[str, Any]:
        return await (await self._ready()).delete_rollout(rollout_id)

    async def health(self) -> dict[str, Any]:
        runner = await self._ready()
        store_ok = await runner.store.ping()
        view = runner.fleet.view
        return {"replica": self.replica_id, "store": store_ok, "engines_alive": len(runner.fleet.members()),
                "fleet_epoch": view.epoch if view else None, "weight_version": view.version if view else None}


def _token_strs(tokenizer, event: dict[str, Any]) -> dict[int, str]:
    ids = set(event.get("generation_token_ids") or event.get("token_ids") or [])
    for top in event.get("top_logprobs") or []:
        ids.update(top or {})
    return {int(i): tokenizer.decode([int(i)]) for i in ids}


class Ingress:
    """Request handling; :class:`HTTPIngress` binds it to the FastAPI routes."""

    def __init__(self, affinity, config: dict[str, Any]):
        self.affinity = affinity
        self.config = resolve_config(config)
        self.api_key = self.config.service.api_key
        self.served_name = self.config.engine.resolved_served_name()
        self.model_root = self.config.engine.resolved_model()
        self.max_bytes = self.config.service.max_request_bytes

    # ------------------------------------------------------------------ helpers
    def _check_model(self, model: str | None) -> None:
        if model is not None and model not in (self.served_name, self.model_root):
            raise ServiceError(404, f"The model `{model}` does not exist; this service serves `{self.served_name}`.",
                               type="not_found_error", param="model", code="model_not_found")

    def _route(self, rollout_id: str | None):
        handle = self.affinity.options(stream=True)
        if rollout_id is not None:
            handle = handle.options(session_id=rollout_id)
        return handle

    async def _first_and_rest(self, payload: dict[str, Any]):
        """Start the call; an error arrives as the first event, before any byte is sent."""
        gen = self._route(payload.get("rollout_id")).call.remote(payload)
        aiter = gen.__aiter__()
        first = await aiter.__anext__()
        if "__error__" in first:
            raise ServiceError.from_result(first)
        return first, aiter

    @staticmethod
    async def _collect_final(first, aiter) -> dict[str, Any]:
        event = first
        while event.get("kind") != "final":
            event = await aiter.__anext__()
            if "__error__" in event:
                raise ServiceError.from_result(event)
        return event

    # ------------------------------------------------------------------ chat
    async def chat(self, request: Request):
        req = await read_model(request, ChatCompletionRequest, self.max_bytes)
        self._check_model(req.model)
        rollout_id = rollout_id_of(request, req.metadata)
        payload = chat_payload(req, rollout_id, request.headers.get("x-history-policy"))
        payload["want_token_strs"] = bool(req.logprobs)
        first, aiter = await self._first_and_rest(payload)
        if not req.stream:
            final = await self._collect_final(first, aiter)
            body = chat_completion_body(final, req, self.served_name, final.get("token_strs") or {})
            return JSONResponse(body, headers={"x-rollout-replica": final["replica"]})
        return StreamingResponse(self._chat_stream(req, first, aiter), media_type="text/event-stream",
                                 headers={"x-rollout-replica": first.get("replica", "")})

    async def _chat_stream(self, req: ChatCompletionRequest, first, aiter) -> AsyncIterator[bytes]:
        cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        as_ids = bool(req.return_tokens_as_token_ids)

        def chunk(delta: dict[str, Any], finish=None, logprobs=None, extra=None) -> bytes:
            choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
            if extra:
                choice.update(extra)
            return sse({"id": cid, "object": "chat.completion.chunk", "created": created, "model": self.served_name,
                        "choices": [choice]})

        yield chunk({"role": "assistant", "content": ""})
        event = first
        try:
            while True:
                if "__error__" in event:
                    yield sse(ServiceError.from_result(event).envelope())
                    break
                if event["kind"] == "delta":
                    delta: dict[str, Any] = {}
                    if event.get("reasoning"):
                        delta["reasoning_content"] = event["reasoning"]
                    if event.get("content"):
                        delta["content"] = event["content"]
                    lp = chat_logprobs(event, event.get("token_strs") or {}, as_ids) if req.logprobs else None
                    extra = {"token_ids": event["token_ids"]} if req.return_token_ids else None
                    yield chunk(delta, logprobs=lp, extra=extra)
                else:
                    final = event
                    msg = final["message"]
                    delta = {}
                    if msg.get("tool_calls"):
                        delta["tool_calls"] = [{"index": i, **tc} for i, tc in enumerate(msg["tool_calls"])]
                    for k in ("prompt_token_ids", "generation_token_ids", "generation_log_probs", "weight_versions", "rollout"):
                        delta[k] = final[k]
                    yield chunk(delta, finish=final["finish_reason"])
                    if (req.stream_options or {}).get("include_usage"):
                        yield sse({"id": cid, "object": "chat.completion.chunk", "created": created,
                                   "model": self.served_name, "choices": [], "usage": final["usage"]})
                    break
                event = await aiter.__anext__()
        except StopAsyncIteration:
            pass
        yield b"data: [DONE]\n\n"

    # ------------------------------------------------------------------ responses
    async def responses(self, request: Request):
        req = await read_model(request, ResponsesRequest, self.max_bytes)
        self._check_model(req.model)
        if req.previous_response_id:
            raise bad_request("previous_response_id is not supported: send the full input (the service keeps "
                              "token history per rollout id)", param="previous_response_id")
        rollout_id = rollout_id_of(request, req.metadata)
        messages = input_to_messages(req.input, req.instructions)
        tools = tools_to_chat(req.tools)
        tool_choice = req.tool_choice
        if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
            tool_choice = {"type": "function", "function": {"name": tool_choice.get("name")}}
        payload = {
            "rollout_id": rollout_id, "messages": messages, "tools": tools,
            "chat_template_kwargs": req.chat_template_kwargs, "sampling": req.sampling_kwargs(),
            "max_tokens": req.max_output_tokens if req.max_output_tokens is not None else req.max_tokens,
            "stream": req.stream,
        }
        if tool_choice not in (None, "auto"):
            if tool_choice not in ("none", "required") and not isinstance(tool_choice, dict):
                raise bad_request(f"unsupported tool_choice {tool_choice!r}", param="tool_choice")
            if isinstance(tool_choice, dict) and tool_choice["function"]["name"] not in {t["function"]["name"] for t in tools or []}:
                raise bad_request("tool_choice names a function that is not in tools", param="tool_choice")
            if tool_choice == "required" and not tools:
                raise bad_request("tool_choice 'required' needs tools", param="tool_choice")
            payload.update(tool_choice_payload(tools, tool_choice))
        first, aiter = await self._first_and_rest(payload)
        if not req.stream:
            final = await self._collect_final(first, aiter)
            return JSONResponse(response_object(final, self.served_name), headers={"x-rollout-replica": final["replica"]})
        return StreamingResponse(self._responses_stream(first, aiter), media_type="text/event-stream")

    async def _responses_stream(self, first, aiter) -> AsyncIterator[bytes]:
        rid = f"resp_{uuid.uuid4().hex}"
        seq = 0

        def ev(kind: str, **fields) -> bytes:
            nonlocal seq
            seq += 1
            return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': seq, **fields})}\n\n".encode()

        yield ev("response.created", response={"id": rid, "object": "response", "status": "in_progress", "output": []})
        event = first
        try:
            while True:
                if "__error__" in event:
                    yield ev("error", **ServiceError.from_result(event).envelope()["error"])
                    break
                if event["kind"] == "delta":
                    if event.get("reasoning"):
                        yield ev("response.reasoning_text.delta", item_id=rid, output_index=0, content_index=0, delta=event["reasoning"])
                    if event.get("content"):
                        yield ev("response.output_text.delta", item_id=rid, output_index=0, content_index=0, delta=event["content"])
                else:
                    body = response_object(event, self.served_name, response_id=rid)
                    for i, item in enumerate(body["output"]):
                        yield ev("response.output_item.done", output_index=i, item=item)
                    yield ev("response.completed", response=body)
                    break
                event = await aiter.__anext__()
        except StopAsyncIteration:
            pass

    # ------------------------------------------------------------------ completions
    async def completions(self, request: Request):
        req = await read_model(request, CompletionRequest, self.max_bytes)
        self._check_model(req.model)
        prompt = req.prompt[0] if isinstance(req.prompt, list) and req.prompt and isinstance(req.prompt[0], (list, str)) else req.prompt
        payload = {"kind": "completion", "prompt": prompt, "sampling": req.sampling_kwargs(),
                   "max_tokens": req.max_tokens if req.max_tokens is not None else 16,
                   "top_logprobs": req.logprobs or 0, "stream": req.stream}
        first, aiter = await self._first_and_rest(payload)
        cid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        if not req.stream:
            final = await self._collect_final(first, aiter)
            choice = {"index": 0, "text": final["text"], "finish_reason": final["finish_reason"], "logprobs": None,
                      "token_ids": final["generation_token_ids"], "prompt_token_ids": final["prompt_token_ids"],
                      "generation_log_probs": final["generation_log_probs"], "weight_versions": final["weight_versions"]}
            if req.logprobs is not None:
                choice["logprobs"] = {"token_logprobs": final["generation_log_probs"], "tokens": None}
            return JSONResponse({"id": cid, "object": "text_completion", "created": created, "model": self.served_name,
                                 "choices": [choice], "usage": final["usage"]})

        async def stream():
            event = first
            try:
                while True:
                    if "__error__" in event:
                        yield sse(ServiceError.from_result(event).envelope())
                        break
                    if event["kind"] == "delta":
                        yield sse({"id": cid, "object": "text_completion", "created": created, "model": self.served_name,
                                   "choices": [{"index": 0, "text": event["content"], "token_ids": event["token_ids"],
                                                "finish_reason": None}]})
                    else:
                        yield sse({"id": cid, "object": "text_completion", "created": created, "model": self.served_name,
                                   "choices": [{"index": 0, "text": "", "finish_reason": event["finish_reason"],
                                                "prompt_token_ids": event["prompt_token_ids"],
                                                "generation_log_probs": event["generation_log_probs"]}]})
                        break
                    event = await aiter.__anext__()
            except StopAsyncIteration:
                pass
            yield b"data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    # ------------------------------------------------------------------ the rest
    async def tokenize(self, request: Request):
        req = await read_model(request, TokenizeRequest, self.max_bytes)
        self._check_model(req.model)
        rollout_id = rollout_id_of(request, req.metadata)
        payload: dict[str, Any] = {"rollout_id": rollout_id, "return_token_strs": req.return_token_strs,
                                   "add_special_tokens": req.add_special_tokens}
        if req.prompt is not None:
            payload["prompt"] = req.prompt
        else:
            payload.update(messages=[m.to_plain() for m in req.messages],
                           tools=[t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None,
                           chat_template_kwargs=req.chat_template_kwargs)
        handle = self.affinity if rollout_id is None else self.affinity.options(session_id=rollout_id)
        result = await handle.tokenize.remote(payload)
        if "__error__" in result:
            raise ServiceError.from_result(result)
        return JSONResponse(result)

    async def rollout(self, rollout_id: str, delete: bool):
        handle = self.affinity.options(session_id=rollout_id)
        result = await (handle.delete_rollout.remote(rollout_id) if delete else handle.get_rollout.remote(rollout_id))
        if "__error__" in result:
            raise ServiceError.from_result(result)
        return JSONResponse(result)

    def models(self):
        return JSONResponse({"object": "list", "data": [{
            "id": self.served_name, "object": "model", "created": int(time.time()), "owned_by": "rollout-service",
            "root": self.model_root, "parent": None, "max_model_len": self.config.engine.max_model_len,
        }]})

    async def health(self):
        try:
            info = await asyncio.wait_for(self.affinity.health.remote(), timeout=30)
        except Exception as exc:
            raise ServiceError(503, f"not ready: {type(exc).__name__}: {exc}"[:500], type="service_unavailable")
        if not info.get("store") or not info.get("engines_alive"):
            raise ServiceError(503, f"not ready: {info}", type="service_unavailable")
        return JSONResponse({"status": "ok", **info})


def build_app(args: dict[str, Any] | RolloutServiceConfig | None = None):
    """Serve application builder: ``serve run rollout_service.serve.app:build_app`` or a config file."""
    cfg = resolve_config(args)
    plain = cfg.model_dump()
    ingress = serve.deployment(name=INGRESS_NAME, num_replicas=1, max_ongoing_requests=1024,
                               ray_actor_options={"num_cpus": 0})(HTTPIngress)
    affinity = serve.deployment(
        name=AFFINITY_NAME,
        num_replicas=cfg.service.num_affinity_replicas,
        max_ongoing_requests=512,
        ray_actor_options={"num_cpus": 0},
        request_router_config=RequestRouterConfig(
            request_router_class="ray.serve.experimental.consistent_hash_router:ConsistentHashRouter",
            request_router_kwargs={"num_fallback_replicas": 0},
        ),
    )(RolloutAffinity)
    return ingress.bind(affinity.bind(plain), plain)


fastapi_app = create_app()


@serve.ingress(fastapi_app)
class HTTPIngress(Ingress):
    """The HTTP routes. Each checks the API key and body size, and maps ServiceError to its envelope."""

    async def _guarded(self, request: Request | None, fn, *args):
        try:
            if request is not None:
                self._guard(request)
            result = fn(*args)
            if asyncio.iscoroutine(result):
                result = await result
            return result
        except ServiceError as exc:
            return error_response(exc)
        except Exception as exc:  # infrastructure, not the client: 503 if a replica died, else 500
            import ray.exceptions as rex

            if isinstance(exc, (rex.RayActorError, rex.ActorUnavailableError)):
                return error_response(ServiceError(503, f"replica unavailable, retry: {type(exc).__name__}",
                                                   type="service_unavailable", code="replica_unavailable"))
            logger.exception("unhandled error")
            return error_response(ServiceError(500, f"{type(exc).__name__}: {exc}"[:500], type="server_error"))

    def _guard(self, request: Request) -> None:
        if self.api_key and request.headers.get("authorization", "") != f"Bearer {self.api_key}":
            raise ServiceError(401, "invalid or missing API key", type="authentication_error", code="invalid_api_key")
        length = request.headers.get("content-length")
        if length and length.isdigit() and int(length) > self.max_bytes:
            raise ServiceError(413, f"request body larger than {self.max_bytes} bytes", code="request_too_large")

    @fastapi_app.post("/v1/chat/completions")
    async def chat_endpoint(self, request: Request):
        return await self._guarded(request, self.chat, request)

    @fastapi_app.post("/v1/responses")
    async def responses_endpoint(self, request: Request):
        return await self._guarded(request, self.responses, request)

    @fastapi_app.post("/v1/completions")
    async def completions_endpoint(self, request: Request):
        return await self._guarded(request, self.completions, request)

    @fastapi_app.post("/tokenize")
    async def tokenize_endpoint(self, request: Request):
        return await self._guarded(request, self.tokenize, request)

    @fastapi_app.get("/v1/rollouts/{rollout_id}")
    async def get_rollout_endpoint(self, rollout_id: str, request: Request):
        return await self._guarded(request, self.rollout, rollout_id, False)

    @fastapi_app.delete("/v1/rollouts/{rollout_id}")
    async def delete_rollout_endpoint(self, rollout_id: str, request: Request):
        return await self._guarded(request, self.rollout, rollout_id, True)

    @fastapi_app.get("/v1/models")
    async def models_endpoint(self, request: Request):
        return await self._guarded(request, self.models)

    @fastapi_app.get("/health")
    async def health_endpoint(self):
        return await self._guarded(None, self.health)
