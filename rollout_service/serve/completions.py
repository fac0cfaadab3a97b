"""A raw completion (``/v1/completions``): token ids or text in, no rollout semantics and no chat
template. The prompt cut as ``truncate_prompt_tokens`` asks and its ids checked against the
vocabulary, the generation streamed as text deltas (the prompt's text echoed first if asked), then
one result with the text as vLLM's detokenizer ends it and the generation's weight spans. Nothing is
stored.

A mixin of :class:`~rollout_service.serve.turns.TurnRunner` (its tokenizer and token texts; its
engine call: :class:`~rollout_service.serve.engine_calls.EngineCalls`).
"""

from __future__ import annotations

from typing import AsyncIterator

from rollout_service.engine.types import kv_spans
from rollout_service.onpolicy.parsing import generation_text
from rollout_service.serve.engine_calls import counted_call
from rollout_service.serve.protocol.envelope import bad_request
from rollout_service.serve.streaming import StreamParser
from rollout_service.serve.token_texts import context_of
from rollout_service.serve.truncation import fitted, truncated
from rollout_service.serve.turn_types import CompletionCall, TokenDelta, TurnResult


class RawCompletions:
    vocab_size: int  # the TurnRunner's
    max_model_len: int

    def run_completion(self, call: CompletionCall) -> AsyncIterator[TokenDelta | TurnResult]:
        """Raw completion on token ids (or text): no rollout semantics, no chat template."""
        return counted_call("completion", self._run_completion(call))

    async def _run_completion(self, call: CompletionCall) -> AsyncIterator[TokenDelta | TurnResult]:
        prompt = call.prompt
        ids_in = list(prompt) if isinstance(prompt, list) else self.tokenizer.encode(prompt, add_special_tokens=False)
        cut = truncated(ids_in, call.truncate_prompt_tokens, call.truncation_side, max_model_len=self.max_model_len,
                        max_tokens=call.max_tokens if call.max_tokens_given else None)
        requested = call.max_tokens
        if cut is not ids_in:  # the prompt is what is left of it, echoed text included
            prompt = ids_in = cut
        if call.truncate_prompt_tokens is not None:
            requested = fitted(requested, len(ids_in), self.max_model_len)
        bad = next((t for t in ids_in if not (0 <= t < self.vocab_size)), None)
        if bad is not None:
            raise bad_request(f"prompt token id {bad} is out of range (vocabulary size {self.vocab_size})", param="prompt")
        sampling = self._sampling(call.sampling, call.top_logprobs, call.structured_outputs)
        max_tokens = self._max_tokens(requested, len(ids_in))
        echo = ({"text": "" if not call.echo_text else prompt if isinstance(prompt, str) else self.tokenizer.decode(ids_in),
                 "first_token": self.tokenizer.decode([ids_in[0]])} if call.echo else None)
        decoder = StreamParser(self.tokenizer, reasoning_parser=None, chat_template_kwargs=None, prompt_ids=ids_in,
                               hold_tool_calls=False, stop=sampling.stop,
                               include_stop=sampling.include_stop_str_in_output) if call.stream else None
        ids, lps, tops, final = [], [], [], None
        prompt_sent = False
        prompt_lps = None
        async for chunk in self._generate(None, ids_in, sampling, max_tokens, stream=call.stream):
            ids += chunk.token_ids
            lps += chunk.logprobs
            tops += chunk.top_logprobs or []
            if chunk.prompt_logprobs is not None and prompt_lps is None:
                prompt_lps = chunk.prompt_logprobs
            final = chunk
            if decoder is not None and (chunk.token_ids or chunk.finish_reason):
                _, text = decoder.push(chunk.token_ids, finished=chunk.finish_reason is not None,
                                       stop_reason=chunk.stop_reason)
                if call.discard_output:
                    text = ""
                if echo is not None and not prompt_sent:  # vLLM: the first chunk starts with the prompt's text
                    text = echo["text"] + text
                if chunk.token_ids or text:
                    yield TokenDelta(token_ids=chunk.token_ids, logprobs=chunk.logprobs, top_logprobs=chunk.top_logprobs,
                                     content=text, prompt_token_ids=None if prompt_sent else ids_in,
                                     token_strs=self.token_strs(chunk.token_ids, chunk.top_logprobs,
                                                                context_of(ids, len(chunk.token_ids)))
                                     if call.want_token_strs else None)
                    prompt_sent = True
        stop_string = ((final.stop_reason, sampling.include_stop_str_in_output)
                       if isinstance(final.stop_reason, str) else None)
        yield TurnResult(
            prompt_token_ids=ids_in, generation_token_ids=ids, generation_log_probs=lps, top_logprobs=tops or None,
            finish_reason=final.finish_reason or "stop", stop_reason=final.stop_reason, message={},
            text=generation_text(self.tokenizer, ids, sampling.skip_special_tokens, stop_string),
            weight_versions=[{"version": v, "start": s, "end": e, "kv_version": kv}
                             for v, s, e, kv in kv_spans(final.weight_versions or [], final.kv_resets, final.kv_base)],
            engine_index=final.engine_index, token_strs=self.token_strs(ids, tops) if call.want_token_strs else None,
            prompt_logprobs=self.prompt_logprobs(ids_in, prompt_lps) if prompt_lps is not None else None,
            echo=echo, discard_output=call.discard_output,
        )
