"""The worker's half of the canary's scoring path: processed logprobs over the whole vocabulary.

A teacher-forced prefill with ``prompt_logprobs`` returns raw logprobs and the top few of each
position. Replaying vLLM's sampler from those works where the kept set is among the top few (top-k),
but a temperature without top-k needs the normaliser over every logit, and a top-p or min-p over the
vocabulary needs the whole sorted distribution. So the worker, where the logits are, computes the
processed logprob of each prompt token itself, the way vLLM's sampler does at a decode step
(``Sampler.sample``): the logits in float32 divided by the temperature, min-p (vLLM's
``MinPLogitsProcessor``), then vLLM's own ``apply_top_k_top_p``, then the log-softmax.

A scoring request asks for it through ``SamplingParams.extra_args[EXTRA_ARG]`` (its key, temperature,
top-k, top-p, min-p and the tolerance of a top-p decision); :meth:`ScoringWorker.rs_scoring_tap`
wraps the model runner's prompt-logprobs step once so that, for such a request, each prefill chunk's
logits are processed before vLLM turns them into raw prompt logprobs; the engine actor collects the
values with :meth:`ScoringWorker.rs_take_processed` once the request ended. Other requests are
untouched. The wrapped step and the attributes it reads (``num_prompt_logprobs``, ``requests``,
``input_batch.req_id_to_index``, ``query_start_loc``, ``model.compute_logits``) are the pinned
vLLM's model runner (``_get_prompt_logprobs_dict``), read there.
"""

from __future__ import annotations

import collections
import logging
import threading
from typing import Any

logger = logging.getLogger(__name__)

EXTRA_ARG = "rs_processed_scores"
MAX_KEPT = 256  # results not taken yet (a scoring request aborted before its take), oldest dropped first
ROWS = 64  # logits rows processed at once (each row is the whole vocabulary)
FAILED = False  # kept for a key whose processing raised: its take answers None


def processed_rows(logits, targets, temperature: float, top_k: int, top_p: float, min_p: float,
                   tolerance: float) -> list[float | None]:
    """The processed logprob of ``targets[i]`` under ``logits[i]`` (float32, as vLLM's sampler), or
    None where a cut is within ``tolerance`` of deciding otherwise (vLLM decides it over the decode
    step's logits, and may fall on the other side): a top-p decision within it of p (in probability),
    a token within it of the min-p threshold (relative), a top-k cut between two logits within it.
    -inf: a token the processing drops. A top-k at or above the vocabulary is off, as in vLLM."""
    import torch
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

    device = logits.device
    if top_k >= logits.shape[-1]:
        top_k = 0
    out: list[float | None] = []
    for a in range(0, logits.shape[0], ROWS):
        x = logits[a:a + ROWS].to(torch.float32) / temperature
        rows = x.shape[0]
        uncertain = torch.zeros(rows, dtype=torch.bool, device=device)
        if min_p > 0:
            probs = torch.softmax(x, dim=-1)
            threshold = probs.amax(dim=-1, keepdim=True) * min_p
            uncertain |= ((probs - threshold).abs() < tolerance * threshold).any(dim=-1)
            x = x.masked_fill(probs < threshold, -float("inf"))
        if top_k > 0:
            edge = x.topk(top_k + 1, dim=-1).values
            uncertain |= (edge[:, -2] - edge[:, -1]).abs() < tolerance
        if top_p < 1.0:
            kept = x if top_k <= 0 else x.masked_fill(x < edge[:, -2:-1], -float("inf"))
            cum = torch.softmax(kept.sort(dim=-1).values, dim=-1).cumsum(dim=-1)  # ascending, as vLLM's top-p
            uncertain |= (cum - (1.0 - top_p)).abs().amin(dim=-1) < tolerance
        k = torch.full((rows,), top_k, dtype=torch.long, device=device) if top_k > 0 else None
        p = torch.full((rows,), top_p, dtype=torch.float32, device=device) if top_p < 1.0 else None
        masked = apply_top_k_top_p(x.clone(), k, p)
        picked = targets[a:a + ROWS, None].to(device=device, dtype=torch.long)
        values = torch.log_softmax(masked, dim=-1).gather(-1, picked).squeeze(-1)
        out.extend(None if u else float(v) for v, u in zip(values.tolist(), uncertain.tolist()))
    return out


