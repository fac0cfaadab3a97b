"""The recent-rollouts index: which rollouts were appended to last, newest first, a page at a time.

One sorted set ``P:recent`` (member: rollout id, score: its last append in Unix ms), written after
every append, off the append's acknowledgement (in the background, the appends of the moment
coalesced into one write) and trimmed to the configured size in the same round trip, so it never
grows and a page costs O(page size): a ``ZREVRANGEBYSCORE`` for the ids, then one ``HMGET`` of each rollout's
``meta`` hash for the summary the append script keeps there (turns, segments, last weight version,
constrained calls, migrations, last append). A rollout that expired or was deleted since is left
out of the page and dropped from the index. The set has no hash tag: on a Redis Cluster it lives
on one node, written with one command per turn. The index is for people and tools that browse; it
is not part of a turn's acknowledgement (a failed index write is logged, the turn stands).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any, Callable

from rollout_service.onpolicy.types import TurnDelta

log = logging.getLogger(__name__)

MAX_PAGE = 1000
NOTE_TIMEOUT_S = 0.5  # longest one background index write may take (then it is dropped, logged)
MAX_ROUNDS = 8  # a page skips at most this many pages' worth of expired entries before it answers


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
    def __init__(self, client, key_prefix: str, size: int, meta_key: Callable[[str], str]):
        self.client = client
        self.key = f"{key_prefix}:recent"
        self.size = size
        self.meta_key = meta_key
        self._pending: dict[str, int] = {}  # noted, not written yet
        self._writer: asyncio.Task | None = None

    def note_soon(self, rollout_id: str, at_ms: int) -> None:
        """Index an append in the background (the turn is acknowledged without waiting for it)."""
        if self.size <= 0:
            return
        self._pending[rollout_id] = max(at_ms, self._pending.get(rollout_id, 0))
        loop = asyncio.get_running_loop()
        if self._writer is None or self._writer.done() or self._writer.get_loop() is not loop:
            self._writer = loop.create_task(self._write_pending())

    async def settled(self) -> None:
        """Wait until what was noted on this event loop is written (a page reads its own appends)."""
        writer = self._writer
        if writer is not None and not writer.done() and writer.get_loop() is asyncio.get_running_loop():
            await asyncio.shield(writer)

    async def _write_pending(self) -> None:
        while self._pending:
            batch, self._pending = self._pending, {}
            try:  # bounded on its own: a slow index must not pile up behind it
                async with self.client.pipeline(transaction=False) as pipe:
                    pipe.zadd(self.key, batch)
                    pipe.zremrangebyrank(self.key, 0, -(self.size + 1))
                    await asyncio.wait_for(pipe.execute(), NOTE_TIMEOUT_S)
            except Exception as exc:  # the turns are stored; only the browsing index misses them
                log.warning("recent-rollouts index not updated for %d rollout(s): %s", len(batch), exc)

    async def forget(self, rollout_id: str) -> None:
        if self.size <= 0:
            return
        try:
            await self.client.zrem(self.key, rollout_id)
        except Exception as exc:
            log.warning("recent-rollouts index: %s not removed: %s", rollout_id, exc)

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
        """The next ``n`` (id, score) after the cursor position, and whether the index ends there."""
        top = repr(after[0]) if after is not None else "+inf"
        rows: list[tuple[str, float]] = []
        offset, exhausted = 0, False
        while len(rows) < n and not exhausted:  # more than one round only past ties at the cursor
            got = await self.client.zrevrangebyscore(self.key, top, "-inf", start=offset, num=n, withscores=True)
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
                await self.client.zrem(self.key, *gone)
            except Exception:
                pass
        return out
