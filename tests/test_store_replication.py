"""store.durability and Redis Sentinel, on a real primary + two replicas + three sentinels on
127.0.0.1 (``LocalSentinelGroup``): the ``redis+sentinel://`` URL finds the primary and follows it
across a failover; ``replicated`` acknowledges a turn only once the replicas hold it, and answers
StoreUnavailable in bounded time when they do not; after ``kill -9`` of the primary every turn
acknowledged in ``replicated`` mode is on the promoted replica. The failover drill with counts per
mode under load is scripts/drill_sentinel.py (docs/reliability.md)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import time

import pytest
import redis

from rollout_service.store import RedisRolloutStore, StoreUnavailable
from rollout_service.store.sentinel_group import LocalSentinelGroup
from synthetic_rollouts import synthetic_rollout


@pytest.fixture(scope="module")
def group(tmp_path_factory):
    with LocalSentinelGroup(tmp_path_factory.mktemp("sentinel"), replicas=2, sentinels=3) as g:
        yield g


def _store(url: str, **store) -> RedisRolloutStore:
    from rollout_service.config import StoreConfig

    return RedisRolloutStore.from_config(StoreConfig.model_validate(
        {"redis_url": url, "key_prefix": "repl", "timeout_s": 2.0, "retries": 2, **store}))


@contextlib.contextmanager
def replicas_stalled(group):
    """Every replica SIGSTOPped for the block (a slow network, a busy replica), resumed after."""
    pids = [r.pid for r in group.replicas]
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)


def _turn_on(port: int, store: RedisRolloutStore, rid: str) -> int:
    value = redis.Redis(port=port).hget(store.meta_key(rid), "turn")
    return int(value or 0)


async def test_a_sentinel_url_reaches_the_primary_and_replicated_turns_are_on_the_replicas(group):
    s = _store(group.url, durability="replicated", min_replicas=2)
    try:
        deltas, expected = synthetic_rollout(random.Random(1), [2, 1])
        for i, delta in enumerate(deltas):
            await s.append_turn("acked", delta, expected_turn=i)
            # Acknowledged: both replicas hold it already (WAIT), not eventually.
            assert [_turn_on(r.port, s, "acked") for r in group.replicas] == [i + 1, i + 1]
        expected.rollout_id = "acked"
        assert await s.load("acked") == expected
    finally:
        await s.close()


async def test_a_replicated_append_on_a_primary_that_forgot_the_scripts_loads_them_and_lands_once(group):
    """The replicated append (script then WAIT in one pipeline) on a primary whose script cache was
    flushed (as a restarted or promoted one): NOSCRIPT, nothing ran; the scripts are loaded and the
    pipeline runs again, once: the turn is stored one time and acknowledged by the replicas."""
    s = _store(group.url, durability="replicated", min_replicas=2)
    try:
        deltas, expected = synthetic_rollout(random.Random(7), [2])
        await s.append_turn("flushed", deltas[0], expected_turn=0)
        redis.Redis(port=group.primary_port()).script_flush()
        await s.append_turn("flushed", deltas[1], expected_turn=1)
        assert [_turn_on(r.port, s, "flushed") for r in group.replicas] == [2, 2]
        expected.rollout_id = "flushed"
        assert await s.load("flushed") == expected
    finally:
        await s.close()


async def test_replicated_refuses_to_acknowledge_what_no_replica_holds_in_time(group):
    """Both replicas stalled (SIGSTOP): replicated answers StoreUnavailable after
    store.replication_timeout_s; local acknowledges at once (the primary has it)."""
    replicated = _store(group.url, durability="replicated", min_replicas=1, replication_timeout_s=0.3)
    local = _store(group.url)
    deltas, _ = synthetic_rollout(random.Random(2), [3])
    try:
        await replicated.append_turn("stalled-repl", deltas[0], expected_turn=0)
        with replicas_stalled(group):
            t0 = time.monotonic()
            with pytest.raises(StoreUnavailable, match="replica"):
                await replicated.append_turn("stalled-repl", deltas[1], expected_turn=1)
            took = time.monotonic() - t0
            # Concurrent appends (each on its own pooled connection): every one is refused, since
            # WAIT follows each write on the connection that made it.
            others, _ = synthetic_rollout(random.Random(9), [1])
            results = await asyncio.gather(*[replicated.append_turn(f"burst-{i}", others[0], expected_turn=0)
                                             for i in range(8)], return_exceptions=True)
            assert all(isinstance(r, StoreUnavailable) for r in results), results
            # An answer replayed from the store waits for the replicas as well.
            with pytest.raises(StoreUnavailable, match="replica"):
                await replicated.ensure_replicated("stalled-repl")
            await local.append_turn("stalled-local", deltas[0], expected_turn=0)
            await local.ensure_replicated("stalled-local")  # local: nothing to wait for
        print(f"replicated with stalled replicas: StoreUnavailable after {took:.2f}s (replication_timeout_s 0.3)")
        assert 0.25 <= took <= 1.5
        # The turn is written on the primary: the call's retry finds it (and replays it), never a second copy.
        assert (await replicated.load("stalled-repl")).turn == 2
    finally:
        await replicated.close()
        await local.close()


async def test_the_durability_status_says_when_the_replicas_an_append_waits_for_are_missing(group):
    """What /health and GET /v1/status report: in sync, both replicas; both stalled, none within
    replication_timeout_s (still connected), so an append would be refused; resumed, both again.
    local promises only the primary."""
    s = _store(group.url, durability="replicated", min_replicas=2, replication_timeout_s=0.3)
    local = _store(group.url)
    try:
        assert await s.durability_status() == {"durability": "replicated", "ok": True, "required": 2, "in_sync": 2,
                                               "connected": 2, "replication_timeout_s": 0.3}
        with replicas_stalled(group):
            t0 = time.monotonic()
            short = await s.durability_status()
            took = time.monotonic() - t0
            deltas, _ = synthetic_rollout(random.Random(5), [1])
            with pytest.raises(StoreUnavailable, match="0 of the 2 replica"):
                await s.append_turn("short-of-replicas", deltas[0], expected_turn=0)
        assert short == {"durability": "replicated", "ok": False, "required": 2, "in_sync": 0, "connected": 2,
                         "replication_timeout_s": 0.3}, short
        assert took < 2.0
        assert (await s.durability_status())["in_sync"] == 2
        assert await local.durability_status() == {"durability": "local", "ok": True}
    finally:
        await s.close()
        await local.close()


async def test_a_resent_replicated_append_is_not_acknowledged_before_the_replicas_hold_it(group):
    """The append lands on the primary, its answer is lost, redis-py resends it on a new
    connection: the resend must not be acknowledged until the replicas hold the turn (Redis's WAIT
    counts the writes of its own connection, so the resend writes before it waits)."""
    from reply_dropper import ReplyDropper

    proxy = ReplyDropper(group.primary_port())
    url = await proxy.start()
    s = _store(url, durability="replicated", min_replicas=1, replication_timeout_s=0.3)
    deltas, _ = synthetic_rollout(random.Random(4), [2])
    try:
        await s.append_turn("resent", deltas[0], expected_turn=0)
        with replicas_stalled(group):
            proxy.armed = True
            with pytest.raises(StoreUnavailable, match="replica"):
                await s.append_turn("resent", deltas[1], expected_turn=1)
            assert proxy.dropped == 1
        assert (await s.load("resent")).turn == 2  # on the primary: the call's retry replays it
        await s.ensure_replicated("resent")  # and now the replicas hold it
    finally:
        await s.close()
        proxy.close()


async def test_after_kill_9_of_the_primary_every_replicated_acknowledged_turn_is_on_the_new_primary(group):
    s = _store(group.url, durability="replicated", min_replicas=1)
    try:
        deltas, expected = synthetic_rollout(random.Random(3), [4, 2])
        for i, delta in enumerate(deltas[:4]):
            await s.append_turn("failover", delta, expected_turn=i)
        old_port = group.primary_port()
        os.kill(group.primary_pid(), signal.SIGKILL)
        took = group.wait_for_failover(old_port, timeout=30)
        print(f"failover to port {group.primary_port()} in {took:.1f}s")
        deadline = time.monotonic() + 30
        while True:  # the same store object follows the sentinels to the new primary
            try:
                state = await s.load("failover")
                break
            except StoreUnavailable:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.2)
        assert state.turn == 4
        for i, delta in enumerate(deltas[4:], start=4):
            await s.append_turn("failover", delta, expected_turn=i)
        expected.rollout_id = "failover"
        assert await s.load("failover") == expected
    finally:
        await s.close()
