"""Token texts as vLLM's server names them in logprobs: each id decoded alone, except that an id
ending in half a UTF-8 character is decoded after the sampled ids before it, which completes the
character or leaves the text empty; and vLLM's ``prompt_logprobs`` shape built on them."""

from __future__ import annotations

import os
from typing import Any

UTF8_CONTEXT = 4  # sampled ids before a token that can hold the rest of its UTF-8 character
REPLACEMENT_CHAR = "\ufffd"
LOGPROB_FLOOR = -9999.0  # vLLM's JSON for a logprob of -inf (a token the sampler filtered out)
TOKEN_TEXT_CACHE = 200_000  # ids whose text alone is kept (a vocabulary's worth)


def context_of(ids: list[int], new: int) -> list[int]:
    """The ids before the last ``new`` that can hold the start of a character the next one completes."""
    end = len(ids) - new
    return ids[max(0, end - UTF8_CONTEXT):end]


class TokenTexts:
    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self._alone: dict[int, str] = {}

    def token_strs(self, ids, tops=None, context=()) -> list[dict[int, str]]:
        """Per position, the text of the sampled id and of its alternatives (``context``: the
        generation's ids before ``ids``)."""
        out: list[dict[int, str]] = []
        before = [int(t) for t in context[-UTF8_CONTEXT:]]
        for i, tid in enumerate(ids):
            alts = [int(tid), *(int(t) for t in ((tops[i] if tops and i < len(tops) else None) or {}) if t != tid)]
            out.append({t: self._text(t, before) for t in alts})
            before = (before + [int(tid)])[-UTF8_CONTEXT:]
        return out

    def prompt_logprobs(self, prompt_ids: list[int], positions: list) -> list[dict[str, dict[str, Any]] | None]:
        """vLLM's ``prompt_logprobs`` answer: per prompt position None (the first) or, keyed by token id,
        each entry's ``logprob`` (-inf as -9999.0), ``rank`` and ``decoded_token``, the prompt's own token first
        (a token's text is completed by the prompt tokens before it that have entries, as vLLM names them)."""
        out: list[dict[str, dict[str, Any]] | None] = []
        for j, entry in enumerate(positions):
            if entry is None:
                out.append(None)
                continue
            strs = self.token_strs([prompt_ids[j]], [{t: lp for t, lp, _ in entry}], prompt_ids[1:j][-UTF8_CONTEXT:])[0]
            out.append({str(t): {"logprob": max(lp, LOGPROB_FLOOR), "rank": rank, "decoded_token": strs.get(t, "")}
                        for t, lp, rank in entry})
        return out

    def _decoded_alone(self, tid: int) -> str:
        text = self._alone.get(tid)
        if text is None:
            if len(self._alone) >= TOKEN_TEXT_CACHE:
                self._alone.clear()
            text = self._alone[tid] = self.tokenizer.decode([tid])
        return text

    def _text(self, tid: int, before: list[int]) -> str:
        alone = self._decoded_alone(tid)
        if not alone.endswith(REPLACEMENT_CHAR):
            return alone
        for n in range(1, len(before) + 1):
            ctx = before[-n:]
            whole = self.tokenizer.decode(ctx + [tid])
            if whole.endswith(REPLACEMENT_CHAR):
                continue
            # The context's own unfinished bytes (tokens that read as empty) belong to this token's text.
            clean = len(ctx)
            while clean > 0 and self._decoded_alone(ctx[clean - 1]).endswith(REPLACEMENT_CHAR):
                clean -= 1
            prefix = self.tokenizer.decode(ctx[:clean]) if clean else ""
            return whole[len(os.path.commonprefix([prefix, whole])):]
        return ""
