"""In-process store with the Redis store's exact semantics, for unit tests of other modules.

It keeps the same encoded chunks as Redis (see ``codec``), so what a test loads back is what
production would load back. It is per process: Ray actors cannot share it, so it is never a
production backend.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field
from typing import Callable

from rollout_service.onpolicy.types import RolloutState
from rollout_service.store.base import (
    ROLLOUT_STATUSES, UNCHANGED, RolloutAborted, TurnConflict, Unchanged, validate_rollout_id)
from rollout_service.store.codec import EncodedSegment, check_segment_index, decode_state, encode_delta


@dataclass
class _Entry:
    turn: int = 0
    segments: list[EncodedSegment] = field(default_factory=list)
    expires_at: float = 0.0
    incarnation: str = field(default_factory=lambda: secrets.token_hex(8))
    status: str | None = None
    reason: str | None = None


class MemoryRolloutStore:
    """``RolloutStore`` in a dict. Every method body runs without awaiting, so on one event loop each
    call is as atomic as the Redis Lua script it mirrors."""

    def __init__(self, *, ttl_seconds: float = 7 * 24 * 3600, clock: Callable[[], float] = time.monotonic):
        self.ttl_seconds = ttl_seconds
        self._clock = clock
        self._data: dict[str, _Entry] = {}
        self._groups: dict[str, dict[str, str]] = {}  # group id -> member -> state
        self._calls: dict[str, tuple[str, float]] = {}  # rollout id -> (claim token, expiry)

    def _live(self, rollout_id: str) -> _Entry | None:
        entry = self._data.get(rollout_id)
        if entry is not None and entry.expires_at <= self._clock():
            del self._data[rollout_id]
            return None
        return entry

    async def load(self, rollout_id: str) -> RolloutState | None:
        validate_rollout_id(rollout_id)
        entry = self._live(rollout_id)
        if entry is None:
            return None
        return self._state(rollout_id, entry)

    @staticmethod
    def _state(rollout_id: str, entry: _Entry) -> RolloutState:
        state = decode_state(rollout_id, entry.turn, entry.segments, incarnation=entry.incarnation)
        state.status, state.status_reason = entry.status, entry.reason
        return state

    async def load_if_changed(
        self, rollout_id: str, known_turn: int, *, known_incarnation: str | None = None,
        known_status: str | None = None,
    ) -> RolloutState | None | Unchanged:
        validate_rollout_id(rollout_id)
        entry = self._live(rollout_id)
        if entry is None:
            return None
        if (entry.turn == known_turn and known_incarnation in (None, entry.incarnation)
                and entry.status == known_status):
            return UNCHANGED
        return self._state(rollout_id, entry)

    async def mark(self, rollout_id: str, status: str, reason: str = "", *, create: bool = False) -> bool | None:
        validate_rollout_id(rollout_id)
        if status not in ROLLOUT_STATUSES:
            raise ValueError(f"status must be one of {ROLLOUT_STATUSES}, got {status!r}")
        entry = self._live(rollout_id)
        if entry is None and not create:
            return None
        if entry is None:
            entry = self._data[rollout_id] = _Entry()
            entry.expires_at = self._clock() + self.ttl_seconds
        if entry.status == "aborted":
            return False
        entry.status, entry.reason = status, reason or None
        return True

    async def append_turn(self, rollout_id: str, delta, *, expected_turn: int) -> None:
        validate_rollout_id(rollout_id)
        enc = encode_delta(delta, expected_turn=expected_turn)
        entry = self._live(rollout_id)
        stored_turn = entry.turn if entry else 0
        if stored_turn != expected_turn:
            raise TurnConflict(rollout_id, expected_turn, stored_turn)
        if entry is not None and entry.status == "aborted" and delta.record.finish_reason != "abort":
            raise RolloutAborted(rollout_id)
        check_segment_index(enc, len(entry.segments) if entry else 0)
        if entry is None:
            entry = self._data[rollout_id] = _Entry()
        if enc.new_segment:
            entry.segments.append(EncodedSegment(turns=[], messages=[]))
        seg = entry.segments[enc.segment_index]
        seg.ids += enc.ids
        seg.logprobs += enc.logprobs
        seg.mask += enc.mask
        seg.turns.append(enc.record)
        seg.messages.extend(enc.messages)
        seg.render_context = enc.render_context
        entry.turn = enc.turn
        entry.expires_at = self._clock() + self.ttl_seconds

    async def delete(self, rollout_id: str) -> bool:
        validate_rollout_id(rollout_id)
        return self._live(rollout_id) is not None and self._data.pop(rollout_id, None) is not None

    async def exists(self, rollout_id: str) -> bool:
        validate_rollout_id(rollout_id)
        return self._live(rollout_id) is not None

    async def claim_call(self, rollout_id: str, token: str, ttl_ms: int) -> str | None:
        validate_rollout_id(rollout_id)
        now = self._clock()
        held = self._calls.get(rollout_id)
        if held is not None and held[1] > now:
            return held[0]
        self._calls[rollout_id] = (token, now + ttl_ms / 1000)
        return None

    async def renew_call(self, rollout_id: str, token: str, ttl_ms: int) -> bool:
        held = self._calls.get(rollout_id)
        if held is None or held[0] != token or held[1] <= self._clock():
            return False
        self._calls[rollout_id] = (token, self._clock() + ttl_ms / 1000)
        return True

    async def release_call(self, rollout_id: str, token: str) -> None:
        held = self._calls.get(rollout_id)
        if held is not None and held[0] == token:
            del self._calls[rollout_id]

    async def ensure_replicated(self, rollout_id: str) -> None:
        """One process, nothing to replicate."""

    async def touch(self, rollout_id: str) -> bool:
        validate_rollout_id(rollout_id)
        entry = self._live(rollout_id)
        if entry is None:
            return False
        entry.expires_at = self._clock() + self.ttl_seconds
        return True

    async def ttl(self, rollout_id: str) -> float | None:
        validate_rollout_id(rollout_id)
        entry = self._live(rollout_id)
        return None if entry is None else entry.expires_at - self._clock()

    async def set_group_members(self, group_id: str, states: dict[str, str]) -> None:
        validate_rollout_id(group_id)
        for rid in states:
            validate_rollout_id(rid)
        self._groups.setdefault(group_id, {}).update(states)

    async def group_members(self, group_id: str) -> dict[str, str]:
        validate_rollout_id(group_id)
        return dict(self._groups.get(group_id, {}))

    async def durability_status(self) -> dict:
        return {"durability": "local", "ok": True}

    async def ping(self) -> bool:
        return True

    async def close(self) -> None:
        self._data.clear()
