"""Incremental text of a streaming call: new ids in, new reasoning / content text out.

Each chunk costs work proportional to the chunk, not to the answer so far: ids are detokenized with
the tokenizer's streaming decoder (``tokenizers.decoders.DecodeStream``, which holds back an
incomplete UTF-8 sequence until it is complete), and reasoning is split from content by vLLM's own
streaming parser (``Parser.parse_delta`` of the configured reasoning parser, as ``vllm serve``
streams). Tool calls are not streamed token by token: with tools on, content from the Hermes / Qwen
tool-call marker (``<tool_call>``) on is held back and the calls arrive parsed (by the same parser as
a non-streaming call) with the final event. A parser whose calls start otherwise streams them as
content (docs/data-plane.md, "Streaming").
"""

from __future__ import annotations

from typing import Any

from rollout_service.onpolicy.parsing import stop_string_end

TOOL_CALL_MARKER = "<tool_call>"


class StreamParser:
    def __init__(self, tokenizer: Any, *, reasoning_parser: str | None, chat_template_kwargs: dict[str, Any] | None,
                 prompt_ids: list[int], hold_tool_calls: bool, silent: bool = False,
                 stop: list[str] | None = None, include_stop: bool = False):
        from tokenizers.decoders import DecodeStream

        self._tok = tokenizer
        self._decoder = DecodeStream(skip_special_tokens=True)
        self._prompt_ids: list[int] | None = list(prompt_ids)
        self._hold = hold_tool_calls
        self._silent = silent  # forced tool calls: nothing streams, the call arrives parsed
        self._held = ""  # content not sent yet: a possible start of the marker, or trailing newlines
        self._tool_started = False
        # Stop strings, as vLLM's detokenizer streams them: all but the last (longest - 1) characters
        # go out while generating (those could begin a stop string), and the end is cut at the stop
        # string that ended the call (with include_stop, at its end, and nothing is held back).
        self._stop = [x for x in (stop or []) if x]
        self._include_stop = include_stop
        self._hold_chars = 0 if include_stop or not self._stop else max(len(x) for x in self._stop) - 1
        self._text = ""
        self._sent = 0
        self._parser = None
        self._request = None
        if reasoning_parser and not silent:
            from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

            from rollout_service.onpolicy.parsing import TokenizerKey, parser_class, vllm_tokenizer

            vtok = vllm_tokenizer(tokenizer)
            kwargs = dict(chat_template_kwargs or {})
            request = ChatCompletionRequest(model="rollout-service", messages=[{"role": "user", "content": ""}],
                                            chat_template_kwargs=kwargs or None)
            self._parser = parser_class(reasoning_parser, None, TokenizerKey(vtok))(vtok, None, chat_template_kwargs=kwargs)
            self._request = self._parser.adjust_request(request)

    def push(self, ids: list[int], finished: bool = False, stop_reason: int | str | None = None) -> tuple[str, str]:
        """Feed new ids (``finished``: the call's last; ``stop_reason``: what ended it); return the
        (reasoning, content) text they completed."""
        if self._silent:
            return "", ""
        text = (self._decoder.step(self._tok._tokenizer, list(ids)) or "") if ids else ""
        if self._stop:
            text = self._released(text, finished, stop_reason)
        if self._parser is None:
            reasoning, content = "", text
        else:
            delta = self._parser.parse_delta(text, list(ids), self._request, self._prompt_ids, finished=finished)
            self._prompt_ids = None  # only the first call inspects the prompt
            reasoning = (delta.reasoning or "") if delta else ""
            content = (delta.content or "") if delta else ""
        return reasoning, self._filter(content, finished)

    def _released(self, text: str, finished: bool, stop_reason: int | str | None) -> str:
        before = len(self._text.rstrip("\ufffd"))
        self._text += text
        if finished and isinstance(stop_reason, str):
            end = stop_string_end(self._text, before, stop_reason, self._include_stop)
        elif finished:
            end = len(self._text)
        else:
            end = len(self._text) - self._hold_chars
        out = self._text[self._sent:end] if end > self._sent else ""
        self._sent = max(self._sent, end)
        return out

    def _filter(self, content: str, finished: bool) -> str:
        """With tools on, hold back the tool-call text (and what may be its start) until it is known."""
        if not self._hold:
            return content
        if self._tool_started:
            return ""
        pending = self._held + content
        cut = pending.find(TOOL_CALL_MARKER)
        if cut >= 0:
            self._tool_started = True
            self._held = ""
            return pending[:cut].rstrip("\n")
        if finished:
            self._held = ""
            return pending
        keep = _possible_marker_start(pending)
        stripped = pending[:keep].rstrip("\n")
        self._held = pending[len(stripped):]
        return stripped


def _possible_marker_start(text: str) -> int:
    """Index where a suffix of ``text`` could begin the marker (``len(text)`` if none could)."""
    for n in range(min(len(TOOL_CALL_MARKER) - 1, len(text)), 0, -1):
        if TOOL_CALL_MARKER.startswith(text[-n:]):
            return len(text) - n
    return len(text)
