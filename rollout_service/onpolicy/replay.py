"""Answer a retried call from the store: what the call it repeats returned, rebuilt exactly.

A client whose answer was lost (network blip, proxy restart) sends the call again. Generating again
would be wrong twice over: the retry's messages no longer extend the stored history (the stored
turn already holds an assistant output the client never saw), so it would fork a segment and leave
the orphaned turn in the trajectory as if the agent had seen it; and the new answer would not be
the one the trainer's tokens say the agent got. So a retry replays: everything the first answer
carried comes back from the stored turn.

What a stored turn holds, and how each answer field is rebuilt from it:

- ``prompt_token_ids``: the whole prompt the call used. A call's prompt is everything in its
  segment before its generation (the earlier prompt, generations and tails, then its own tail; or
  the whole fresh render on a new segment): ``segment.token_ids[:gen_start]``.
- ``generation_token_ids`` / ``generation_log_probs``: ``[gen_start:gen_end]`` of the segment
  (logprobs as stored: float32-rounded, as every load returns them).
- ``weight_versions``: the data plane answers with the engine's spans, offsets relative to the
  generation; ``finish_turn`` stores them shifted by ``gen_start`` (segment offsets). Replay shifts
  back: ``start - gen_start``, ``end - gen_start``.
- ``finish_reason``: the record's (after the data plane's ``stop`` -> ``tool_calls`` rewrite, which
  happens before ``finish_turn``).
- ``message`` and ``stop_reason``: not derivable from tokens (tool-call ids are random, parsers can
  change), so the data plane stores them on the record as ``answer`` (:func:`stored_answer`).
- ``rollout``: ``{id, turn, segment, monotonic}`` as the first answer reported them.

The request digest (which fields of a request make it "the same call") is the data plane's
definition; here it is an opaque string carried on the record and handed back for comparison.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from rollout_service.onpolicy.errors import OnPolicyError
from rollout_service.onpolicy.types import RolloutState, TurnRecord, WeightSpan


class NotReplayable(OnPolicyError, LookupError):
    """The rollout has no such turn, or the turn was stored without its answer (written before
    answers were stored, or in stateless mode), so it cannot be returned again."""

    status = 409
    code = "not_replayable"


def stored_answer(message: dict[str, Any], *, stop_reason: int | str | None = None,
                  text_cut: dict[str, Any] | None = None) -> dict[str, Any]:
    """The ``TurnRecord.answer`` of a call: the assistant message exactly as returned to the client
    (content, reasoning_content, tool_calls with their ids, ...) and the engine's ``stop_reason``
    (the stop string or token id that ended the generation, None otherwise). ``text_cut`` marks a
    message whose text a stop string cut short of its ids (``{"stop": s, "included": bool}``: the
    text ends before ``s``, or after it when included; the ids keep every sampled token)."""
    answer = {"message": copy.deepcopy(message), "stop_reason": stop_reason}
    if text_cut is not None:
        answer["text_cut"] = dict(text_cut)
    return answer


@dataclass
class ReplayedTurn:
    """A stored call's answer, field for field what the data plane returned the first time."""

    turn: int
    segment: int
    monotonic: bool
    prompt_token_ids: list[int]
    generation_token_ids: list[int]
    generation_log_probs: list[float]
    weight_versions: list[WeightSpan]  # offsets relative to the generation, as the engine reports them
    finish_reason: str
    stop_reason: int | str | None
    message: dict[str, Any]
    rollout_id: str | None
    request_digest: str | None = None
    idempotency_key: str | None = None
    usage: dict[str, int] = field(default_factory=dict)
    constrained: bool = False

    @property
    def rollout(self) -> dict[str, Any]:
        return {"id": self.rollout_id, "turn": self.turn, "segment": self.segment, "monotonic": self.monotonic,
                "constrained": self.constrained}

    def to_dict(self) -> dict[str, Any]:
        """The answer fields under the names the data plane's final event uses."""
        return {
            "prompt_token_ids": list(self.prompt_token_ids),
            "generation_token_ids": list(self.generation_token_ids),
            "generation_log_probs": list(self.generation_log_probs),
            "finish_reason": self.finish_reason,
            "stop_reason": self.stop_reason,
            "message": copy.deepcopy(self.message),
            "weight_versions": [w.to_dict() for w in self.weight_versions],
            "rollout": self.rollout,
            "usage": dict(self.usage),
        }


def _locate(state: RolloutState, turn_number: int) -> tuple[int, TurnRecord] | None:
    # Newest first: a retry almost always repeats the last call.
    for seg_index in range(len(state.segments) - 1, -1, -1):
        for record in reversed(state.segments[seg_index].turns):
            if record.turn == turn_number:
                return seg_index, record
            if record.turn < turn_number:
                return None
    return None


def replay_turn(state: RolloutState, turn_number: int) -> ReplayedTurn:
    """Rebuild the answer of stored call ``turn_number``; :class:`NotReplayable` if impossible.

    Pure: reads ``state`` and returns fresh lists and dicts (a cached state stays untouched)."""
    found = _locate(state, turn_number)
    if found is None:
        raise NotReplayable(f"rollout {state.rollout_id!r} has no stored turn {turn_number}")
    seg_index, rec = found
    if rec.answer is None or not isinstance(rec.answer.get("message"), dict):
        raise NotReplayable(f"turn {turn_number} of rollout {state.rollout_id!r} was stored without its answer")
    seg = state.segments[seg_index]
    prompt = seg.token_ids[: rec.gen_start]
    gen = seg.token_ids[rec.gen_start : rec.gen_end]
    return ReplayedTurn(
        turn=rec.turn,
        segment=seg_index,
        monotonic=rec.monotonic,
        constrained=rec.constrained,
        prompt_token_ids=prompt,
        generation_token_ids=gen,
        generation_log_probs=seg.logprobs[rec.gen_start : rec.gen_end],
        weight_versions=[WeightSpan(w.version, w.start - rec.gen_start, w.end - rec.gen_start, w.kv_version)
                         for w in rec.weight_versions],
        finish_reason=rec.finish_reason,
        stop_reason=rec.answer.get("stop_reason"),
        message=copy.deepcopy(rec.answer["message"]),
        rollout_id=state.rollout_id,
        request_digest=rec.request_digest,
        idempotency_key=rec.idempotency_key,
        usage={"prompt_tokens": len(prompt), "completion_tokens": len(gen), "total_tokens": len(prompt) + len(gen)},
    )


def find_turn(
    state: RolloutState | None, *, idempotency_key: str | None = None, request_digest: str | None = None
) -> int | None:
    """The turn number of the stored call a retry repeats, or None.

    ``idempotency_key``: the call stored under that key, at any turn (a client may retry an older
    call whose answer it lost; the data plane then compares ``request_digest`` to refuse the same
    key on a different body). ``request_digest`` (a retry without a key): only the *last* call can
    be repeated that way — an earlier call's request, sent again, is not a lost answer (the client
    saw the later turns), so it is not matched. Give exactly one of the two.
    """
    if (idempotency_key is None) == (request_digest is None):
        raise ValueError("give exactly one of idempotency_key and request_digest")
    if state is None or not state.segments:
        return None
    if request_digest is not None:
        turns = state.current.turns
        last = turns[-1] if turns else None
        if last is not None and last.turn == state.turn and last.request_digest == request_digest:
            return last.turn
        return None
    for seg in reversed(state.segments):
        for record in reversed(seg.turns):
            if record.idempotency_key == idempotency_key:
                return record.turn
    return None
