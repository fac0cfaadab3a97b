"""The recent-rollouts index: which rollouts were appended to last, newest first, a page at a time.

Sorted sets (member: rollout id, score: its last append in Unix ms), written after every append,
off the append's acknowledgement (in the background, the appends of the moment coalesced into one
write) and trimmed in the same round trip, so they never grow and a page costs O(page size): a
``ZREVRANGEBYSCORE`` for the ids, then one ``HMGET`` of each rollout's ``meta`` hash for the summary
the append script keeps there (turns, segments, last weight version, constrained calls, migrations,
last append). A rollout that expired or was deleted since is left out of the page and dropped from
the index.

On one Redis (or a Sentinel group) the index is one set, ``P:recent``, trimmed to the configured
size. On a Redis Cluster it is ``CLUSTER_SHARDS`` sets ``P:recent:{i}`` (each hash-tagged to a slot
of its own, so the shards spread over the primaries; a rollout's shard is a hash of its id), each
trimmed to its share of the size (rounded up): no node takes every append's index write, and a
page merges the shards' heads in the one order a single set would give (score, then id, both
descending), reading up to a page from each shard. The bound is then per shard: the index keeps
each shard's newest, about the configured size in all (up to 15 more when the size is not a
multiple of 16), not exactly the newest overall. An index written by a version before the shards
(one set ``P:recent`` on the Cluster) is no longer read; it has no expiry: delete it by hand. The index
is for people and tools that browse; it is not part of a turn's acknowledgement (a failed index
write is logged, the turn stands).
"""

from __future__ import annotations

import asyncio
import heapq
import logging
import zlib
from dataclasses import dataclass
from typing import Any, Callable

from rollout_service.onpolicy.types import TurnDelta

log = logging.getLogger(__name__)

MAX_PAGE = 1000
MAX_ROUNDS = 8  # a page skips at most this many pages' worth of expired entries before it answers
CLUSTER_SHARDS = 16  # the index's sets on a Redis Cluster


class InvalidCursor(ValueError):
    """A cursor this index did not hand out."""

    status = 400
    error_type = "invalid_request_error"
    code = "invalid_cursor"
    param = "cursor"


@dataclass
class RolloutSummary:
    id: str
    turns: int
    segments: int
    weight_version: str | None
    constrained_calls: int
    migrations: int
    updated_at_ms: int

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "turns": self.turns, "segments": self.segments, "forked": self.segments > 1,
                "weight_version": self.weight_version, "constrained_calls": self.constrained_calls,
                "migrations": self.migrations, "updated_at": self.updated_at_ms / 1000.0}


def summary_args(delta: TurnDelta, now_ms: int) -> list[Any]:
    """What one append adds to its rollout's summary (the append script's ARGV 13-16)."""
    spans = delta.record.weight_versions
    return [spans[-1].version if spans else "", int(bool(delta.record.constrained)), int(delta.record.migrations or 0),
            now_ms]


def parse_cursor(cursor: str | None) -> tuple[float, str] | None:
    """(score, rollout id) of the last entry of the previous page; None for the first page."""
    if cursor is None or cursor == "":
        return None
    score, sep, rid = cursor.partition(":")
    try:
        value = float(score)
    except ValueError:
        value = float("nan")
    if not sep or not rid or value != value or value in (float("inf"), float("-inf")):
        raise InvalidCursor(f"cursor {cursor[:60]!r} is not one this service handed out (next_cursor)")
    return value, rid


