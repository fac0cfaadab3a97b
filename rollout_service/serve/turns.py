"""One call of a rollout, end to end, HTTP-agnostic: the shell around the on-policy core.

Load the rollout from the store, build the exact prompt ids (on-policy core), generate on the
rollout's pinned engine, parse the output (vLLM parsers), append the turn atomically. The FastAPI
ingress turns requests into the primitives here and formats the events this yields; the Serve
affinity deployment only hosts a :class:`TurnRunner`. Errors are yielded as tagged results
(:meth:`ServiceError.to_result`) so they cross the Serve handle with their HTTP status intact.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from typing import Any, AsyncIterator

from rollout_service.config import RolloutServiceConfig
from rollout_service.engine.replica import GenerateRequest
from rollout_service.engine.sampling import SamplingOptions, SamplingParamsError
from rollout_service.fleet.client import FleetClient, NoEngineAvailable, is_engine_death
from rollout_service.onpolicy import (
    ChatTemplate,
    HistoryConflict,
    UnsupportedConversation,
    build_prompt,
    finish_turn,
    parse_output,
    state_from_echo,
)
from rollout_service.onpolicy.trajectory import trajectory_export
from rollout_service.onpolicy.types import RolloutState, WeightSpan
from rollout_service.protocol.openai import ServiceError, bad_request
from rollout_service.store.base import InvalidRolloutId, StoreUnavailable, TurnConflict, validate_rollout_id

logger = logging.getLogger(__name__)


class TurnRunner:
    def __init__(self, config: RolloutServiceConfig, fleet: FleetClient, store, tokenizer):
        self.config = config
        self.fleet = fleet
        self.store = store
        self.tokenizer = tokenizer
        self.template = ChatTemplate(tokenizer)
        self.max_model_len = config.engine.max_model_len
        self.in_flight: set[str] = set()

    # ------------------------------------------------------------------ helpers
    def _sampling(self, payload: dict[str, Any]) -> SamplingOptions:
        kwargs = dict(payload.get("sampling") or {})
        if payload.get("top_logprobs"):
            kwargs["top_logprobs"] = payload["top_logprobs"]
        if payload.get("structured_outputs"):
            kwargs["structured_outputs"] = payload["structured_outputs"]
        try:
            return SamplingOptions.validated(max_top_logprobs=self.config.engine.max_logprobs, **kwargs)
        except SamplingParamsError as exc:
            raise bad_request(exc.message, param=exc.param) from None

    def _max_tokens(self, requested: int | None, prompt_len: int) -> int:
        room = self.max_model_len - prompt_len
        if room < 1:
            raise ServiceError(
                400,
                f"This model's maximum context length is {self.max_model_len} tokens; the prompt has {prompt_len}.",
                param="messages",
                code="context_length_exceeded",
            )
        if requested is not None:
            if requested < 1:
                raise bad_request(f"max_tokens must be at least 1, got {requested}", param="max_tokens")
            if requested > room:
                raise ServiceError(
                    400,
                    f"max_tokens={requested} plus the {prompt_len}-token prompt exceeds the context length "
                    f"{self.max_model_len}.",
                    param="max_tokens",
                    code="context_length_exceeded",
                )
            return requested
        return min(self.config.service.default_max_tokens, room)

    def _template_kwargs(self, payload: dict[str, Any]) -> dict[str, Any]:
        return {**self.config.service.default_chat_template_kwargs, **(payload.get("chat_template_kwargs") or {})}

    async def _load_state(self, rollout_id: str | None, messages: list[dict], payload: dict[str, Any]) -> tuple[RolloutState | None, list[dict]]:
        if rollout_id is None:
            try:
                return state_from_echo(
                    messages,
                    template=self.template,
                    tools=payload.get("tools"),
                    chat_template_kwargs=self._template_kwargs(payload),
                    reasoning_policy=self.config.service.reasoning_policy,
                )
            except (HistoryConflict, UnsupportedConversation) as exc:
                raise _core_error(exc) from None
        try:
            return await self.store.load(rollout_id), messages
        except StoreUnavailable as exc:
            raise ServiceError(503, f"rollout store unavailable: {exc}", type="service_unavailable") from None

    def _plan(self, state, messages, payload):
        policy = payload.get("history_policy") or self.config.service.history_policy
        kwargs = self._template_kwargs(payload)
        try:
            return build_prompt(
                state,
                messages,
                tools=payload.get("tools"),
                chat_template_kwargs=kwargs,
                template=self.template,
                history_policy=policy,
                reasoning_policy=self.config.service.reasoning_policy,
            )
        except (HistoryConflict, UnsupportedConversation) as exc:
            raise _core_error(exc) from None

    # ------------------------------------------------------------------ public
    async def tokenize(self, payload: dict[str, Any]) -> dict[str, Any]:
        """The prompt ids the next call of this rollout would use (nothing generated or stored)."""
        try:
            rollout_id = _rollout_id(payload)
            if payload.get("prompt") is not None:
                ids = self.tokenizer.encode(payload["prompt"], add_special_tokens=bool(payload.get("add_special_tokens")))
            else:
                state, messages = await self._load_state(rollout_id, payload["messages"], payload)
                ids = self._plan(state, messages, payload).prompt_ids
            out: dict[str, Any] = {"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids}
            if payload.get("return_token_strs"):
                out["token_strs"] = self.tokenizer.convert_ids_to_tokens(ids)
            return out
        except ServiceError as exc:
            return exc.to_result()

    async def get_rollout(self, rollout_id: str) -> dict[str, Any]:
        return await self._stored(rollout_id, self.store.load, lambda state: trajectory_export(state))

    async def delete_rollout(self, rollout_id: str) -> dict[str, Any]:
        return await self._stored(rollout_id, self.store.delete,
                                  lambda _: {"id": rollout_id, "object": "rollout.deleted", "deleted": True})

    async def _stored(self, rollout_id: str, op, answer) -> dict[str, Any]:
        """Run a store operation on one rollout; map invalid id / unknown / store down to 400 / 404 / 503."""
        try:
            validate_rollout_id(rollout_id)
            result = await op(rollout_id)
        except InvalidRolloutId as exc:
            return bad_request(str(exc), param="rollout_id").to_result()
        except StoreUnavailable as exc:
            return ServiceError(503, f"rollout store unavailable: {exc}", type="service_unavailable").to_result()
        if not result:
            return ServiceError(404, f"rollout {rollout_id!r} not found", type="not_found_error",
                                code="rollout_not_found").to_result()
        return answer(result)

    async def run_call(self, payload: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """Run one model call; yield ``delta`` events then one ``final`` event (or one error)."""
        rollout_id = None
        claimed = False
        try:
            rollout_id = _rollout_id(payload)
            if rollout_id is not None:
                if rollout_id in self.in_flight:
                    raise ServiceError(409, f"rollout {rollout_id!r} already has a call in flight", type="conflict_error",
                                       code="concurrent_turn")
                self.in_flight.add(rollout_id)
                claimed = True
            async for event in self._run_call(payload, rollout_id):
                yield event
        except ServiceError as exc:
            yield exc.to_result()
        except Exception as exc:  # a bug or an infrastructure failure: 500/503, never silent
            logger.exception("call failed")
            status = 503 if is_engine_death(exc) else 500
            yield ServiceError(status, f"{type(exc).__name__}: {exc}", type="server_error").to_result()
        finally:
            if claimed:
                self.in_flight.discard(rollout_id)

    async def _run_call(self, payload: dict[str, Any], rollout_id: str | None) -> AsyncIterator[dict[str, Any]]:
        messages = payload["messages"]
        sampling = self._sampling(payload)
        state, messages = await self._load_state(rollout_id, messages, payload)
        plan = self._plan(state, messages, payload)
        max_tokens = self._max_tokens(payload.get("max_tokens"), len(plan.prompt_ids))
        expected_turn = state.turn if (state is not None and rollout_id is not None) else 0

        ids: list[int] = []
        lps: list[float] = []
        tops: list[dict[int, float]] = []
        final_chunk = None
        stream = payload.get("stream", False)
        streamer = _TextStreamer(self, payload, plan.prompt_ids)
        async for chunk in self._generate(rollout_id, plan.prompt_ids, sampling, max_tokens, stream=stream):
            ids += chunk.token_ids
            lps += chunk.logprobs
            if chunk.top_logprobs:
                tops += chunk.top_logprobs
            final_chunk = chunk
            if stream and chunk.token_ids:
                delta = streamer.push(chunk.token_ids)
                yield {"kind": "delta", "token_ids": chunk.token_ids, "logprobs": chunk.logprobs,
                       "top_logprobs": chunk.top_logprobs, **delta}
        assert final_chunk is not None
        finish_reason = final_chunk.finish_reason or "stop"

        parsed = self._parse(ids, payload, plan.prompt_ids)
        tool_calls = parsed.get("tool_calls") or []
        if tool_calls and finish_reason == "stop":
            finish_reason = "tool_calls"
        assistant = {"role": "assistant", "content": parsed.get("content") or "",
                     "reasoning_content": parsed.get("reasoning_content")}
        if tool_calls:
            assistant["tool_calls"] = tool_calls
        spans = [WeightSpan(v, s, e) for v, s, e in (final_chunk.weight_versions or [])]
        delta = finish_turn(
            state if state is not None else RolloutState(rollout_id),
            plan,
            gen_ids=ids,
            logprobs=lps,
            finish_reason=finish_reason,
            weight_versions=spans,
            assistant_message=assistant,
        )
        if rollout_id is not None:
            try:
                await self.store.append_turn(rollout_id, delta, expected_turn=expected_turn)
            except TurnConflict as exc:
                raise ServiceError(409, str(exc), type="conflict_error", code="concurrent_turn") from None
            except StoreUnavailable as exc:
                raise ServiceError(503, f"rollout store unavailable: {exc}", type="service_unavailable") from None

        yield {
            "kind": "final",
            "prompt_token_ids": plan.prompt_ids,
            "generation_token_ids": ids,
            "generation_log_probs": lps,
            "top_logprobs": tops or None,
            "finish_reason": finish_reason,
            "stop_reason": final_chunk.stop_reason,
            "message": assistant,
            "weight_versions": [{"version": v, "start": s, "end": e} for v, s, e in (final_chunk.weight_versions or [])],
            "rollout": {
                "id": rollout_id,
                "turn": delta.turn,
                "segment": delta.segment_index,
                "monotonic": plan.monotonic,
            } if rollout_id is not None else None,
            "engine_index": final_chunk.engine_index,
            "usage": {"prompt_tokens": len(plan.prompt_ids), "completion_tokens": len(ids),
                      "total_tokens": len(plan.prompt_ids) + len(ids)},
        }

    async def run_completion(self, payload: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """Raw completion on token ids (or text): no rollout semantics, no chat template."""
        try:
            prompt = payload["prompt"]
            ids_in = list(prompt) if isinstance(prompt, list) else self.tokenizer.encode(prompt, add_special_tokens=False)
            vocab = len(self.tokenizer)
            if any(t >= vocab for t in ids_in):
                raise bad_request(f"prompt token id out of range (vocabulary size {vocab})", param="prompt")
            sampling = self._sampling(payload)
            max_tokens = self._max_tokens(payload.get("max_tokens"), len(ids_in))
            ids, lps, final = [], [], None
            async for chunk in self._generate(None, ids_in, sampling, max_tokens, stream=bool(payload.get("stream"))):
                ids += chunk.token_ids
                lps += chunk.logprobs
                final = chunk
                if payload.get("stream") and chunk.token_ids:
                    yield {"kind": "delta", "token_ids": chunk.token_ids, "logprobs": chunk.logprobs,
                           "content": self.tokenizer.decode(chunk.token_ids)}
            yield {
                "kind": "final", "prompt_token_ids": ids_in, "generation_token_ids": ids, "generation_log_probs": lps,
                "finish_reason": final.finish_reason, "text": self.tokenizer.decode(ids, skip_special_tokens=sampling.skip_special_tokens),
                "weight_versions": [{"version": v, "start": s, "end": e} for v, s, e in (final.weight_versions or [])],
                "usage": {"prompt_tokens": len(ids_in), "completion_tokens": len(ids), "total_tokens": len(ids_in) + len(ids)},
            }
        except ServiceError as exc:
            yield exc.to_result()

    def _parse(self, ids: list[int], payload: dict[str, Any], prompt_ids: list[int]) -> dict[str, Any]:
        forced = payload.get("forced_tool")
        if forced is not None:
            return _parse_forced(self.tokenizer.decode(ids, skip_special_tokens=True), forced)
        ec = self.config.engine
        out = parse_output(
            ids,
            tokenizer=self.tokenizer,
            reasoning_parser=ec.reasoning_parser,
            tool_parser=ec.tool_parser if payload.get("parse_tools", True) and payload.get("tools") else None,
            tools=payload.get("tools"),
            chat_template_kwargs=self._template_kwargs(payload),
            prompt_ids=prompt_ids,
        )
        return {"content": out.content, "reasoning_content": out.reasoning_content, "tool_calls": out.tool_calls}

    async def _generate(self, rollout_id, prompt_ids, sampling, max_tokens, stream=True):
        """Generate on the rollout's pinned engine (pinned at its first turn to the least loaded one).

        An engine that dies (killed, crashed, or declared hung and killed by the fleet) before this
        call has passed on any token is not the client's problem: the call is retried on another
        engine from the same prompt ids (a non-streaming call passes nothing on until it is done).
        Once tokens were streamed, the call fails with 503 and nothing is stored; the rollout's next
        call continues from its stored tokens on a live engine. Streaming calls get the engine's
        chunks as they come; a non-streaming call is one actor round trip (``generate_all``).
        """
        attempts = max(2, len(self.fleet.members()))  # each live engine once; at least one retry
        for attempt in range(attempts):
            try:
                member = self.fleet.pick(rollout_id)
            except NoEngineAvailable as exc:
                raise ServiceError(503, str(exc), type="service_unavailable", code="no_engine") from None
            request = GenerateRequest(prompt_ids=list(prompt_ids), sampling=sampling, max_tokens=max_tokens)
            produced = False
            self.fleet.acquire(member)
            try:
                if not stream:
                    chunk = await member.handle.generate_all.remote(request)
                    produced = True
                    yield chunk
                    return
                async for ref in member.handle.generate.options(num_returns="streaming").remote(request):
                    chunk = await ref
                    produced = True
                    yield chunk
                return
            except Exception as exc:
                if not is_engine_death(exc):
                    raise
                self.fleet.report_lost(member, exc)
                if not produced and attempt + 1 < attempts:
                    logger.warning("engine slot %d died; retrying the call of rollout %s on another engine",
                                   member.slot, rollout_id)
                    continue
                raise ServiceError(503, f"engine replica {member.slot} died during the call; nothing was stored, "
                                   "retry the call (the rollout continues on a live engine)",
                                   type="service_unavailable", code="engine_lost") from None
            finally:
                self.fleet.release(member)


class _TextStreamer:
    """Incremental reasoning / content text for SSE deltas (tool calls arrive parsed in the final event).

    The split follows the same reasoning parser as the final answer (run on the ids so far), and
    only text that extends what was already sent is emitted. With tools, content from the first
    ``<tool_call>`` on is held back, since it is returned as parsed ``tool_calls``.
    """

    def __init__(self, runner: "TurnRunner", payload: dict[str, Any], prompt_ids: list[int]):
        self.runner = runner
        self.payload = payload
        self.prompt_ids = prompt_ids
        self.ids: list[int] = []
        self.sent = {"reasoning": "", "content": ""}
        self.hold = bool(payload.get("tools")) and payload.get("parse_tools", True) and not payload.get("forced_tool")

    def push(self, new_ids: list[int]) -> dict[str, str]:
        self.ids += new_ids
        if self.payload.get("forced_tool"):
            return {}
        out = parse_output(
            self.ids,
            tokenizer=self.runner.tokenizer,
            reasoning_parser=self.runner.config.engine.reasoning_parser,
            tool_parser=None,
            chat_template_kwargs=self.runner._template_kwargs(self.payload),
            prompt_ids=self.prompt_ids,
        )
        texts = {"reasoning": out.reasoning_content or "", "content": out.content or ""}
        if self.hold and "<tool_call>" in texts["content"]:
            texts["content"] = texts["content"].split("<tool_call>", 1)[0].rstrip("\n")
        delta: dict[str, str] = {}
        for key, text in texts.items():
            if text.endswith("\ufffd"):  # incomplete UTF-8 sequence: wait for the next token
                continue
            sent = self.sent[key]
            if len(text) > len(sent) and text.startswith(sent):
                delta[key] = text[len(sent):]
                self.sent[key] = text
        return delta


def _parse_forced(text: str, forced: dict[str, Any]) -> dict[str, Any]:
    """Output of a structured-output forced tool call: arguments (named) or a list of calls (required)."""
    def call(name: str, args: Any) -> dict[str, Any]:
        return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                "function": {"name": name, "arguments": args if isinstance(args, str) else json.dumps(args)}}

    try:
        if forced.get("name"):
            json.loads(text)
            return {"content": "", "reasoning_content": None, "tool_calls": [call(forced["name"], text.strip())]}
        items = json.loads(text)
        calls = [call(it["name"], it.get("parameters", it.get("arguments", {}))) for it in items]
    except (ValueError, KeyError, TypeError):  # cut off by max_tokens: return the text, no call
        return {"content": text, "reasoning_content": None, "tool_calls": []}
    return {"content": "", "reasoning_content": None, "tool_calls": calls}


def _rollout_id(payload: dict[str, Any]) -> str | None:
    rid = payload.get("rollout_id")
    if rid is None:
        return None
    try:
        return validate_rollout_id(rid)
    except InvalidRolloutId as exc:
        raise bad_request(str(exc), param="X-Rollout-Id") from None


def _core_error(exc: Exception) -> ServiceError:
    if isinstance(exc, HistoryConflict):
        return ServiceError(409, str(exc), type="conflict_error", param=f"messages[{exc.index}].{exc.field}" if exc.index is not None else "messages",
                            code="non_monotonic_history")
    return ServiceError(400, str(exc), param="messages", code="unsupported_conversation")
