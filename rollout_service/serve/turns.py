"""One call of a rollout, end to end, HTTP-agnostic: the shell around the on-policy core.

Load the rollout (from this replica's state cache, revalidated against the store), build the exact
prompt ids (on-policy core), generate on the rollout's pinned engine, parse the output (vLLM
parsers), append the turn atomically. The dialects (``serve/dialects``) turn HTTP requests into a
:class:`~rollout_service.serve.turn_types.TurnRequest` and format the events this yields; errors
are raised as :class:`ServiceError` with their HTTP status.

Retries are not forks: a call that repeats the last stored call of its rollout (same digest, or
the same ``Idempotency-Key``) gets the stored answer back and stores nothing; a retry that arrives
while the original is still running waits for it and gets its answer.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field, replace
from typing import Any, AsyncIterator

from rollout_service.canary.canary import Canary
from rollout_service.config import RolloutServiceConfig
from rollout_service.engine.types import kv_spans
from rollout_service.metrics import get_metrics
from rollout_service.fleet.client import FleetClient
from rollout_service.onpolicy import (
    ChatTemplate,
    HistoryConflict,
    finish_turn,
    parse_output,
)
from rollout_service.onpolicy.parsing import count_reasoning_tokens, generation_text
from rollout_service.onpolicy.replay import NotReplayable, find_turn, replay_turn, stored_answer
from rollout_service.onpolicy.types import RolloutState, WeightSpan
from rollout_service.serve.protocol.envelope import ServiceError, bad_request
from rollout_service.serve.completions import RawCompletions
from rollout_service.serve.constraints import (
    Constraints,
    forced_json_schema,
    grammar_from_start,
    name_the_grammar,
    parse_forced,
    vllm_tool_choice,
)
from rollout_service.serve.dialects.common import optional_rollout_id
from rollout_service.serve.engine_calls import EngineCalls, counted_call
from rollout_service.serve.errors import http_error, key_reused
from rollout_service.serve.groups import RolloutGroups
from rollout_service.serve.prompts import PromptPlans
from rollout_service.serve.reads import RolloutReads
from rollout_service.serve.shared_claims import claim_across_replicas
from rollout_service.serve.token_texts import TokenTexts, context_of
from rollout_service.serve.steering import RolloutSteering, StaleRollout
from rollout_service.serve.streaming import StreamParser
from rollout_service.serve.truncation import fitted, truncated
from rollout_service.serve.turn_types import TokenDelta, TurnRequest, TurnResult
from rollout_service.store.base import StoreError

logger = logging.getLogger(__name__)

REPLAY_WAIT_S = 600.0  # a retry waits at most this long for the original call still in flight


@dataclass
class _InFlight:
    digest: str
    idempotency_key: str | None
    done: asyncio.Event = field(default_factory=asyncio.Event)


def _chat_template(config: RolloutServiceConfig, tokenizer) -> ChatTemplate:
    """The tokenizer's template, or chat.chat_template (read once, here) in its place."""
    source = config.chat.resolved_chat_template()
    if source is None:
        return ChatTemplate(tokenizer)
    given = config.chat.chat_template
    name = "chat.chat_template" if source is given else given.rsplit("/", 1)[-1]
    return ChatTemplate(tokenizer, source, name=name)


