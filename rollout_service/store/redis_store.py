"""Rollout store on Redis (single server or Redis Cluster), append-only per turn: the client side
of store/lua.py's key layout and scripts (one round trip each), the deadlines, retries and pool of
the connection, durability (``replicated``: Redis ``WAIT``), and the translation of Redis's errors
into the store's."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from typing import Any, AsyncIterator, Callable

import redis.asyncio as aioredis
from redis import exceptions as rexc

from rollout_service.config import StoreConfig
from rollout_service.onpolicy.types import RolloutState, TurnDelta
from rollout_service.store.base import (
    ROLLOUT_STATUSES,
    UNCHANGED,
    RolloutAborted,
    InvalidTurnDelta,
    StoreError,
    StoreFull,
    StoreUnavailable,
    TurnConflict,
    Unchanged,
    validate_rollout_id,
)
from rollout_service.store.codec import encode_delta
from rollout_service.store.lua import (LUA_APPEND, LUA_DELETE, LUA_LOAD, LUA_LOAD_IF_CHANGED, LUA_MARK,
                                      LUA_RELEASE_CALL, LUA_RENEW_CALL, LUA_TOUCH, SEGMENT_FIELDS, decode_snapshot)
from rollout_service.store.recent import CLUSTER_SHARDS, RecentIndex, summary_args
from rollout_service.store.urls import client_deadlines, parse_redis_url, parse_sentinel_url

log = logging.getLogger(__name__)

# RedisClusterException (SlotNotCoveredError, a cluster the client cannot map) is not a RedisError.
_UNAVAILABLE = (rexc.ConnectionError, rexc.TimeoutError, rexc.ClusterDownError, rexc.BusyLoadingError,
                rexc.RedisClusterException)


def raised_by_a_dropped_connection(exc: BaseException) -> bool:
    """redis-py 8.1's asyncio connection lets a write on a connection the peer closed (or another
    task disconnected) raise the transport's own AttributeError / TypeError instead of its
    ConnectionError (redis/redis-py#4287; seen here on a Redis Cluster failover:
    ``'NoneType' object has no attribute 'writelines'``). Only errors raised inside redis-py's
    connection or asyncio's transport code are taken for that; any other one is a bug and raised."""
    tb = exc.__traceback__
    last = None
    while tb is not None:
        last, tb = tb, tb.tb_next
    where = last.tb_frame.f_code.co_filename if last is not None else ""
    return where.endswith(("redis/asyncio/connection.py", "asyncio/streams.py", "asyncio/selector_events.py"))


class _Scripts:
    """store/lua.py's scripts, run by their SHAs (``EVALSHA``), loaded on every primary (``SCRIPT LOAD``)
    before the client's first call and again when a node answers that it does not know one (a
    restarted server, a promoted replica). One load runs at a time and every call that needs it
    waits for that one (its result or its error: a failed load costs each waiter one load's
    deadline, not one each; shielded, so a cancelled call does not cut a load mid-command).
    redis-py's own fallback, a ``SCRIPT LOAD`` inside each call that meets ``NOSCRIPT``, left the
    connections of a new Cluster client broken for the calls beside it (16 concurrent first appends on
    a fresh 3-primary Cluster: most of them a 503, "connection lost")."""

    def __init__(self, client):
        self.client = client
        self.sources: dict[str, str] = {}  # sha -> source
        self._loading: asyncio.Task | None = None
        self.generation = 0  # loads done; 0: none yet

    def add(self, source: str) -> "_Script":
        script = _Script(self, self.client.register_script(source).sha)
        self.sources[script.sha] = source
        return script

    async def load(self, seen: int) -> None:
        """Load every script, unless they were loaded since the caller saw generation ``seen``; a
        load already running is the one this call waits for."""
        if self.generation != seen:
            return
        task = self._loading
        if task is None or task.done() or task.get_loop() is not asyncio.get_running_loop():
            task = self._loading = asyncio.ensure_future(self._load_all())
        await asyncio.shield(task)

    async def _load_all(self) -> None:
        for source in self.sources.values():
            await self.client.script_load(source)
        self.generation += 1


