"""Data shapes shared by the on-policy core, the store and the Serve shells.

A rollout is a list of *segments*. Each segment is one exact, trainable token sequence: the prompt
of its first call, then per call the ids that call added (the rendered tail of new messages, and the
generated ids). A monotonic turn extends the last segment; an edited history (under the `fork`
policy) starts a new one. Each call stores only the ids it adds, so a rollout's size is linear in
its number of turns.
"""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass, field, fields
from typing import Any


@dataclass
class WeightSpan:
    """Generated tokens ``[start, end)`` (segment offsets) were sampled under weight ``version``,
    attending to KV cache of which the oldest part was computed by ``kv_version``'s weights (None:
    ``version`` itself, the KV is pure). A request in flight at a refit that keeps the KV
    (``refit.clear_cache: false``) samples its later tokens with the new weights over KV of the old:
    ``version`` new, ``kv_version`` old — mixed, not exactly either policy."""

    version: str
    start: int
    end: int
    kv_version: str | None = None

    @property
    def pure(self) -> bool:
        return self.kv_version is None or self.kv_version == self.version

    def to_dict(self) -> dict[str, Any]:
        """The wire form: ``kv_version`` always given (equal to ``version`` when pure)."""
        return {"version": self.version, "start": self.start, "end": self.end,
                "kv_version": self.version if self.kv_version is None else self.kv_version}


@dataclass
class TurnRecord:
    """One model call inside a segment; all offsets index the segment's ``token_ids``."""

    turn: int  # rollout-wide call number, 1-based
    prompt_start: int  # first id this call added to the segment (tail, or whole prompt on a new segment)
    gen_start: int  # first generated id; ids [prompt_start, gen_start) are prompt (loss mask 0)
    gen_end: int  # one past the last generated id
    finish_reason: str
    monotonic: bool
    weight_versions: list[WeightSpan] = field(default_factory=list)
    # What a retried call needs to be answered from the store instead of generating again (see
    # ``onpolicy/replay.py``). All optional: records written before they existed, and calls that do
    # not carry them (stateless mode), decode with None.
    request_digest: str | None = None  # the data plane's digest of the request; opaque here
    idempotency_key: str | None = None  # the client's Idempotency-Key, when it sent one
    answer: dict[str, Any] | None = None  # {"message": <assistant message as returned>, "stop_reason": ...}
    # Sampled under a grammar (forced tool_choice, response_format): the logprobs are renormalized
    # over the tokens the grammar allowed — the true sampling probabilities, but not what a forward
    # pass without the grammar gives. Trainers mask such turns or treat their ratios specially.
    constrained: bool = False
    # Times the call moved to another engine mid-generation (its engine died): the ids and logprobs
    # are still exactly what was sampled, the spans name each engine's version.
    migrations: int = 0

    def to_dict(self, *, copy_answer: bool = True) -> dict[str, Any]:
        """JSON-ready; optional fields that are None are left out, so a record without replay data
        stays byte-identical to the records written before those fields existed.

        ``copy_answer=False`` shares the ``answer`` dict with the record, for a caller that
        serialises the result at once (the store's encoder); the default never aliases the record."""
        d = {
            "turn": self.turn,
            "prompt_start": self.prompt_start,
            "gen_start": self.gen_start,
            "gen_end": self.gen_end,
            "finish_reason": self.finish_reason,
            "monotonic": self.monotonic,
            "weight_versions": [{"version": w.version, "start": w.start, "end": w.end} for w in self.weight_versions],
        }
        if any(not w.pure for w in self.weight_versions):
            # Beside the spans, not in them: a replica running older code (a rolling deploy) builds
            # spans from their keys and ignores record keys it does not know.
            d["kv_versions"] = [None if w.pure else w.kv_version for w in self.weight_versions]
        if self.request_digest is not None:
            d["request_digest"] = self.request_digest
        if self.idempotency_key is not None:
            d["idempotency_key"] = self.idempotency_key
        if self.answer is not None:
            d["answer"] = copy.deepcopy(self.answer) if copy_answer else self.answer
        if self.constrained:
            d["constrained"] = True
        if self.migrations:
            d["migrations"] = self.migrations
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "TurnRecord":
        """Keys this version does not know are ignored: during a rolling deploy, a replica running
        older code must still load a rollout a newer replica has appended to."""
        kv = d.get("kv_versions") or []
        d = {k: v for k, v in d.items() if k in _RECORD_FIELDS}
        d["weight_versions"] = [WeightSpan(w["version"], w["start"], w["end"], kv[i] if i < len(kv) else None)
                                for i, w in enumerate(d.get("weight_versions", []))]
        return cls(**d)


_RECORD_FIELDS = frozenset(f.name for f in fields(TurnRecord))


@dataclass
class Segment:
    token_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)  # 1 on model-generated ids
    logprobs: list[float] = field(default_factory=list)  # sampling logprob on generated ids, 0.0 elsewhere
    turns: list[TurnRecord] = field(default_factory=list)
    # Canonical messages of this segment so far, including each call's assistant output.
    messages: list[dict[str, Any]] = field(default_factory=list)
    # What the template needs to render the next tail the same way (tools, chat_template_kwargs).
    render_context: dict[str, Any] = field(default_factory=dict)


@dataclass
class RolloutState:
    rollout_id: str | None
    turn: int = 0  # completed calls
    segments: list[Segment] = field(default_factory=list)
    # Transient, never persisted: set by ``state_from_echo`` when the echoed ids show the messages
    # were edited before the last echoed call (a HistoryConflict as a dict). ``build_prompt``
    # treats it as a non-monotonic request under the configured policy.
    pending_conflict: dict[str, Any] | None = None
    # Transient, set by the store on load: which lifetime of ``rollout_id`` this snapshot belongs to
    # (a rollout deleted or expired and then created again under the same id gets a new one). A
    # cache validates by (turn, incarnation): the turn counter alone cannot tell a recreated rollout
    # that has reached the same turn from the one it holds. Not part of equality.
    incarnation: str | None = field(default=None, compare=False, repr=False)
    # Set by the store on load: how the rollout ended, if it did not just stop being called:
    # "aborted" (by the trainer: no further turn is admitted) or "stale" (a turn was refused for
    # being more versions behind than the staleness bound allows), with the reason given. Changed
    # only by the store's ``mark``, never by a turn. Not part of equality.
    status: str | None = field(default=None, compare=False)
    status_reason: str | None = field(default=None, compare=False, repr=False)

    @property
    def current(self) -> Segment | None:
        return self.segments[-1] if self.segments else None


@dataclass
class TurnDelta:
    """What one call appends to a rollout (the only thing the store writes per turn)."""

    turn: int
    segment_index: int
    new_segment: bool
    token_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    record: TurnRecord
    new_messages: list[dict[str, Any]]  # appended to the segment's message list
    render_context: dict[str, Any]

    def apply(self, state: RolloutState) -> RolloutState:
        """Apply in place (and return) — the same operation the store performs durably."""
        if self.new_segment:
            state.segments.append(Segment())
        seg = state.segments[self.segment_index]
        seg.token_ids.extend(self.token_ids)
        seg.loss_mask.extend(self.loss_mask)
        seg.logprobs.extend(self.logprobs)
        seg.turns.append(self.record)
        seg.messages.extend(self.new_messages)
        seg.render_context = self.render_context
        state.turn = self.turn
        return state