class ScoringWorker:
    """Mixed into the worker extension (:class:`~rollout_service.weights.worker_extension.RolloutWorkerExtension`)."""

    def rs_scoring_tap(self) -> bool:
        """Wrap the model runner's prompt-logprobs step (once); True when it is wrapped, False when this
        model runner has no such step (vLLM's Model Runner V2 computes prompt logprobs elsewhere)."""
        runner = self.model_runner
        if getattr(runner, "_rs_scoring_tapped", False):
            return True
        original = getattr(runner, "_get_prompt_logprobs_dict", None)
        if original is None or not hasattr(runner, "query_start_loc"):
            return False
        self._rs_processed: collections.OrderedDict[str, list[float | None]] = collections.OrderedDict()
        self._rs_processed_lock = threading.Lock()

        def tapped(hidden_states, num_scheduled_tokens):
            self._rs_process_chunks(hidden_states, num_scheduled_tokens)
            return original(hidden_states, num_scheduled_tokens)

        runner._get_prompt_logprobs_dict = tapped
        runner._rs_scoring_tapped = True
        return True

    def rs_take_processed(self, key: str) -> list[float | None] | None:
        """The processed logprobs of the request that asked under ``key``: one per prompt position from
        the second (the first has none); None if this worker computed none for it."""
        lock = getattr(self, "_rs_processed_lock", None)
        if lock is None:
            return None
        with lock:
            values = self._rs_processed.pop(key, None)
        return None if values is FAILED else values

    def _rs_process_chunks(self, hidden_states, num_scheduled_tokens: dict[str, int]) -> None:
        runner = self.model_runner
        for req_id in list(runner.num_prompt_logprobs):
            n = num_scheduled_tokens.get(req_id)
            request = runner.requests.get(req_id)
            if n is None or request is None or request.prompt_token_ids is None or request.sampling_params is None:
                continue
            spec: dict[str, Any] | None = (request.sampling_params.extra_args or {}).get(EXTRA_ARG)
            if not spec:
                continue
            try:
                self._rs_process_chunk(runner, req_id, request, n, hidden_states, spec)
            except Exception:  # never the engine step's failure: this score is missing (the canary counts it)
                logger.warning("whole-vocabulary scoring of %s failed", spec.get("key"), exc_info=True)
                with self._rs_processed_lock:
                    self._rs_processed[spec["key"]] = FAILED

    def _rs_process_chunk(self, runner, req_id: str, request, n: int, hidden_states, spec: dict[str, Any]) -> None:
        """This prefill chunk's processed logprobs of the request ``spec`` names."""
        import torch

        prompt = request.prompt_token_ids
        start = request.num_computed_tokens  # this chunk's first position (as the wrapped step reads it)
        count = min(n, len(prompt) - start - 1)
        if count <= 0:
            return
        offset = runner.query_start_loc.np[runner.input_batch.req_id_to_index[req_id]].item()
        logits = runner.model.compute_logits(hidden_states[offset:offset + count])
        if logits is None:  # a tensor-parallel rank that does not hold the gathered logits
            return
        targets = torch.tensor(prompt[start + 1:start + 1 + count], dtype=torch.long)
        values = processed_rows(logits, targets, float(spec["temperature"]), int(spec.get("top_k", 0)),
                                float(spec.get("top_p", 1.0)), float(spec.get("min_p", 0.0)),
                                float(spec.get("tolerance", 0.0)))
        with self._rs_processed_lock:
            kept = self._rs_processed.get(spec["key"])
            if kept is FAILED:
                return
            if kept is None:
                kept = self._rs_processed[spec["key"]] = [None] * (len(prompt) - 1)
                while len(self._rs_processed) > MAX_KEPT:
                    self._rs_processed.popitem(last=False)
            kept[start:start + count] = values
