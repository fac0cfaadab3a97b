"""Keep the rollouts a replica owns in memory, so a turn does not reload its whole history.

Why: without it every call loads and decodes the rollout's whole history from Redis, so the cost of
a turn grows with the rollout (docs/benchmarks.md, "One long rollout"). Routing sends every call of a rollout to one affinity
replica, so that replica can keep the state it loaded and advance it with the deltas it appends
itself; the history then crosses the network once per rollout instead of once per turn.

Redis stays the durable truth. Every ``load`` is still one round trip: ``load_if_changed`` checks
the stored turn counter and incarnation against the cached copy and answers ``UNCHANGED`` (a few
bytes) or, on a mismatch, the whole snapshot, which replaces the cached copy. So a write this
replica did not make — another replica that owned the rollout before a routing change, a delete
through another replica, an expiry — is seen on the next load, never served stale.

Why that is exact: a rollout's history at a given (turn, incarnation) never changes — writes only
append, every append increments the turn, and a rollout deleted or expired and created again gets a
new incarnation. A cached state always equals the stored history at the (turn, incarnation) it
carries; it is served only after the store confirmed that pair in the same round trip; it is
advanced in place only by a delta this cache itself appended with ``expected_turn`` equal to its
turn (the store accepted it, so the stored history is now the cached one plus that delta). The delta
is applied as the store will return it (``codec.decode_delta``: float32 logprobs, JSON-normalised
messages, no object shared with the caller's delta), so a cached state equals what a reload would
give. Anything else — a conflict, an error, a cancelled append whose outcome is unknown, an append
on a turn the cache does not hold, a delete — drops the cached copy; the next load reloads.

Mutation contract: ``load`` hands out the cached object itself, not a copy (copying would cost
O(history) per turn, which is what this module removes). Callers treat it as read-only. The pure
core does: ``build_prompt``, ``finish_turn``, ``state_from_echo``, ``trajectory_export`` and
``replay_turn`` never mutate a state they are given, nor return an object that aliases one of its
lists or dicts (pinned by tests/test_onpolicy_state_not_mutated.py). The object is advanced in place
by a later successful ``append_turn`` through this cache: a caller that keeps it across its own
append sees the new turn afterwards (``finish_turn`` relies on exactly that to notice a rollout that
moved under a plan).

Bounded: at most ``max_rollouts`` rollouts and ``max_tokens`` token positions in total, least
recently used dropped first; a rollout larger than ``max_tokens`` on its own is not cached. What a
cached token costs in memory (ids, mask and logprobs as Python lists; messages and stored answers
for chatty rollouts) is measured in docs/benchmarks.md ("Figures kept out of the code").
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Awaitable, TypeVar

from rollout_service.onpolicy.types import RolloutState, TurnDelta
from rollout_service.store.base import UNCHANGED, RolloutStore, Unchanged, validate_rollout_id
from rollout_service.store.codec import decode_delta, encode_delta

T = TypeVar("T")


def _num_tokens(state: RolloutState) -> int:
    return sum(len(seg.token_ids) for seg in state.segments)


class CachedRolloutStore:
    """``RolloutStore`` that serves loads from a bounded LRU, revalidated against ``inner``."""

    def __init__(self, inner: RolloutStore, *, max_rollouts: int = 1024, max_tokens: int | None = 4_000_000):
        if max_rollouts < 1:
            raise ValueError("max_rollouts must be at least 1")
        if max_tokens is not None and max_tokens < 1:
            raise ValueError("max_tokens must be at least 1 (or None for no token bound)")
        self.inner = inner
        self.max_rollouts = max_rollouts
        self.max_tokens = max_tokens
        self._entries: OrderedDict[str, RolloutState] = OrderedDict()
        self._sizes: dict[str, int] = {}
        self._total_tokens = 0
        self._counts = {"hits": 0, "misses": 0, "reloads": 0, "evictions": 0, "invalidations": 0}

    # --- introspection --------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, rollout_id: object) -> bool:
        return rollout_id in self._entries

    def stats(self) -> dict[str, int]:
        """Counters since start: ``hits`` (served from memory after an O(1) check), ``misses`` (not
        cached: full load), ``reloads`` (cached but stale: full snapshot), ``evictions`` (dropped by
        the bounds), ``invalidations`` (dropped after a conflict, an error, a delete or a vanished
        rollout); and the current ``rollouts`` and ``tokens`` held."""
        return {**self._counts, "rollouts": len(self._entries), "tokens": self._total_tokens}

    # --- RolloutStore ---------------------------------------------------------------------------

    async def load(self, rollout_id: str) -> RolloutState | None:
        validate_rollout_id(rollout_id)
        cached = self._entries.get(rollout_id)
        if cached is None:
            self._counts["misses"] += 1
            state = await self._dropping_on_error(rollout_id, self.inner.load(rollout_id))
            self._remember(rollout_id, state)
            return state
        result = await self._dropping_on_error(
            rollout_id,
            self.inner.load_if_changed(rollout_id, cached.turn, known_incarnation=cached.incarnation,
                                       known_status=cached.status),
        )
        if result is UNCHANGED:
            # The store confirmed ``cached``'s (turn, incarnation). If an append through this cache
            # advanced it meanwhile, it is at a later turn the store also holds: still exact.
            self._counts["hits"] += 1
            if self._entries.get(rollout_id) is cached:
                self._entries.move_to_end(rollout_id)
            return cached
        if result is not None:
            self._counts["reloads"] += 1
        self._remember(rollout_id, result)
        return result

    async def load_if_changed(
        self, rollout_id: str, known_turn: int, *, known_incarnation: str | None = None,
        known_status: str | None = None,
    ) -> RolloutState | None | Unchanged:
        state = await self.load(rollout_id)
        if state is None:
            return None
        if state.turn == known_turn and known_incarnation in (None, state.incarnation) and state.status == known_status:
            return UNCHANGED
        return state

    async def append_turn(self, rollout_id: str, delta: TurnDelta, *, expected_turn: int) -> None:
        """Forward the conditional append; on success advance the cached copy by the delta (as the
        store will return it), so the next load is a hit. Any failure drops the cached copy."""
        validate_rollout_id(rollout_id)
        cached = self._entries.get(rollout_id)
        applied = None
        try:
            if cached is not None and cached.turn == expected_turn:
                # Encoded before the await: exactly what the store is sent, whatever the caller does next.
                applied = decode_delta(encode_delta(delta, expected_turn=expected_turn))
            await self.inner.append_turn(rollout_id, delta, expected_turn=expected_turn)
        except BaseException:  # including cancellation: the append may have landed or not
            self._invalidate(rollout_id)
            raise
        if applied is None or self._entries.get(rollout_id) is not cached or cached.turn != expected_turn:
            # Not cached, cached at another turn (a stale caller or a copy that moved meanwhile), or
            # created just now (the store chose its incarnation): the next load reads the store.
            self._invalidate(rollout_id)
            return
        applied.apply(cached)
        n = len(applied.token_ids)
        self._sizes[rollout_id] += n
        self._total_tokens += n
        self._entries.move_to_end(rollout_id)
        if self.max_tokens is not None and self._sizes[rollout_id] > self.max_tokens:
            self._invalidate(rollout_id, counter="evictions")
        self._enforce_bounds()

    async def delete(self, rollout_id: str) -> bool:
        validate_rollout_id(rollout_id)
        self._invalidate(rollout_id)
        return await self.inner.delete(rollout_id)

    async def mark(self, rollout_id: str, status: str, reason: str = "", *, create: bool = False) -> bool | None:
        validate_rollout_id(rollout_id)
        self._invalidate(rollout_id)
        try:
            return await self.inner.mark(rollout_id, status, reason, create=create)
        finally:
            self._invalidate(rollout_id)  # a load racing the mark may have cached the status before it

    async def set_group_members(self, group_id: str, states: dict[str, str]) -> None:
        await self.inner.set_group_members(group_id, states)  # groups are not cached: read on demand

    async def group_members(self, group_id: str) -> dict[str, str]:
        return await self.inner.group_members(group_id)

    async def exists(self, rollout_id: str) -> bool:
        found = await self.inner.exists(rollout_id)
        if not found:
            self._invalidate(rollout_id)
        return found

    async def touch(self, rollout_id: str) -> bool:
        found = await self.inner.touch(rollout_id)
        if not found:
            self._invalidate(rollout_id)
        return found

    async def claim_call(self, rollout_id: str, token: str, ttl_ms: int) -> str | None:
        return await self.inner.claim_call(rollout_id, token, ttl_ms)

    async def renew_call(self, rollout_id: str, token: str, ttl_ms: int) -> bool:
        return await self.inner.renew_call(rollout_id, token, ttl_ms)

    async def release_call(self, rollout_id: str, token: str) -> None:
        await self.inner.release_call(rollout_id, token)

    async def ensure_replicated(self, rollout_id: str) -> None:
        await self.inner.ensure_replicated(rollout_id)

    async def ttl(self, rollout_id: str) -> float | None:
        return await self.inner.ttl(rollout_id)

    async def durability_status(self) -> dict[str, Any]:
        return await self.inner.durability_status()

    async def ping(self) -> bool:
        return await self.inner.ping()

    async def close(self) -> None:
        self.clear()
        await self.inner.close()

    def clear(self) -> None:
        """Drop every cached copy (the store is untouched)."""
        self._entries.clear()
        self._sizes.clear()
        self._total_tokens = 0

    # --- bookkeeping ----------------------------------------------------------------------------

    async def _dropping_on_error(self, rollout_id: str, op: Awaitable[T]) -> T:
        try:
            return await op
        except BaseException:
            self._invalidate(rollout_id)
            raise

    def _remember(self, rollout_id: str, state: RolloutState | None) -> None:
        self._drop(rollout_id)
        if state is None:
            return
        size = _num_tokens(state)
        if self.max_tokens is not None and size > self.max_tokens:
            return
        self._entries[rollout_id] = state
        self._sizes[rollout_id] = size
        self._total_tokens += size
        self._enforce_bounds()

    def _enforce_bounds(self) -> None:
        while len(self._entries) > self.max_rollouts or (
            self.max_tokens is not None and self._total_tokens > self.max_tokens
        ):
            oldest = next(iter(self._entries))
            self._invalidate(oldest, counter="evictions")

    def _invalidate(self, rollout_id: Any, counter: str = "invalidations") -> None:
        if self._drop(rollout_id):
            self._counts[counter] += 1

    def _drop(self, rollout_id: Any) -> bool:
        if self._entries.pop(rollout_id, None) is None:
            return False
        self._total_tokens -= self._sizes.pop(rollout_id)
        return True
