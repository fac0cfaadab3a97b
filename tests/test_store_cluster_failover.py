"""The store on a real Redis Cluster of three primaries with a replica each (``LocalRedisCluster``,
redis-server processes on 127.0.0.1): the rollouts' keys spread over every primary (one hash tag per
rollout), and when one primary is killed (``kill -9``) under concurrent appends, every failure a
writer sees is the retryable StoreUnavailable (redis-py 8.1 lets some dropped-connection writes
raise AttributeError instead: translated), the replica is promoted, and every rollout is readable
and appendable again. How many acknowledged turns ``local`` durability loses in that failover, under
heavier load: scripts/drill_sentinel.py --topology cluster (docs/reliability.md)."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time

import pytest

from rollout_service.store import RedisRolloutStore, StoreUnavailable
from rollout_service.store.cluster_group import LocalRedisCluster
from synthetic_rollouts import synthetic_delta

WRITERS = 24


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with LocalRedisCluster(tmp_path_factory.mktemp("cluster"), primaries=3, replicas=1, node_timeout_ms=1000) as c:
        yield c


def _delta(rng, turn: int, seg_len: int):
    return synthetic_delta(rng, turn=turn, segment_index=0, new_segment=turn == 1, segment_len=seg_len,
                           prompt_tokens=16, gen_tokens=16)


def test_a_new_clients_first_concurrent_appends_all_land_and_a_flushed_script_is_loaded_again(cluster):
    """The scripts are loaded on every primary once, before a new client's first call, while the calls
    beside it wait: with redis-py's own fallback (a SCRIPT LOAD inside each call that met NOSCRIPT), 16
    concurrent first appends on a fresh Cluster client ended mostly in 503s (connections broken beside
    the loads). A node that forgot them (SCRIPT FLUSH: as a restarted or promoted one) gets them again."""
    from rollout_service.config import StoreConfig

    async def run() -> list:
        import redis.asyncio as aioredis

        for port in cluster.primaries():  # as a fresh Cluster: no script known anywhere
            node = aioredis.Redis(host="127.0.0.1", port=port)
            await node.script_flush()
            await node.aclose()
        store = RedisRolloutStore.from_config(StoreConfig.model_validate(
            {"redis_url": cluster.url, "key_prefix": "sl", "recent_rollouts": 0}))
        errors = []

        async def writer(i: int, turns: range) -> None:
            for turn in turns:
                try:
                    await store.append_turn(f"sl-{i}", _delta(random.Random(i * 100 + turn), turn, (turn - 1) * 32),
                                            expected_turn=turn - 1)
                except Exception as exc:  # noqa: BLE001 - what the test is about
                    errors.append(repr(exc)[:200])
                    return

        try:
            await asyncio.gather(*(writer(i, range(1, 4)) for i in range(16)))
            for port in cluster.primaries():
                node = aioredis.Redis(host="127.0.0.1", port=port)
                await node.script_flush()
                await node.aclose()
            await asyncio.gather(*(writer(i, range(4, 6)) for i in range(16)))
            states = await asyncio.gather(*(store.load(f"sl-{i}") for i in range(16)))
            errors += [f"sl-{i}: {s.turn if s else None} turns" for i, s in enumerate(states) if s is None or s.turn != 5]
        finally:
            await store.close()
        return errors

    assert asyncio.run(run()) == []


def test_the_recent_index_is_spread_over_the_primaries_and_pages_as_one(cluster):
    """store/recent.py on a Cluster: the index is CLUSTER_SHARDS hash-tagged sets on every primary (no
    one node takes every append's index write), and a page over them is newest first, each id once."""
    from rollout_service.config import StoreConfig
    from rollout_service.store.recent import CLUSTER_SHARDS

    async def run() -> tuple[set, list, list, int, int]:
        store = RedisRolloutStore.from_config(StoreConfig.model_validate(
            {"redis_url": cluster.url, "key_prefix": "ri", "recent_rollouts": 1000}))
        try:
            order = []
            for i in range(40):
                rid = f"ri-{i}"
                await store.append_turn(rid, _delta(random.Random(i), 1, 0), expected_turn=0)
                order.append(rid)
                await asyncio.sleep(0.002)  # distinct millisecond scores: one order to expect
            nodes = {store.client.get_node_from_key(key).name for key in store.recent.keys}
            used = {store.recent.key_of(rid) for rid in order}
            seen, cursor = [], None
            while True:
                rows, cursor, indexed = await store.list_recent(7, cursor)
                seen += [r["id"] for r in rows]
                if cursor is None:
                    break
            return nodes, seen, order[::-1], len(used), indexed
        finally:
            await store.close()

    nodes, seen, newest_first, used, indexed = asyncio.run(run())
    assert len(nodes) == 3  # every primary holds shards of the index
    assert used > 3 and CLUSTER_SHARDS > 3
    assert seen == newest_first and indexed == 40


def test_a_primary_killed_under_load_costs_only_retryable_errors_and_every_rollout_goes_on(cluster):
    from rollout_service.config import StoreConfig

    async def run() -> dict:
        store = RedisRolloutStore.from_config(StoreConfig.model_validate(
            {"redis_url": cluster.url, "key_prefix": "cf", "timeout_s": 2.0, "retries": 2}))
        stop = asyncio.Event()
        seen = {"acked": 0, "unavailable": 0, "other": []}

        async def stored(rid: str) -> tuple[int, int]:
            """(turns, segment length) stored, read as an agent's retry would (waiting out the failover)."""
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                try:
                    state = await store.load(rid)
                    break
                except StoreUnavailable:
                    await asyncio.sleep(0.1)
            else:
                raise AssertionError(f"{rid} unreadable 60 s after the failover")
            if state is None:
                return 0, 0
            return state.turn, sum(len(s.token_ids) for s in state.segments)

        async def writer(i: int) -> None:
            rid, rng, turn, seg_len = f"cf-{i}", random.Random(i), 0, 0
            while not stop.is_set():
                delta = _delta(rng, turn + 1, seg_len)
                try:
                    await store.append_turn(rid, delta, expected_turn=turn)
                    turn, seg_len = turn + 1, seg_len + len(delta.token_ids)
                    seen["acked"] += 1
                except StoreUnavailable:
                    seen["unavailable"] += 1
                    await asyncio.sleep(0.1)
                    turn, seg_len = await stored(rid)  # landed before the error, or lost with the primary
                except Exception as exc:  # noqa: BLE001 - what the test is about: nothing else leaks
                    seen["other"].append(repr(exc)[:200])
                    return

        tasks = [asyncio.create_task(writer(i)) for i in range(WRITERS)]
        await asyncio.sleep(2.0)
        spread = await asyncio.to_thread(cluster.keys_per_primary)
        victim = cluster.primaries()[0]
        os.kill(cluster.pid_of(victim), signal.SIGKILL)
        failover_s = await asyncio.to_thread(cluster.wait_for_failover, victim, 30)
        await asyncio.sleep(2.0)
        stop.set()
        await asyncio.gather(*tasks)
        # Every rollout is readable on the promoted cluster and takes its next turn.
        for i in range(WRITERS):
            n, seg_len = await stored(f"cf-{i}")
            await store.append_turn(f"cf-{i}", _delta(random.Random(1000 + i), n + 1, seg_len), expected_turn=n)
        await store.close()
        return {**seen, "spread": spread, "failover_s": failover_s}

    t0 = time.monotonic()
    out = asyncio.run(run())
    print(f"cluster failover: {out['failover_s']:.1f}s, {out['acked']} turns acked, {out['unavailable']} "
          f"StoreUnavailable, keys per primary {sorted(out['spread'].values())}, {time.monotonic() - t0:.1f}s in all")
    assert out["other"] == []
    assert len(out["spread"]) == 3 and all(n > 0 for n in out["spread"].values())
    assert out["acked"] > 0


def test_only_errors_raised_inside_redis_pys_connection_code_count_as_a_lost_connection():
    """The translation of redis-py 8.1's leaked transport errors (redis/redis-py#4287) is narrow: an
    AttributeError raised by code in redis-py's asyncio connection module is a lost connection; the
    same error from anywhere else is a bug and stays one."""
    from rollout_service.store.redis_store import raised_by_a_dropped_connection

    def raised_in(filename: str) -> BaseException:
        code = compile("def write(writer):\n    writer.writelines([b'x'])\n", filename, "exec")
        scope: dict = {}
        exec(code, scope)
        try:
            scope["write"](None)
        except AttributeError as exc:
            return exc
        raise AssertionError("no error raised")

    import redis.asyncio.connection as connection_module

    assert raised_by_a_dropped_connection(raised_in(connection_module.__file__))
    assert not raised_by_a_dropped_connection(raised_in(__file__))