class _Script:
    def __init__(self, scripts: _Scripts, sha: str):
        self.scripts = scripts
        self.sha = sha

    async def __call__(self, keys: list[str], args: list[Any] = ()) -> Any:
        seen = await self.loaded()
        client = self.scripts.client
        try:
            return await client.evalsha(self.sha, len(keys), *keys, *args)
        except rexc.NoScriptError:
            await self.scripts.load(seen)
        try:
            return await client.evalsha(self.sha, len(keys), *keys, *args)
        except rexc.NoScriptError as exc:  # lost again at once (a node flushed or replaced meanwhile)
            raise StoreUnavailable(f"redis does not know the store's script after loading it: {exc}") from exc

    async def loaded(self) -> int:
        """Load the scripts if this client has not yet; the generation the caller may then count on."""
        if self.scripts.generation == 0:
            await self.scripts.load(0)
        return self.scripts.generation

    async def in_pipeline(self, commands: Callable[[Any], None]) -> list[Any]:
        """This script then ``commands(pipe)`` in one pipeline (one connection), run again once if the
        node did not know the script (nothing ran then)."""
        for attempt in (0, 1):
            seen = await self.loaded()
            pipe = self.scripts.client.pipeline(transaction=False)
            commands(pipe)
            try:
                return await pipe.execute()
            except rexc.NoScriptError as exc:
                if attempt:
                    raise StoreUnavailable(f"redis does not know the store's script after loading it: {exc}") from exc
                await self.scripts.load(seen)
        raise AssertionError("unreachable")