class TurnRunner(RolloutReads, RolloutSteering, RolloutGroups, PromptPlans, EngineCalls, RawCompletions):
    """Runs the calls of the rollouts routed to this replica (and answers reads: :class:`RolloutReads`;
    aborts and the staleness bound: :class:`RolloutSteering`). Its prompt plans are
    :class:`PromptPlans`, its engine calls :class:`EngineCalls`, raw completions :class:`RawCompletions`."""

    def __init__(self, config: RolloutServiceConfig, fleet: FleetClient, store, tokenizer, canary: Canary | None = None):
        self.config = config
        self.fleet = fleet
        self.canary = canary  # the parity canary (canary.sample_fraction > 0): offered every finished generation
        self.store = store
        self.tokenizer = tokenizer
        self.template = _chat_template(config, tokenizer)
        self.constraints = Constraints(config, tokenizer)
        self.vocab_size = _vocab_size(config, tokenizer)
        self.texts = TokenTexts(tokenizer)
        self.max_model_len = config.engine.max_model_len
        self.in_flight: dict[str, _InFlight] = {}

    def warm(self) -> None:
        """Pay the first call's one-time costs now, on the replica's start: importing vLLM's protocol
        and parser modules and building its cached tokenizer view, which otherwise made the first call
        of each replica seconds slower (docs/benchmarks.md, "First call of a replica"). Blocking: run
        it in a thread."""
        ec = self.config.chat
        prompt = self.tokenizer.encode("warm", add_special_tokens=False)
        StreamParser(self.tokenizer, reasoning_parser=ec.reasoning_parser, chat_template_kwargs=None,
                     prompt_ids=prompt, hold_tool_calls=True).push(prompt, finished=True)
        tool = {"type": "function", "function": {"name": "warm", "parameters": {"type": "object", "properties": {}}}}
        parse_output(prompt, tokenizer=self.tokenizer, reasoning_parser=ec.reasoning_parser, tool_parser=ec.tool_parser,
                     tools=[tool], tool_choice="auto", parallel_tool_calls=None, strict_level=ec.tool_strict_level,
                     chat_template_kwargs={}, prompt_ids=prompt)

    # ------------------------------------------------------------------ helpers
    def _template_kwargs(self, req: TurnRequest) -> dict[str, Any]:
        return {**self.config.service.default_chat_template_kwargs, **(req.chat_template_kwargs or {})}

    async def _store_op(self, op: str, call):
        """A store call, timed, its failure counted (metrics: store latency and errors by op)."""
        t0 = time.perf_counter()
        try:
            result = await call
        except Exception as exc:
            get_metrics().store(op, time.perf_counter() - t0, exc)
            raise
        get_metrics().store(op, time.perf_counter() - t0)
        return result

    async def _load(self, rollout_id: str) -> RolloutState | None:
        try:
            return await self._store_op("load", self.store.load(rollout_id))
        except StoreError as exc:
            raise http_error(exc) from None

    async def _replicated(self, rollout_id: str) -> None:
        """An answer about to be given from the store is held by the replicas first (store.durability)."""
        try:
            await self._store_op("replicate", self.store.ensure_replicated(rollout_id))
        except StoreError as exc:
            raise http_error(exc) from None

    def token_strs(self, ids, tops=None, context=()) -> list[dict[int, str]]:
        return self.texts.token_strs(ids, tops, context)

    def prompt_logprobs(self, prompt_ids: list[int], positions: list) -> list[dict[str, dict[str, Any]] | None]:
        return self.texts.prompt_logprobs(prompt_ids, positions)

    def _reasoning_tokens(self, ids: list[int], req: TurnRequest) -> int | None:
        """The configured reasoning parser's count of reasoning ids (vLLM's usage detail); None without one."""
        parser = self.config.chat.reasoning_parser
        if not parser:
            return None
        return count_reasoning_tokens(ids, tokenizer=self.tokenizer, reasoning_parser=parser,
                                      chat_template_kwargs=self._template_kwargs(req))

    # ------------------------------------------------------------------ a call
    def run_turn(self, req: TurnRequest) -> AsyncIterator[TokenDelta | TurnResult]:
        """Run one model call: ``TokenDelta`` events (streaming only), then one ``TurnResult``."""
        if req.rollout_id is not None:
            get_metrics().rollout_seen(req.rollout_id)
        return counted_call("stateful" if req.rollout_id is not None else "stateless", self._run_turn(req))

    async def _run_turn(self, req: TurnRequest) -> AsyncIterator[TokenDelta | TurnResult]:
        rollout_id = optional_rollout_id(req.rollout_id)
        if rollout_id is None:
            async for event in self._run(req, None, None):
                yield event
            return
        digest = req.digest()
        running = self.in_flight.get(rollout_id)
        if running is not None:
            same = (req.idempotency_key is not None and req.idempotency_key == running.idempotency_key) or (
                req.idempotency_key is None and running.digest == digest and self.config.service.retry_policy == "replay")
            if not same:
                raise ServiceError(409, f"rollout {rollout_id!r} already has a call in flight", type="conflict_error",
                                   code="concurrent_turn")
            if req.idempotency_key is not None and running.digest != digest:
                raise key_reused(req.idempotency_key)
            try:  # a retry of the call still running: wait for it, then answer with what it stored
                await asyncio.wait_for(running.done.wait(), REPLAY_WAIT_S)
            except asyncio.TimeoutError:
                raise ServiceError(409, f"rollout {rollout_id!r}: the call this request repeats is still running",
                                   type="conflict_error", code="concurrent_turn") from None
            if self.in_flight.get(rollout_id) is not None:
                raise ServiceError(409, f"rollout {rollout_id!r} already has a call in flight", type="conflict_error",
                                   code="concurrent_turn")
        claim = _InFlight(digest, req.idempotency_key)
        self.in_flight[rollout_id] = claim

        shared = None

        async def release() -> None:
            if shared is not None:  # first: a retry waiting here then finds the store's claim free too
                await shared.release()
            claim.done.set()
            if self.in_flight.get(rollout_id) is claim:
                del self.in_flight[rollout_id]

        try:
            if req.shared_claim:  # it may run on another replica too: the claim every replica sees
                shared = await claim_across_replicas(
                    self.store, rollout_id, req, digest, wait_s=REPLAY_WAIT_S,
                    replay_policy=self.config.service.retry_policy == "replay")
            state = await self._load(rollout_id)
            replay = self._replay_of(state, req, digest)
            if replay is not None:
                await self._replicated(rollout_id)
                if req.stream:
                    yield TokenDelta(token_ids=replay.generation_token_ids, logprobs=replay.generation_log_probs,
                                     reasoning=replay.message.get("reasoning_content") or "",
                                     content=replay.message.get("content") or "",
                                     prompt_token_ids=replay.prompt_token_ids, token_strs=replay.token_strs)
                get_metrics().turn("replay")
                if req.rollout_group is not None:  # e.g. a retry of a call whose answer was lost after its append
                    await self.note_group(req.rollout_group, rollout_id, "finished")
                await release()  # as a stored turn: free before the consumer reads the answer
                yield replay
                return
            try:  # an aborted rollout, or one past its staleness bound: 409, nothing generated or stored
                await self.admit(state, req)
            except StaleRollout as exc:
                await self.mark_stale(exc)
                raise
            group = req.rollout_group
            # Recorded as running beside the generation (the members of a call with n > 1 were
            # recorded by that call before it fanned out), and as finished or failed before the
            # answer or the error leaves: a client's retry cannot overtake its call's last record.
            running = (asyncio.ensure_future(self.note_group(group, rollout_id, "running"))
                       if group is not None and not req.group_together else None)
            stored = False
            try:
                async for event in self._run(req, state, digest):
                    if isinstance(event, TurnResult):
                        await release()  # stored: the rollout is free before the consumer reads the result
                        stored = True
                        if group is not None:
                            await self.end_group_call(running, group, rollout_id, "finished")
                            group = None
                    yield event
            finally:
                if group is not None:  # an error, or the caller went away before the answer
                    await self.end_group_call(running, group, rollout_id, "finished" if stored else "failed")
        finally:
            await release()

    def _replay_of(self, state: RolloutState | None, req: TurnRequest, digest: str) -> TurnResult | None:
        """The stored answer this request repeats, if it repeats one (see the module docstring)."""
        if state is None or not state.turn:
            return None
        if req.idempotency_key is not None:
            turn = find_turn(state, idempotency_key=req.idempotency_key)
            if turn is None:
                return None
        elif self.config.service.retry_policy == "replay" or req.replay_if_stored:
            turn = find_turn(state, request_digest=digest)
            if turn is None:
                return None
        else:
            return None
        try:
            r = replay_turn(state, turn)
        except NotReplayable:
            return None  # stored before answers were kept: run it as a new call
        if req.idempotency_key is not None and r.request_digest not in (None, digest):
            raise key_reused(req.idempotency_key)
        answer = r.to_dict()
        ids = answer["generation_token_ids"]
        return TurnResult(
            prompt_token_ids=answer["prompt_token_ids"], generation_token_ids=ids,
            generation_log_probs=answer["generation_log_probs"], finish_reason=answer["finish_reason"],
            stop_reason=answer["stop_reason"], message=answer["message"], weight_versions=answer["weight_versions"],
            rollout={**answer["rollout"], "replayed": True}, replayed=True,
            token_strs=self.token_strs(ids) if req.want_token_strs else None,
            reasoning_tokens=self._reasoning_tokens(ids, req) if req.prompt_token_ids is None else None,
        )

    async def _run(self, req: TurnRequest, state: RolloutState | None, digest: str | None) -> AsyncIterator[TokenDelta | TurnResult]:
        rollout_id = req.rollout_id
        messages = req.messages
        json_forced = self.constraints.json_forced(req)
        if (json_forced and req.tool_choice.mode == "named" and req.structured_outputs
                and any(req.structured_outputs.get(k) is not None for k in ("json", "regex", "choice"))):
            # vLLM's rule (its request model); otherwise the forced call's grammar replaces it, as in vLLM
            raise bad_request("You can only either use constraints for structured outputs or tools, not both.")
        structured = forced_json_schema(req) if json_forced else self.constraints.grammar(req)
        constrained = structured is not None
        # A grammar from the first token (forced call, response_format) leaves no room for a <think>
        # block: the whole output is the answer, not reasoning the parser would assume it is.
        reasoning_parser = None if grammar_from_start(req, structured) else self.config.chat.reasoning_parser
        sampling = self._sampling(req.sampling, req.top_logprobs, structured)
        tokens_in = req.prompt_token_ids is not None
        prefix = self._required_prefix(req.required_prefix_token_ids)
        open_prompt = not req.add_generation_prompt  # stateless only (the dialect refuses it under a rollout id)
        if rollout_id is None and prefix is None and not tokens_in and not open_prompt:
            state, messages = self._echo_state(req)
        try:
            if tokens_in:
                plan = self._token_plan(state, req)
            elif open_prompt:
                plan = self._open_plan(messages, req)
            else:
                plan = self._plan(state, messages, req, prefix)
        except ServiceError as exc:
            if exc.code == "non_monotonic_history":  # history_policy reject refused an edited history
                get_metrics().turn("reject")
            raise
        if req.truncate_prompt_tokens is not None and rollout_id is None:  # stateless: nothing is recorded
            cut = truncated(plan.prompt_ids, req.truncate_prompt_tokens, req.truncation_side,
                            max_model_len=self.max_model_len, max_tokens=req.max_tokens)
            if cut is not plan.prompt_ids:
                plan = replace(plan, prompt_ids=cut, added_prompt_ids=cut, prompt_text=None)
            req = replace(req, max_tokens=fitted(req.max_tokens, len(plan.prompt_ids), self.max_model_len))
        if tokens_in:  # vLLM's route: no max_tokens means the whole room left in the context
            room = self.max_model_len - len(plan.prompt_ids)
            max_tokens = self._max_tokens(req.max_tokens if req.max_tokens is not None or room < 1 else room,
                                          len(plan.prompt_ids), ("token_ids", "sampling_params.max_tokens"))
        else:
            max_tokens = self._max_tokens(req.max_tokens, len(plan.prompt_ids))
        expected_turn = state.turn if (state is not None and rollout_id is not None) else 0
        parse_tools = bool(req.tools) and req.tool_choice.mode != "none"
        streamer = StreamParser(self.tokenizer, reasoning_parser=reasoning_parser,
                                chat_template_kwargs=self._template_kwargs(req), prompt_ids=plan.prompt_ids,
                                hold_tool_calls=parse_tools and not json_forced,
                                silent=json_forced, stop=sampling.stop,
                                include_stop=sampling.include_stop_str_in_output) if req.stream and not tokens_in else None

        ids: list[int] = []
        lps: list[float] = []
        tops: list[dict[int, float]] = []
        final_chunk = None
        prompt_sent = False
        routed: list = []  # fleet.routing.Route of each attempt
        chunks = self._generate(rollout_id, plan.prompt_ids, sampling, max_tokens, stream=req.stream, routed=routed,
                                group=self._group(req, state, plan.prompt_ids))
        if constrained:
            chunks = name_the_grammar(chunks, req)
        prompt_lps = None
        async for chunk in chunks:
            ids += chunk.token_ids
            lps += chunk.logprobs
            if chunk.top_logprobs:
                tops += chunk.top_logprobs
            if chunk.prompt_logprobs is not None and prompt_lps is None:
                prompt_lps = chunk.prompt_logprobs
            final_chunk = chunk
            if streamer is not None and (chunk.token_ids or chunk.finish_reason):
                reasoning, content = streamer.push(chunk.token_ids, finished=chunk.finish_reason is not None,
                                                   stop_reason=chunk.stop_reason)
                if chunk.token_ids or reasoning or content:
                    yield TokenDelta(token_ids=chunk.token_ids, logprobs=chunk.logprobs, top_logprobs=chunk.top_logprobs,
                                     reasoning=reasoning, content=content,
                                     token_strs=self.token_strs(chunk.token_ids, chunk.top_logprobs,
                                                                context_of(ids, len(chunk.token_ids)))
                                     if req.want_token_strs else None,
                                     prompt_token_ids=None if prompt_sent else plan.prompt_ids,
                                     reasoning_tokens=self._reasoning_tokens(ids, req) if req.continuous_usage else None)
                    prompt_sent = True
            elif tokens_in and req.stream and (chunk.token_ids or chunk.finish_reason):
                yield TokenDelta(token_ids=chunk.token_ids, logprobs=chunk.logprobs, top_logprobs=chunk.top_logprobs,
                                 prompt_token_ids=None if prompt_sent else plan.prompt_ids)
                prompt_sent = True
        assert final_chunk is not None
        finish_reason = final_chunk.finish_reason or "stop"

        # A stop string ends the text where vLLM's detokenizer ends it; the ids (and the stored turn) stay whole.
        stop_string = ((final_chunk.stop_reason, sampling.include_stop_str_in_output)
                       if isinstance(final_chunk.stop_reason, str) else None)
        message, reasoning_tokens = (
            ({"role": "assistant", "content": self.tokenizer.decode(ids, skip_special_tokens=False)}, None) if tokens_in
            else self._parse(ids, req, plan.prompt_ids, parse_tools, json_forced, reasoning_parser, stop_string))
        if reasoning_tokens is None and not tokens_in:  # vLLM counts with the call's parser even under a grammar
            reasoning_tokens = self._reasoning_tokens(ids, req)
        # vLLM's rule: a named tool_choice ends "stop" (as OpenAI's); required ends "tool_calls" even
        # if nothing parsed; auto when calls were parsed.
        if finish_reason == "stop" and (req.tool_choice.mode == "required"
                                        or (req.tool_choice.mode != "named" and message.get("tool_calls"))):
            finish_reason = "tool_calls"
        spans = [WeightSpan(v, s, e, None if kv == v else kv)
                 for v, s, e, kv in kv_spans(final_chunk.weight_versions or [], final_chunk.kv_resets,
                                                  final_chunk.kv_base)]
        try:
            delta = finish_turn(state if state is not None else RolloutState(rollout_id), plan, gen_ids=ids, logprobs=lps,
                                finish_reason=finish_reason, weight_versions=spans, assistant_message=message)
        except HistoryConflict as exc:
            raise http_error(exc) from None
        if rollout_id is not None:
            delta.record.request_digest = digest
            delta.record.idempotency_key = req.idempotency_key
            delta.record.answer = stored_answer(
                message, stop_reason=final_chunk.stop_reason,
                text_cut={"stop": stop_string[0], "included": stop_string[1]} if stop_string and not tokens_in else None)
            delta.record.constrained = constrained
            delta.record.migrations = final_chunk.migrations
        if rollout_id is not None:
            await self._append(rollout_id, delta, expected_turn)
        get_metrics().turn("monotonic" if plan.monotonic else "fork", plan.conflict.field if plan.conflict else None)
        yield TurnResult(
            prompt_token_ids=plan.prompt_ids, generation_token_ids=ids, generation_log_probs=lps,
            top_logprobs=tops or None, finish_reason=finish_reason, stop_reason=final_chunk.stop_reason, message=message,
            weight_versions=[w.to_dict() for w in spans],
            rollout={"id": rollout_id, "turn": delta.turn, "segment": delta.segment_index, "monotonic": plan.monotonic,
                     "constrained": constrained, "replayed": False,
                     **({"engine_moved": True} if any(r.moved for r in routed) else {}),
                     **({"migrations": final_chunk.migrations} if final_chunk.migrations else {}),
                     # prompt tokens whose KV came from the prefix cache (salted by weight version):
                     # a group's members after the first, with engine.enable_prefix_caching on
                     # (a call continued on another engine: the continuation's count would include
                     # its own tokens, so none is given)
                     **({"cached_prompt_tokens": final_chunk.num_cached_tokens}
                        if final_chunk.num_cached_tokens and not final_chunk.migrations else {})}
            if rollout_id is not None else None,
            engine_index=final_chunk.engine_index,
            token_strs=self.token_strs(ids, tops) if req.want_token_strs else None,
            prompt_logprobs=self.prompt_logprobs(plan.prompt_ids, prompt_lps) if prompt_lps is not None else None,
            reasoning_tokens=reasoning_tokens,
        )

    async def _append(self, rollout_id: str, delta, expected_turn: int) -> None:
        try:
            await self._store_op("append", self.store.append_turn(rollout_id, delta, expected_turn=expected_turn))
        except StoreError as exc:  # a concurrent turn (409), a full store (507), unavailable (503)
            raise http_error(exc) from None

    def _parse(self, ids: list[int], req: TurnRequest, prompt_ids: list[int], parse_tools: bool,
               json_forced: bool, reasoning_parser: str | None,
               stop_string: tuple[str, bool] | None) -> tuple[dict[str, Any], int | None]:
        """The assistant message of ``ids``, and the reasoning parser's count of reasoning ids if it ran."""
        if json_forced:
            return parse_forced(generation_text(self.tokenizer, ids, True, stop_string), req.tool_choice), None
        ec = self.config.chat
        out = parse_output(ids, tokenizer=self.tokenizer, reasoning_parser=reasoning_parser,
                           tool_parser=ec.tool_parser if parse_tools else None, tools=req.tools,
                           tool_choice=vllm_tool_choice(req) if parse_tools else "auto",
                           parallel_tool_calls=req.parallel_tool_calls, strict_level=ec.tool_strict_level,
                           chat_template_kwargs=self._template_kwargs(req), prompt_ids=prompt_ids,
                           stop_string=stop_string)
        message: dict[str, Any] = {"role": "assistant", "content": out.content or "",
                                   "reasoning_content": out.reasoning_content}
        if out.tool_calls:
            message["tool_calls"] = out.tool_calls
        return message, out.reasoning_tokens


def _vocab_size(config: RolloutServiceConfig, tokenizer) -> int:
    """Ids a client may send back: the model samples from its embedding rows, which can outnumber the
    tokenizer's tokens (Qwen: 151,936 rows, 151,669 tokens), so the bound is the larger of the two."""
    size = len(tokenizer)
    try:
        from transformers import AutoConfig

        size = max(size, int(AutoConfig.from_pretrained(config.engine.resolved_model()).vocab_size))
    except Exception:  # a tokenizer-only directory: the tokenizer's size is all we know
        pass
    return size

