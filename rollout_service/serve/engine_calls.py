"""A call's generation on its engine, shared by the turn path and the raw completions path: the
sampling options and ``max_tokens`` it asks for (validated; within the context), the group whose
home engine a rollout's first call starts on, the engine call itself (failover, a stop string across
a migration seam, the parity canary's draw, the engine's refusals and the fleet's errors as HTTP
errors, pin moves counted), and the count of calls in flight around a call's events (metrics).

A mixin of :class:`~rollout_service.serve.turns.TurnRunner` (its config, fleet client, tokenizer,
canary, vocabulary size and context length).
"""

from __future__ import annotations

import hashlib
from array import array
from typing import Any, AsyncIterator

from rollout_service.canary.canary import Canary, Generation
from rollout_service.config import RolloutServiceConfig
from rollout_service.engine.sampling import SamplingOptions, SamplingParamsError
from rollout_service.engine.types import GenerateRequest
from rollout_service.fleet.client import FleetClient
from rollout_service.fleet.types import EngineCallDeadline, EngineLostDuringCall, NoEngineAvailable
from rollout_service.metrics import get_metrics
from rollout_service.onpolicy.types import RolloutState
from rollout_service.serve.errors import engine_refusal, http_error
from rollout_service.serve.protocol.envelope import ServiceError, bad_request
from rollout_service.serve.seams import SeamStops
from rollout_service.serve.turn_types import TurnRequest, TurnResult


class EngineCalls:
    config: RolloutServiceConfig  # the TurnRunner's
    fleet: FleetClient
    canary: Canary | None
    vocab_size: int
    max_model_len: int

    def _sampling(self, sampling: dict[str, Any], top_logprobs: int, structured: dict | None = None) -> SamplingOptions:
        kwargs = dict(sampling or {})
        if top_logprobs:
            kwargs["top_logprobs"] = top_logprobs
        if structured:
            kwargs["structured_outputs"] = structured
        try:
            return SamplingOptions.validated(kwargs, max_top_logprobs=self.config.engine.max_logprobs,
                                             vocab_size=self.vocab_size)
        except SamplingParamsError as exc:
            raise bad_request(exc.message, param=exc.param) from None

    def _max_tokens(self, requested: int | None, prompt_len: int, params: tuple[str, str] = ("messages", "max_tokens")) -> int:
        """``params``: how the request names its prompt and its max_tokens (for the 400)."""
        prompt_param, max_param = params
        room = self.max_model_len - prompt_len
        if room < 1:
            raise ServiceError(400, f"This model's maximum context length is {self.max_model_len} tokens; the prompt "
                               f"has {prompt_len}.", param=prompt_param, code="context_length_exceeded")
        if requested is not None:
            if requested < 1:
                raise bad_request(f"max_tokens must be at least 1, got {requested}", param=max_param)
            if requested > room:
                raise ServiceError(400, f"max_tokens={requested} plus the {prompt_len}-token prompt exceeds the context "
                                   f"length {self.max_model_len}.", param=max_param, code="context_length_exceeded")
            return requested
        return min(self.config.service.default_max_tokens, room)

    def _group(self, req: TurnRequest, state: RolloutState | None, prompt_ids: list[int]) -> str | None:
        """The group whose home engine the rollout's first call starts on, under
        routing.group_placement together or as a member of a call with n > 1: its group
        (X-Rollout-Group or the call's), else the digest of its first prompt, which a GRPO group's
        rollouts share. None: the routing policy alone decides."""
        if req.rollout_id is None or not (req.group_together or self.config.routing.group_placement == "together"):
            return None
        if state is not None and state.turn:
            return None  # its later calls follow its own pin (or, if that engine left, the least loaded)
        if req.rollout_group is not None:
            return req.rollout_group
        return "prompt:" + hashlib.blake2b(array("q", prompt_ids).tobytes(), digest_size=12).hexdigest()

    async def _generate(self, rollout_id, prompt_ids, sampling, max_tokens, stream=True, routed=None, group=None):
        """Generate on the rollout's engine, failing over to another engine while nothing was passed
        on (:meth:`FleetClient.generate_with_failover`). Streaming calls get the engine's chunks as
        they come; a non-streaming call is one round trip. ``routed`` gets each attempt's route; a
        pin moved by the routing policy is counted here and at the fleet."""
        request = GenerateRequest(prompt_ids=list(prompt_ids), sampling=sampling, max_tokens=max_tokens,
                                  rollout_id=rollout_id)
        routed = [] if routed is None else routed
        chunks = self.fleet.generate_with_failover(rollout_id, request, stream, routed=routed, group=group)
        seams = SeamStops(self.tokenizer, sampling.stop, sampling.skip_special_tokens) if sampling.stop else None
        drawn = self.canary is not None and self.canary.draw()
        ids: list[int] = []
        lps: list[float] = []
        try:
            async for chunk in chunks:
                if seams is not None:
                    passed = seams.feed(chunk)
                    if passed is not chunk:  # a stop string across a migration seam ends it here
                        yield passed
                        return  # (closing the call aborts the rest in the engine)
                if drawn:
                    ids += chunk.token_ids
                    lps += chunk.logprobs
                    if chunk.finish_reason is not None and routed:
                        self.canary.take(Generation(
                            prompt_ids=request.prompt_ids, token_ids=ids, logprobs=lps, sampling=sampling,
                            slot=routed[-1].member.slot, weight_versions=list(chunk.weight_versions or ()),
                            migrations=chunk.migrations, kv_resets=chunk.kv_resets, kv_base=chunk.kv_base))
                yield chunk
        except (NoEngineAvailable, EngineLostDuringCall, EngineCallDeadline) as exc:
            raise http_error(exc) from None
        except Exception as exc:
            refused = engine_refusal(exc)
            if refused is not None:
                raise refused from None
            raise
        finally:
            await chunks.aclose()
            if any(r.moved for r in routed):
                get_metrics().pin_moved()
                self.fleet.report_pin_move()


async def counted_call(mode: str, events: AsyncIterator) -> AsyncIterator:
    """A call's events, counted (calls by mode) and in flight while they run (metrics)."""
    metrics = get_metrics()
    metrics.call_started(mode)
    ended = False
    try:
        async for event in events:
            if isinstance(event, TurnResult) and not ended:
                # The call is over once its result exists: not when (or whether) the consumer
                # closes this generator after reading it.
                ended = True
                metrics.call_ended(mode)
            yield event
    finally:
        if not ended:
            metrics.call_ended(mode)