class RedisRolloutStore:
    """``RolloutStore`` on redis-py asyncio (``Redis`` or ``RedisCluster`` — the code path is the same)."""

    def __init__(
        self,
        client: aioredis.Redis | aioredis.RedisCluster,
        *,
        ttl_seconds: float = 7 * 24 * 3600,
        key_prefix: str = "ro",
        owns_client: bool = False,
        durability: str = "local",
        min_replicas: int = 1,
        replication_timeout_s: float = 1.0,
        recent_size: int = 10_000,
        recent_shards: int | None = None,
    ):
        """``recent_shards``: the recent index's sets (store/recent.py); None: one, or ``CLUSTER_SHARDS``
        on a Redis Cluster."""
        if not key_prefix or any(c in key_prefix for c in "{}*?[]\\ "):
            raise ValueError(f"key_prefix {key_prefix!r} must be non-empty, without braces, glob characters or spaces")
        if ttl_seconds <= 0:
            raise ValueError("ttl_seconds must be positive")
        self.client = client
        self.ttl_seconds = ttl_seconds
        self.key_prefix = key_prefix
        self._ttl_ms = max(1, int(round(ttl_seconds * 1000)))
        self._owns_client = owns_client
        if durability not in ("local", "replicated"):
            raise ValueError(f"durability must be local or replicated, got {durability!r}")
        if durability == "replicated" and isinstance(client, aioredis.RedisCluster):
            raise ValueError("store.durability replicated needs one primary (redis:// or redis+sentinel://); "
                             "on a Redis Cluster, WAIT would have to follow each write on its own node's connection")
        self.durability = durability
        self.min_replicas = min_replicas
        self.replication_timeout_s = replication_timeout_s
        scripts = _Scripts(client)
        self._append = scripts.add(LUA_APPEND)
        self._load = scripts.add(LUA_LOAD)
        self._load_if_changed = scripts.add(LUA_LOAD_IF_CHANGED)
        self._delete = scripts.add(LUA_DELETE)
        self._touch = scripts.add(LUA_TOUCH)
        self._mark = scripts.add(LUA_MARK)
        self._renew_call = scripts.add(LUA_RENEW_CALL)
        self._release_call = scripts.add(LUA_RELEASE_CALL)
        self.recent = RecentIndex(client, key_prefix, recent_size, self.meta_key,
                                  shards=recent_shards or (CLUSTER_SHARDS if isinstance(client, aioredis.RedisCluster) else 1))

    @classmethod
    def from_url(
        cls,
        url: str,
        *,
        ttl_seconds: float = 7 * 24 * 3600,
        key_prefix: str = "ro",
        cluster: bool | None = None,
        durability: str = "local",
        min_replicas: int = 1,
        replication_timeout_s: float = 1.0,
        recent_size: int = 10_000,
        recent_shards: int | None = None,
        **client_kwargs: Any,
    ) -> "RedisRolloutStore":
        """Build the client from a URL; ``cluster=None`` lets the URL decide (see ``parse_redis_url``).
        A Sentinel URL (:func:`parse_sentinel_url`) gives a client of the primary the sentinels name,
        found again after a failover (redis-py's Sentinel client)."""
        store_kwargs = {"durability": durability, "min_replicas": min_replicas,
                        "replication_timeout_s": replication_timeout_s, "recent_size": recent_size,
                        "recent_shards": recent_shards}
        client_kwargs["decode_responses"] = False  # packed arrays are binary
        sentinel = parse_sentinel_url(url)
        if sentinel is not None:
            from redis.asyncio.sentinel import Sentinel

            sentinel_side = {k: v for k, v in client_kwargs.items()
                             if k in ("socket_timeout", "socket_connect_timeout", "socket_keepalive")}
            primary = {k: v for k, v in (("db", sentinel["db"]), ("username", sentinel["username"]),
                                         ("password", sentinel["password"])) if v is not None}
            if sentinel["ssl"]:
                primary["ssl"] = True
            client = Sentinel(sentinel["sentinels"], sentinel_kwargs=sentinel_side).master_for(
                sentinel["service"], **primary, **client_kwargs)
            return cls(client, ttl_seconds=ttl_seconds, key_prefix=key_prefix, owns_client=True, **store_kwargs)
        clean, url_says_cluster = parse_redis_url(url)
        use_cluster = url_says_cluster if cluster is None else cluster
        if use_cluster:
            client = aioredis.RedisCluster.from_url(clean, **client_kwargs)
        else:
            # One Redis: a command that finds every pooled connection busy waits for one (at most the
            # command deadline) instead of failing with "Too many connections" (redis-py's ConnectionPool).
            wait = client_kwargs.get("socket_timeout") or 5.0
            pool = aioredis.BlockingConnectionPool.from_url(clean, timeout=wait, **client_kwargs)
            client = aioredis.Redis.from_pool(pool)
        return cls(client, ttl_seconds=ttl_seconds, key_prefix=key_prefix, owns_client=True, **store_kwargs)

    @classmethod
    def from_config(cls, config: StoreConfig, **client_kwargs: Any) -> "RedisRolloutStore":
        if not config.redis_url:
            raise ValueError(
                "StoreConfig.redis_url is not set: start an embedded server first "
                "(rollout_service.store.embedded.EmbeddedRedis) and pass its URL"
            )
        return cls.from_url(
            config.redis_url, ttl_seconds=config.ttl_seconds, key_prefix=config.key_prefix,
            durability=config.durability, min_replicas=config.min_replicas,
            replication_timeout_s=config.replication_timeout_s, recent_size=config.recent_rollouts,
            **{**client_deadlines(config), "max_connections": config.max_connections, **client_kwargs},
        )

    async def load_scripts(self) -> None:
        """Load the store's Lua scripts on every primary now (else a client's first call does)."""
        await self._append.loaded()

    @property
    def is_cluster(self) -> bool:
        return isinstance(self.client, aioredis.RedisCluster)

    # --- keys ---------------------------------------------------------------------------------

    def meta_key(self, rollout_id: str) -> str:
        return f"{self.key_prefix}:{{{validate_rollout_id(rollout_id)}}}:meta"

    def keys_for(self, rollout_id: str, num_segments: int) -> list[str]:
        """Every key a rollout with ``num_segments`` segments may occupy (some lists may be absent)."""
        base = self.meta_key(rollout_id)[: -len("meta")]
        return [base + "meta"] + [f"{base}s{i}:{f}" for i in range(num_segments) for f in SEGMENT_FIELDS]

    def key_pattern(self, rollout_id: str) -> str:
        """SCAN pattern matching every key of the rollout (ids never contain glob characters)."""
        return self.meta_key(rollout_id)[: -len("meta")] + "*"

    # --- RolloutStore -------------------------------------------------------------------------

    async def load(self, rollout_id: str) -> RolloutState | None:
        meta = self.meta_key(rollout_id)
        async with self._translate():
            reply = await self._load(keys=[meta])
        return decode_snapshot(rollout_id, reply)

    async def load_if_changed(
        self, rollout_id: str, known_turn: int, *, known_incarnation: str | None = None, known_status: str | None = None
    ) -> RolloutState | None | Unchanged:
        meta = self.meta_key(rollout_id)
        async with self._translate():
            reply = await self._load_if_changed(keys=[meta], args=[int(known_turn), known_incarnation or "",
                                                                    known_status or ""])
        if reply and len(reply) == 1:
            return UNCHANGED
        return decode_snapshot(rollout_id, reply)

    async def append_turn(self, rollout_id: str, delta: TurnDelta, *, expected_turn: int) -> None:
        meta = self.meta_key(rollout_id)
        enc = encode_delta(delta, expected_turn=expected_turn)
        now_ms = int(time.time() * 1000)
        args = [
            expected_turn,
            enc.turn,
            enc.segment_index,
            int(enc.new_segment),
            self._ttl_ms,
            enc.ids,
            enc.logprobs,
            enc.mask,
            enc.record,
            enc.render_context,
            secrets.token_hex(8) if expected_turn == 0 else "",
            secrets.token_hex(8),  # this append's id
            *summary_args(delta, now_ms),
            int(delta.record.finish_reason == "abort"),
            *enc.messages,
        ]
        async with self._translate():
            if self.durability == "replicated":
                (status, value), acked = await self._with_wait(self._append, meta, args)
                if status == 1:
                    self._check_replicated(acked)
            else:
                status, value = await self._append(keys=[meta], args=args)
        if status == 0:
            raise TurnConflict(rollout_id, expected_turn, int(value))
        if status == -2:
            raise RolloutAborted(rollout_id)
        if status == -1:
            want = "a new segment" if enc.new_segment else "the last segment"
            raise InvalidTurnDelta(
                f"segment_index {enc.segment_index} does not name {want} (rollout has {int(value)} segments)"
            )
        self.recent.note_soon(rollout_id, now_ms)

    async def _with_wait(self, script, key: str, args: list) -> tuple[Any, int]:
        """``script`` then ``WAIT`` on one connection (a pipeline): Redis's WAIT counts the replicas
        that hold the writes *of its own connection*, so it must follow the write on the same one."""
        def commands(pipe) -> None:
            pipe.evalsha(script.sha, 1, key, *args)
            pipe.execute_command("WAIT", self.min_replicas, max(1, int(self.replication_timeout_s * 1000)))

        result, acked = await script.in_pipeline(commands)
        return result, int(acked)

    def _check_replicated(self, acked: int) -> None:
        """store.durability replicated: a turn is acknowledged only once ``min_replicas`` replicas
        have it (Redis ``WAIT``), so a failover to one of them keeps it. Fewer within
        ``replication_timeout_s``: StoreUnavailable (the turn is written on the primary; the call's
        retry finds it there and replays it once it is replicated — nothing is generated twice)."""
        if acked < self.min_replicas:
            raise StoreUnavailable(f"the turn reached {acked} of the {self.min_replicas} replica(s) "
                                   f"store.durability replicated waits for within {self.replication_timeout_s}s")

    async def durability_status(self) -> dict[str, Any]:
        """local: ``{"durability": "local", "ok": True}``. replicated: a probe write (a key of its
        own under the prefix, expiring in a minute) and ``WAIT min_replicas`` on its connection, as
        an append waits: ``in_sync`` is how many replicas held it when WAIT returned (it returns as
        soon as ``min_replicas`` do, so at least that many when ``ok``, and no longer than
        replication_timeout_s when fewer), beside ``connected`` (the primary's
        ``connected_slaves``: a stalled replica stays connected for a while)."""
        if self.durability != "replicated":
            return {"durability": self.durability, "ok": True}
        async with self._translate():
            pipe = self.client.pipeline(transaction=False)
            pipe.set(f"{self.key_prefix}:durability-probe", str(time.time()), px=60_000)
            pipe.execute_command("WAIT", self.min_replicas, max(1, int(self.replication_timeout_s * 1000)))
            pipe.info("replication")
            _, acked, info = await pipe.execute()
        return {"durability": "replicated", "ok": int(acked) >= self.min_replicas, "required": self.min_replicas,
                "in_sync": int(acked), "connected": int(info.get("connected_slaves", 0)),
                "replication_timeout_s": self.replication_timeout_s}

    async def ensure_replicated(self, rollout_id: str) -> None:
        """Before answering from what is stored (a replayed call): under store.durability
        replicated, wait until the replicas hold everything written so far (a write on this
        connection — the rollout's expiry refresh — then WAIT covers every earlier write of the
        primary). No-op under local."""
        if self.durability != "replicated":
            return
        async with self._translate():
            _, acked = await self._with_wait(self._touch, self.meta_key(rollout_id), [self._ttl_ms])
        self._check_replicated(acked)

    async def mark(self, rollout_id: str, status: str, reason: str = "", *, create: bool = False) -> bool | None:
        meta = self.meta_key(rollout_id)
        if status not in ROLLOUT_STATUSES:
            raise ValueError(f"status must be one of {ROLLOUT_STATUSES}, got {status!r}")
        args = [status, reason, self._ttl_ms if create else ""]
        async with self._translate():
            if self.durability == "replicated":  # an abort survives a failover as a turn does
                raw, acked = await self._with_wait(self._mark, meta, args)
                result = int(raw)
                if result:
                    self._check_replicated(acked)
            else:
                result = int(await self._mark(keys=[meta], args=args))
        return None if result == 0 else result == 1

    async def delete(self, rollout_id: str) -> bool:
        meta = self.meta_key(rollout_id)
        async with self._translate():
            removed = int(await self._delete(keys=[meta])) > 0
        await self.recent.forget(rollout_id)
        return removed

    async def exists(self, rollout_id: str) -> bool:
        meta = self.meta_key(rollout_id)
        async with self._translate():
            return bool(await self.client.exists(meta))

    async def touch(self, rollout_id: str) -> bool:
        meta = self.meta_key(rollout_id)
        async with self._translate():
            return bool(await self._touch(keys=[meta], args=[self._ttl_ms]))

    def call_key(self, rollout_id: str) -> str:
        return f"{self.key_prefix}:{{{validate_rollout_id(rollout_id)}}}:call"

    async def claim_call(self, rollout_id: str, token: str, ttl_ms: int) -> str | None:
        """Claim the rollout for one call, for every replica to see (``SET NX PX``): None when this
        call holds it now, else the holder's token ("" when it was released as this looked)."""
        key = self.call_key(rollout_id)
        async with self._translate():
            if await self.client.set(key, token, nx=True, px=max(1, int(ttl_ms))):
                return None
            held = await self.client.get(key)
        return held.decode() if isinstance(held, bytes) else (held or "")

    async def renew_call(self, rollout_id: str, token: str, ttl_ms: int) -> bool:
        """Extend the claim ``token`` holds; False when it holds none (expired, or another's now)."""
        async with self._translate():
            return bool(await self._renew_call(keys=[self.call_key(rollout_id)], args=[token, max(1, int(ttl_ms))]))

    async def release_call(self, rollout_id: str, token: str) -> None:
        """End the claim ``token`` holds (another holder's claim is left alone)."""
        async with self._translate():
            await self._release_call(keys=[self.call_key(rollout_id)], args=[token])

    async def ttl(self, rollout_id: str) -> float | None:
        meta = self.meta_key(rollout_id)
        async with self._translate():
            ms = int(await self.client.pttl(meta))
        if ms == -2:
            return None
        return float("inf") if ms == -1 else ms / 1000.0

    def group_key(self, group_id: str) -> str:
        return f"{self.key_prefix}:group:{{{validate_rollout_id(group_id)}}}"

    async def set_group_members(self, group_id: str, states: dict[str, str]) -> None:
        """Record members of a group and the record of each one's last call under it: one hash per
        group (member -> record), expiring ``ttl_seconds`` after its last write."""
        for rid in states:
            validate_rollout_id(rid)
        key = self.group_key(group_id)
        async with self._translate():
            pipe = self.client.pipeline(transaction=False)
            pipe.hset(key, mapping=states)
            pipe.pexpire(key, self._ttl_ms)
            await pipe.execute()

    async def group_members(self, group_id: str) -> dict[str, str]:
        """A group's members and their last call's record ({} for an unknown group)."""
        async with self._translate():
            raw = await self.client.hgetall(self.group_key(group_id))
        return {k.decode(): v.decode() for k, v in raw.items()}

    async def list_recent(self, limit: int, cursor: str | None = None) -> tuple[list[dict[str, Any]], str | None, int]:
        """A page of the recent-rollouts index (store/recent.py): summaries newest first, the next
        page's cursor (None: last page), and how many rollouts the index holds."""
        async with self._translate():
            rows, next_cursor = await self.recent.page(limit, cursor)
            indexed = await self.recent.count()
        return [r.to_dict() for r in rows], next_cursor, indexed

    async def count_rollouts(self) -> int:
        """Stored rollouts under this key prefix: one ``meta`` hash each, counted with SCAN (every
        primary of a cluster). O(keys in the database), not O(1) — for status pages, not hot paths.
        Nothing is kept in a counter because expiry removes rollouts without telling anyone."""
        pattern = f"{self.key_prefix}:{{*}}:meta"
        n = 0
        async with self._translate():
            async for _ in self.client.scan_iter(match=pattern, count=1000, _type="hash"):
                n += 1
        return n

    async def ping(self) -> bool:
        """Health probe: False rather than an exception, so readiness checks stay simple."""
        try:
            return bool(await self.client.ping())
        except (*_UNAVAILABLE, OSError) as e:
            log.warning("redis ping failed: %s", e)
            return False
        except (AttributeError, TypeError) as e:
            if not raised_by_a_dropped_connection(e):
                raise
            log.warning("redis ping failed: connection lost (%s)", e)
            return False

    async def close(self) -> None:
        try:
            await self.recent.settled()  # the index entries of the last appends, before the client goes
        except Exception:  # noqa: BLE001 - logged by the index; closing goes on
            pass
        if self._owns_client:
            await self.client.aclose()

    @contextlib.asynccontextmanager
    async def _translate(self) -> AsyncIterator[None]:
        """Backend errors leave as store errors, so callers never import redis to handle them."""
        try:
            yield
        except _UNAVAILABLE as e:
            raise StoreUnavailable(f"redis unavailable: {e}") from e
        except rexc.ResponseError as e:
            # Redis at maxmemory under noeviction: "OOM command not allowed when used memory >
            # 'maxmemory'" (redis-py's OutOfMemoryError; a script's error reply keeps the OOM prefix).
            # A Lua script is refused at its first write, so a refused append left no trace.
            if isinstance(e, rexc.OutOfMemoryError) or str(e).startswith("OOM"):
                raise StoreFull(f"redis is full (maxmemory reached, noeviction): {e}") from e
            raise StoreError(f"redis error: {e}") from e
        except rexc.RedisError as e:
            raise StoreError(f"redis error: {e}") from e
        except (AttributeError, TypeError) as e:
            if not raised_by_a_dropped_connection(e):
                raise
            raise StoreUnavailable(f"redis unavailable: connection lost ({type(e).__name__}: {e})") from e
