"""The engine's teacher-forced scoring path: prompt + generated ids re-scored in one prefill.

vLLM's prompt logprobs (``SamplingParams.prompt_logprobs``) are the log-softmax of the model's logits
at every prompt position, computed in the prefill, before any sampling processor (vLLM:
"processed_* and raw_* yield the same scores here"), and a request that asks for them never reads
the prefix cache. That is the recompute the parity canary (:mod:`rollout_service.canary`) compares
with the logprobs the engine returned when it sampled: a different kernel path (prefill vs decode),
another batch, and no cache.

With ``ScoreRequest.processing`` the worker also computes each token's processed logprob over the
whole vocabulary (:mod:`rollout_service.weights.worker_scoring`: the request names itself in
``extra_args``, the engine collects the values by ``collective_rpc`` once the prefill ended).

A mixin of :class:`~rollout_service.engine.replica.EngineReplica` (its ``_engine``, ``config``,
``index`` and weight label).
"""

from __future__ import annotations

import contextlib
from dataclasses import asdict

from rollout_service.engine.types import EngineUnavailable, ScoreRequest, ScoreResult
from rollout_service.weights.worker_scoring import EXTRA_ARG


class Scoring:
    async def score(self, request: ScoreRequest) -> ScoreResult:
        """Raw logprobs of ``request.token_ids[start:]`` under this engine's weights (see
        :class:`~rollout_service.engine.types.ScoreRequest`). One extra token is generated greedily
        and discarded (vLLM needs room for one), so at most ``max_model_len - 1`` ids are scored."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        llm = self._engine()
        ids = list(request.token_ids[: max(1, self.config.max_model_len - 1)])
        start = max(1, request.start)  # position 0 has no logprob
        if start >= len(ids):
            return ScoreResult(weight_version=self._version, engine_index=self.index)
        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=request.num_top, flat_logprobs=True,
                                detokenize=False, output_kind=RequestOutputKind.FINAL_ONLY)
        if request.processing is not None:
            if getattr(self, "_scoring_tapped", None) is None:
                self._scoring_tapped = all(await llm.collective_rpc("rs_scoring_tap"))
            if not self._scoring_tapped:  # a model runner the worker cannot tap (Model Runner V2)
                return ScoreResult(weight_version=self._version, engine_index=self.index, whole_vocabulary=False)
            params.extra_args = {EXTRA_ARG: {"key": request.request_id, **asdict(request.processing)}}
        version = self._version
        final = None
        finished = False
        try:
            async for out in llm.generate(TokensPrompt(prompt_token_ids=ids), params, request.request_id):
                final = out
            finished = True
        finally:
            if not finished:
                with contextlib.suppress(Exception):
                    await llm.abort(request.request_id)
        flat = None if final is None else final.prompt_logprobs  # FlatLogprobs: position j -> [ids[j], top 1..k]
        reason = final.outputs[0].finish_reason if final is not None and final.outputs else None
        if flat is None or len(flat) != len(ids) or reason == "abort":
            raise EngineUnavailable(f"engine {self.index}: scoring request {request.request_id} ended without its "
                                    f"prompt logprobs (finish reason {reason})")
        lps, ranks, tops = [], [], [] if request.num_top else None
        for j in range(start, len(ids)):
            a, b = flat.start_indices[j], flat.end_indices[j]
            lps.append(flat.logprobs[a])
            ranks.append(flat.ranks[a])
            if tops is not None:
                tops.append(list(flat.logprobs[a + 1:b]))
        processed = None
        if request.processing is not None:
            taken = [x for x in await llm.collective_rpc("rs_take_processed", args=(request.request_id,))
                     if x is not None]
            if not taken or len(taken[0]) != len(ids) - 1:
                raise EngineUnavailable(f"engine {self.index}: scoring request {request.request_id} ended without "
                                        f"its processed logprobs")
            processed = taken[0][start - 1:]
        same = version == self._version
        return ScoreResult(weight_version=version if same else None, logprobs=lps, ranks=ranks, top_logprobs=tops,
                           processed=processed, engine_index=self.index)
