"""Stop strings across a migration seam.

A call whose engine died mid-generation continues on another engine from the ids generated so far
(:mod:`rollout_service.fleet.migration`). That engine matches stop strings only in the text it
generates itself; a stop string that begins before the seam and ends after it is caught here, on
the decoded ids, and ends the call as the engine would have: ``finish_reason`` stop, the stop
string as ``stop_reason``, the ids up to and including the one that completed it.
"""

from __future__ import annotations

from dataclasses import replace

from rollout_service.engine.types import GenerationChunk, spans_up_to


class SeamStops:
    """Watches a call's chunks for a stop string straddling each seam (a new ``migrations`` count)."""

    def __init__(self, tokenizer, stop: list[str], skip_special_tokens: bool):
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.skip = skip_special_tokens
        self.longest = max((len(s) for s in self.stop), default=0)
        self.ids: list[int] = []
        self.migrations = 0
        self.seam: int | None = None  # index in ids of the first id after the open seam

    def _text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip)

    def feed(self, chunk: GenerationChunk) -> GenerationChunk:
        """``chunk`` as passed on: cut and finished if it completes a stop string across a seam."""
        if not self.stop:
            return chunk
        if chunk.migrations > self.migrations:
            self.migrations, self.seam = chunk.migrations, len(self.ids)
        start = len(self.ids)
        self.ids += chunk.token_ids
        if self.seam is None or not chunk.token_ids:
            return chunk
        # Enough ids before the seam to hold all but the last character of any stop string.
        lo = max(0, self.seam - self.longest - 2)
        before = self._text(self.ids[lo:self.seam])
        after = self._text(self.ids[lo:])
        if len(after) - len(before) >= self.longest:  # no stop string can straddle this seam any more
            self.seam = None
        hit = self._straddling(after, len(before))
        if hit is None:
            return chunk
        stop, end_char = hit
        # The first id whose text completes the stop string.
        for n in range(1, len(self.ids) - lo + 1):
            if len(self._text(self.ids[lo:lo + n])) >= end_char:
                cut = lo + n
                break
        else:  # pragma: no cover - the full text holds it
            cut = len(self.ids)
        keep = max(0, cut - start)
        self.ids, self.seam = self.ids[:cut], None
        return replace(
            chunk, token_ids=chunk.token_ids[:keep], logprobs=chunk.logprobs[:keep],
            top_logprobs=None if chunk.top_logprobs is None else chunk.top_logprobs[:keep],
            finish_reason="stop", stop_reason=stop,
            weight_versions=None if chunk.weight_versions is None else spans_up_to(chunk.weight_versions, cut))

    def _straddling(self, text: str, seam_char: int) -> tuple[str, int] | None:
        """The stop string that starts before ``seam_char`` and ends after it, earliest end first."""
        best = None
        for s in self.stop:
            i = text.find(s, max(0, seam_char - len(s) + 1))
            while i != -1 and i < seam_char:
                if i + len(s) > seam_char:
                    if best is None or i + len(s) < best[1]:
                        best = (s, i + len(s))
                    break
                i = text.find(s, i + 1)
        return best
