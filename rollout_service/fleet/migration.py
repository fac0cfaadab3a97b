"""Carrying one generation across engines (mid-turn migration).

When the engine serving a call dies after it passed on tokens, the call continues on a live engine
from its prompt + the ids generated so far, with ``max_tokens`` reduced by them and the same
sampling parameters. What the caller sees stays one generation: the ids and processed logprobs as
sampled (the first engine's, then the next one's), the weight-version spans over all of them (a
version change at the seam is a span boundary like any other), the original prompt length, and how
many times it moved (``GenerationChunk.migrations``).

A generation whose state lives in the engine beyond its ids cannot be carried over honestly:
a grammar (the structured-output state machine is not advanced over the generated prefix) and
presence / frequency penalties (they count the generated ids, which the continuation sees as
prompt). Those end with :class:`~rollout_service.fleet.types.EngineLostDuringCall`, as before.
Stop strings are matched by the engine within what it generates; one that straddles the seam is
the data plane's to catch (it holds the tokenizer).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from rollout_service.engine.types import GenerateRequest, GenerationChunk


def merge_spans(spans) -> list[tuple[str, int, int]]:
    """Adjacent spans of one version joined, empty ones dropped."""
    out: list[tuple[str, int, int]] = []
    for v, s, e in spans:
        if e <= s:
            continue
        if out and out[-1][0] == v and out[-1][2] == s:
            out[-1] = (v, out[-1][1], e)
        else:
            out.append((v, s, e))
    return out


def unmovable(request: GenerateRequest, progress: "Progress | None" = None) -> str | None:
    """Why this generation cannot continue on another engine, or None if it can."""
    if progress is not None and progress.labelled_only:
        return ("the engine did not report the weight version of each generated id, so the spans across the "
                "seam could not be exact")
    s = request.sampling
    if s.structured_outputs:
        return "a grammar-constrained generation cannot continue on another engine (its grammar state is not carried)"
    if s.presence_penalty or s.frequency_penalty:
        return ("presence / frequency penalties count the generated ids, which another engine would see as prompt: "
                "the generation cannot continue there exactly")
    return None


@dataclass
class Progress:
    """What a call has passed on so far, over every engine it ran on."""

    request: GenerateRequest  # as the caller made it
    ids: list[int] = field(default_factory=list)
    spans: list[tuple[str, int, int]] = field(default_factory=list)  # of the engines left behind
    offset: int = 0  # ids generated on the engines left behind
    current: list[tuple[str, int, int]] = field(default_factory=list)  # this engine's, relative to offset
    migrations: int = 0
    # KV resets (GenerationChunk.kv_resets) of the engines left behind, each seam included (the next
    # engine prefills prompt + ids anew), and this engine's, relative to offset.
    resets: list[int] = field(default_factory=list)
    current_resets: list[int] = field(default_factory=list)
    kv_base: str | None = None  # the first engine's (GenerationChunk.kv_base)
    finished: bool = False
    labelled_only: bool = False  # a chunk came without spans: its ids' versions are not known exactly

    def take(self, chunk: GenerationChunk) -> GenerationChunk:
        """Record ``chunk`` and return it as the caller must see it."""
        before = len(self.ids) - self.offset
        self.ids += chunk.token_ids
        if chunk.kv_resets is not None:
            self.current_resets = list(chunk.kv_resets)
        if self.kv_base is None and not self.migrations:
            self.kv_base = chunk.kv_base
        if chunk.weight_versions is not None:
            self.current = [tuple(span) for span in chunk.weight_versions]
        elif chunk.token_ids:  # an engine that labels its chunks only: the version it had when it sent them
            self.labelled_only = True
            self.current = merge_spans([*self.current, (chunk.weight_version, before, before + len(chunk.token_ids))])
        if chunk.finish_reason is not None:
            self.finished = True
        if not self.migrations:
            return chunk
        return replace(chunk, num_prompt_tokens=len(self.request.prompt_ids), migrations=self.migrations,
                       weight_versions=self.all_spans(), kv_resets=self.all_resets(), kv_base=self.kv_base)

    def all_resets(self) -> list[int]:
        return [*self.resets, *(r + self.offset for r in self.current_resets)]

    def all_spans(self) -> list[tuple[str, int, int]]:
        return merge_spans([*self.spans, *((v, s + self.offset, e + self.offset) for v, s, e in self.current)])

    def continuation(self) -> GenerateRequest | None:
        """The request that continues the generation on another engine (None: nothing is left to
        generate, the call ends with ``length``)."""
        self.spans, self.resets = self.all_spans(), [*self.all_resets(), len(self.ids)]
        self.offset, self.current, self.current_resets = len(self.ids), [], []
        self.migrations += 1
        left = self.request.max_tokens - len(self.ids)
        if left <= 0:
            return None
        # The prompt's logprobs came with the first engine's first chunk: not asked of the continuation.
        sampling = (self.request.sampling if self.request.sampling.prompt_logprobs is None
                    else self.request.sampling.model_copy(update={"prompt_logprobs": None}))
        return GenerateRequest(prompt_ids=[*self.request.prompt_ids, *self.ids], sampling=sampling,
                               max_tokens=left, batch_window_s=self.request.batch_window_s,
                               rollout_id=self.request.rollout_id)

    def length_end(self, engine_index: int) -> GenerationChunk:
        """The final chunk of a call whose engine died right after its last allowed id."""
        return GenerationChunk(token_ids=[], logprobs=[], top_logprobs=[] if self.request.sampling.top_logprobs else None,
                               finish_reason="length", weight_versions=self.all_spans(), kv_resets=self.all_resets(),
                               kv_base=self.kv_base,
                               weight_version=self.spans[-1][0] if self.spans else None,
                               num_prompt_tokens=len(self.request.prompt_ids), engine_index=engine_index,
                               migrations=self.migrations)
