"""Byte layout of a stored rollout, shared by every store implementation.

Both stores keep the same encoded chunks (packed arrays, one JSON document per turn record and per
message), so the in-memory store has exactly the Redis store's semantics — float32 rounding of
logprobs, JSON normalisation of messages, the same validation errors — and tests written against
one hold for the other.

Arrays are little-endian explicitly (``<i4``, ``<f4``, ``u1``) so a history written on one machine
reads the same on any other; token ids need 32 bits (Qwen's specials sit at 151643+).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Iterable

import numpy as np

from rollout_service.onpolicy.types import RolloutState, Segment, TurnDelta, TurnRecord
from rollout_service.store.base import InvalidTurnDelta

IDS_DTYPE = np.dtype("<i4")
LOGPROBS_DTYPE = np.dtype("<f4")
MASK_DTYPE = np.dtype("u1")
_INT32_MAX = 2**31 - 1


@dataclass(frozen=True)
class EncodedDelta:
    turn: int
    segment_index: int
    new_segment: bool
    ids: bytes
    logprobs: bytes
    mask: bytes
    record: str
    messages: list[str]
    render_context: str


@dataclass
class EncodedSegment:
    ids: bytes = b""
    logprobs: bytes = b""
    mask: bytes = b""
    turns: list[bytes | str] | None = None
    messages: list[bytes | str] | None = None
    render_context: bytes | str | None = None


def _dumps(value: Any, what: str) -> str:
    try:
        return json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as e:
        raise InvalidTurnDelta(f"{what} is not JSON-serialisable: {e}") from None


def encode_delta(delta: TurnDelta, *, expected_turn: int) -> EncodedDelta:
    """Validate and pack a delta; raises ``InvalidTurnDelta`` before anything is written."""
    if isinstance(expected_turn, bool) or not isinstance(expected_turn, int) or expected_turn < 0:
        raise InvalidTurnDelta(f"expected_turn must be a non-negative int, got {expected_turn!r}")
    if delta.turn != expected_turn + 1:
        raise InvalidTurnDelta(f"delta.turn is {delta.turn}, must be expected_turn + 1 = {expected_turn + 1}")
    if delta.segment_index < 0:
        raise InvalidTurnDelta(f"segment_index must be >= 0, got {delta.segment_index}")
    if delta.record.turn != delta.turn:
        raise InvalidTurnDelta(f"record.turn is {delta.record.turn}, delta.turn is {delta.turn}")
    n = len(delta.token_ids)
    if len(delta.loss_mask) != n or len(delta.logprobs) != n:
        raise InvalidTurnDelta(
            f"ragged delta: {n} token ids, {len(delta.loss_mask)} loss-mask entries, {len(delta.logprobs)} logprobs"
        )
    try:
        ids = np.asarray(delta.token_ids, dtype=np.int64).reshape(n)
        mask = np.asarray(delta.loss_mask, dtype=np.int64).reshape(n)
        logprobs = np.asarray(delta.logprobs, dtype=np.float64).reshape(n)
    except (TypeError, ValueError, OverflowError) as e:
        raise InvalidTurnDelta(f"delta arrays must be flat lists of numbers: {e}") from None
    if n and (ids.min() < 0 or ids.max() > _INT32_MAX):
        raise InvalidTurnDelta("token ids must be in [0, 2**31)")
    if n and (mask.min() < 0 or mask.max() > 1):
        raise InvalidTurnDelta("loss mask entries must be 0 or 1")
    return EncodedDelta(
        turn=delta.turn,
        segment_index=delta.segment_index,
        new_segment=bool(delta.new_segment),
        ids=ids.astype(IDS_DTYPE).tobytes(),
        logprobs=logprobs.astype(LOGPROBS_DTYPE).tobytes(),
        mask=mask.astype(MASK_DTYPE).tobytes(),
        record=_dumps(delta.record.to_dict(copy_answer=False), "turn record"),
        messages=[_dumps(m, "message") for m in delta.new_messages],
        render_context=_dumps(delta.render_context, "render_context"),
    )


def check_segment_index(enc: EncodedDelta, num_segments: int) -> None:
    """A turn extends the last segment or opens exactly the next one — nothing else is a valid history."""
    want = num_segments if enc.new_segment else num_segments - 1
    if enc.segment_index != want or want < 0:
        what = "a new segment" if enc.new_segment else "the last segment"
        raise InvalidTurnDelta(
            f"segment_index {enc.segment_index} does not name {what} (rollout has {num_segments} segments)"
        )


def _json_list(items: list[bytes | str] | None) -> list[Any]:
    """Parse many stored JSON documents with one ``json.loads`` (a long history has hundreds)."""
    if not items:
        return []
    as_bytes = [i.encode() if isinstance(i, str) else i for i in items]
    return json.loads(b"[" + b",".join(as_bytes) + b"]")


def decode_segment(enc: EncodedSegment) -> Segment:
    return Segment(
        token_ids=np.frombuffer(enc.ids, dtype=IDS_DTYPE).tolist(),
        loss_mask=np.frombuffer(enc.mask, dtype=MASK_DTYPE).tolist(),
        logprobs=np.frombuffer(enc.logprobs, dtype=LOGPROBS_DTYPE).tolist(),
        turns=[TurnRecord.from_dict(t) for t in _json_list(enc.turns)],
        messages=_json_list(enc.messages),
        render_context=json.loads(enc.render_context) if enc.render_context else {},
    )


def decode_state(
    rollout_id: str, turn: int, segments: Iterable[EncodedSegment], *, incarnation: str | None = None
) -> RolloutState:
    return RolloutState(
        rollout_id=rollout_id, turn=turn, segments=[decode_segment(s) for s in segments], incarnation=incarnation or None
    )


def decode_delta(enc: EncodedDelta) -> TurnDelta:
    """The delta exactly as a later load will show it: float32 logprobs, JSON-normalised record,
    messages and render context, and no object shared with the delta it was encoded from.

    Applying it to a loaded state gives the state a reload would return (what a cache of loaded
    states relies on to skip the reload)."""
    return TurnDelta(
        turn=enc.turn,
        segment_index=enc.segment_index,
        new_segment=enc.new_segment,
        token_ids=np.frombuffer(enc.ids, dtype=IDS_DTYPE).tolist(),
        loss_mask=np.frombuffer(enc.mask, dtype=MASK_DTYPE).tolist(),
        logprobs=np.frombuffer(enc.logprobs, dtype=LOGPROBS_DTYPE).tolist(),
        record=TurnRecord.from_dict(json.loads(enc.record)),
        new_messages=_json_list(enc.messages),
        render_context=json.loads(enc.render_context),
    )