class RecentIndex:
    def __init__(self, client, key_prefix: str, size: int, meta_key: Callable[[str], str], shards: int = 1):
        if shards < 1:
            raise ValueError(f"shards must be at least 1, got {shards}")
        self.client = client
        self.keys = [f"{key_prefix}:recent"] if shards == 1 else [f"{key_prefix}:recent:{{{i}}}" for i in range(shards)]
        self.size = size
        self.shard_size = -(-size // shards)  # each shard's share, rounded up
        self.meta_key = meta_key
        self._pending: dict[str, int] = {}  # noted, not written yet
        self._writer: asyncio.Task | None = None
        self._noted = 0  # notes taken
        self._written = 0  # notes whose write ended (written, or given up and logged)
        self._waiters: list[tuple[int, asyncio.Future]] = []  # settled() calls: (notes to wait for, future)

    def key_of(self, rollout_id: str) -> str:
        """The set that indexes ``rollout_id``."""
        if len(self.keys) == 1:
            return self.keys[0]
        return self.keys[zlib.crc32(rollout_id.encode()) % len(self.keys)]

    def note_soon(self, rollout_id: str, at_ms: int) -> None:
        """Index an append in the background (the turn is acknowledged without waiting for it)."""
        if self.size <= 0:
            return
        self._pending[rollout_id] = max(at_ms, self._pending.get(rollout_id, 0))
        self._noted += 1
        loop = asyncio.get_running_loop()
        if self._writer is None or self._writer.done() or self._writer.get_loop() is not loop:
            self._writer = loop.create_task(self._write_pending())

    async def settled(self) -> None:
        """Wait until what was noted on this event loop before this call is written (a page reads its
        own appends), not for notes that arrive meanwhile: under a steady stream of appends the
        writer never runs dry, and a page must not wait for it to."""
        writer = self._writer
        if writer is None or writer.done() or writer.get_loop() is not asyncio.get_running_loop():
            return
        target = self._noted
        if self._written >= target:
            return
        done = writer.get_loop().create_future()
        self._waiters.append((target, done))
        await asyncio.wait({done, writer}, return_when=asyncio.FIRST_COMPLETED)

    def _wake(self) -> None:
        waiting = []
        for target, done in self._waiters:
            if target <= self._written:
                if not done.done():
                    done.set_result(None)
            else:
                waiting.append((target, done))
        self._waiters = waiting

    def _by_key(self, rollout_ids) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for rid in rollout_ids:
            out.setdefault(self.key_of(rid), []).append(rid)
        return out

    async def _write_pending(self) -> None:
        while self._pending:
            batch, upto, self._pending = self._pending, self._noted, {}
            # Bounded by the client's own command deadline (store.timeout_s), never cancelled from
            # outside: redis-py's Cluster client can hand a connection cancelled mid-pipeline to the
            # next command (an append failing with "connection lost"). Notes that arrive meanwhile
            # wait in _pending and go out in the next write.
            try:
                async with self.client.pipeline(transaction=False) as pipe:
                    for key, rids in self._by_key(batch).items():
                        pipe.zadd(key, {rid: batch[rid] for rid in rids})
                        pipe.zremrangebyrank(key, 0, -(self.shard_size + 1))
                    await pipe.execute()
            except Exception as exc:  # the turns are stored; only the browsing index misses them
                log.warning("recent-rollouts index not updated for %d rollout(s): %s", len(batch), exc)
            self._written = upto
            self._wake()

    async def forget(self, rollout_id: str) -> None:
        if self.size <= 0:
            return
        try:
            await self.client.zrem(self.key_of(rollout_id), rollout_id)
        except Exception as exc:
            log.warning("recent-rollouts index: %s not removed: %s", rollout_id, exc)

    async def count(self) -> int:
        """How many rollouts the index holds now."""
        if self.size <= 0:
            return 0
        async with self.client.pipeline(transaction=False) as pipe:
            for key in self.keys:
                pipe.zcard(key)
            return sum(int(n) for n in await pipe.execute())

    async def page(self, limit: int, cursor: str | None = None) -> tuple[list[RolloutSummary], str | None]:
        """Up to ``limit`` rollouts appended to before ``cursor`` (newest first), and the cursor of the
        next page (None: no more). Entries with the same score are ordered by id (Redis's order), so a
        page boundary inside a run of equal timestamps neither repeats nor skips one. Rollouts that
        expired since they were indexed are dropped as they are met; a page reads past them for at
        most ``MAX_ROUNDS`` pages' worth before it answers with fewer rows."""
        after = parse_cursor(cursor)
        await self.settled()
        limit = max(1, min(int(limit), MAX_PAGE))
        out: list[RolloutSummary] = []
        exhausted = False
        for _ in range(MAX_ROUNDS):
            rows, exhausted = await self._after(after, limit - len(out))
            if rows:
                after = (rows[-1][1], rows[-1][0])
                out += await self._summaries(rows)
            if len(out) >= limit or exhausted:
                break
        next_cursor = None if exhausted or after is None else f"{after[0]!r}:{after[1]}"
        return out, next_cursor

    async def _after(self, after: tuple[float, str] | None, n: int) -> tuple[list[tuple[str, float]], bool]:
        """The next ``n`` (id, score) after the cursor position over every shard, and whether the
        index ends there."""
        heads = await asyncio.gather(*(self._after_in(key, after, n) for key in self.keys))
        merged = heapq.merge(*(rows for rows, _ in heads), key=lambda r: (r[1], r[0]), reverse=True)
        rows = [row for _, row in zip(range(n + 1), merged)]
        return rows[:n], all(done for _, done in heads) and len(rows) <= n

    async def _after_in(self, key: str, after: tuple[float, str] | None,
                        n: int) -> tuple[list[tuple[str, float]], bool]:
        """One set's next ``n`` (id, score) after the cursor position (newest first), and whether it ends there."""
        top = repr(after[0]) if after is not None else "+inf"
        rows: list[tuple[str, float]] = []
        offset, exhausted = 0, False
        while len(rows) < n and not exhausted:  # more than one round only past ties at the cursor
            got = await self.client.zrevrangebyscore(key, top, "-inf", start=offset, num=n, withscores=True)
            offset += len(got)
            exhausted = len(got) < n
            for member, score in got:
                rid = member.decode() if isinstance(member, bytes) else member
                if after is None or score < after[0] or (score == after[0] and rid < after[1]):
                    rows.append((rid, float(score)))
        return rows[:n], exhausted and len(rows) <= n

    async def _summaries(self, rows: list[tuple[str, float]]) -> list[RolloutSummary]:
        async with self.client.pipeline(transaction=False) as pipe:
            for rid, _ in rows:
                pipe.hmget(self.meta_key(rid), "turn", "nseg", "ver", "c", "mig", "at")
            metas = await pipe.execute()
        out, gone = [], []
        for (rid, score), m in zip(rows, metas):
            if m[0] is None:  # expired or deleted since it was indexed
                gone.append(rid)
                continue
            text = [v.decode() if isinstance(v, bytes) else v for v in m]
            out.append(RolloutSummary(rid, int(text[0]), int(text[1] or 0), text[2] or None, int(text[3] or 0),
                                      int(text[4] or 0), int(text[5] or score)))
        if gone:
            try:
                for key, rids in self._by_key(gone).items():
                    await self.client.zrem(key, *rids)
            except Exception:
                pass
        return out
