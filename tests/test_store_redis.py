"""What only the Redis store promises: append-only writes, key layout, expiry, persistence, cluster."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time
import uuid

import pytest
import redis.asyncio as aioredis
from redis.crc import key_slot

from rollout_service.store import EmbeddedRedis, EmbeddedRedisError, RedisRolloutStore, StoreUnavailable, TurnConflict
from rollout_service.store.embedded import free_port
from rollout_service.store.urls import parse_redis_url
from rollout_service.serve.errors import http_error
from synthetic_rollouts import synthetic_delta, synthetic_rollout


@pytest.fixture
async def store(redis_server):
    s = RedisRolloutStore.from_url(redis_server, ttl_seconds=1000, key_prefix=f"t{uuid.uuid4().hex[:8]}")
    yield s
    await s.close()


async def commit_all(store, rid, deltas):
    for d in deltas:
        await store.append_turn(rid, d, expected_turn=d.turn - 1)


async def scan_keys(client, pattern):
    return sorted([k async for k in client.scan_iter(match=pattern, count=1000)])


def same_size_delta(turn, seg_len):
    # Fixed-width content so every turn sends the same number of bytes.
    d = synthetic_delta(random.Random(turn), turn=turn, segment_index=0, new_segment=turn == 1, segment_len=seg_len,
                        prompt_tokens=100, gen_tokens=900)
    d.new_messages = [{"role": "tool", "content": "r" * 200}, {"role": "assistant", "content": "a" * 300}]
    d.render_context = {"tools": []}
    d.record.finish_reason = "stop"
    return d


async def test_append_cost_does_not_grow_with_history(store):
    """The 2nd and the 60th append of a 1,000-token turn issue the same commands and send/persist the same bytes."""
    c = store.client

    async def measured_append(turn, seg_len):
        def snap(info_cs, info_all):
            calls = {k: v["calls"] for k, v in info_cs.items() if k not in ("cmdstat_info",)}
            return calls, info_all["total_net_input_bytes"], info_all["aof_current_size"]

        calls0, in0, aof0 = snap(await c.info("commandstats"), await c.info("all"))
        await store.append_turn("long", same_size_delta(turn, seg_len), expected_turn=turn - 1)
        await store.recent.settled()  # its index entry, written after the acknowledgement: in the measure too
        calls1, in1, aof1 = snap(await c.info("commandstats"), await c.info("all"))
        delta_calls = {k: calls1[k] - calls0.get(k, 0) for k in calls1 if calls1[k] != calls0.get(k, 0)}
        return delta_calls, in1 - in0, aof1 - aof0

    seg_len = 0
    costs = {}
    for turn in range(1, 61):
        costs[turn] = await measured_append(turn, seg_len)
        seg_len += 1000
    early, late = costs[2], costs[60]
    print("append cost turn 2:", early, "turn 60:", late)
    assert early[0] == late[0], (early[0], late[0])
    assert late[0].get("cmdstat_set") == 1  # render_context only: no SET of the history
    assert late[0]["cmdstat_append"] == 3  # ids, logprobs, mask
    assert late[0]["cmdstat_evalsha"] == 1
    # ~9 KB per turn (4+4+1 bytes per token + JSON); nothing proportional to the 60k-token history.
    for sent, persisted in (early[1:], late[1:]):
        assert 9_000 < sent < 12_000 and 9_000 < persisted < 12_000
    assert abs(late[1] - early[1]) < 64 and abs(late[2] - early[2]) < 64
    ids_key = store.keys_for("long", 1)[1]
    assert await c.strlen(ids_key) == 4 * 60_000
    assert len((await store.load("long")).segments[0].token_ids) == 60_000


async def test_keys_are_hash_tagged_and_share_one_cluster_slot(store):
    keys = store.keys_for("rollout:42", 3)
    assert keys[0] == f"{store.key_prefix}:{{rollout:42}}:meta"
    assert all("{rollout:42}" in k for k in keys)
    assert {key_slot(k.encode()) for k in keys} == {key_slot(b"rollout:42")}


async def test_stored_keys_are_exactly_the_documented_layout(store):
    deltas, _ = synthetic_rollout(random.Random(0), [2, 1])
    await commit_all(store, "r", deltas)
    found = await scan_keys(store.client, store.key_pattern("r"))
    assert [k.decode() for k in found] == sorted(store.keys_for("r", 2))
    meta = await store.client.hgetall(store.meta_key("r"))
    born = meta.pop(b"born")
    assert len(meta.pop(b"aid")) == 16
    assert abs(int(meta.pop(b"at")) / 1000 - time.time()) < 60  # the summary of the recent index
    assert meta == {b"turn": b"3", b"nseg": b"2", b"v": b"1", b"ver": b"v0", b"c": b"0", b"mig": b"0"}
    assert len(born) == 16 and born.decode() == (await store.load("r")).incarnation


async def test_delete_frees_every_key(store):
    deltas, _ = synthetic_rollout(random.Random(1), [2, 3, 1])
    await commit_all(store, "gone", deltas)
    await commit_all(store, "kept", deltas)
    assert len(await scan_keys(store.client, store.key_pattern("gone"))) == 1 + 3 * 6
    assert await store.delete("gone") is True
    assert await scan_keys(store.client, store.key_pattern("gone")) == []
    assert await scan_keys(store.client, "*{gone}*") == []
    assert len(await scan_keys(store.client, store.key_pattern("kept"))) == 1 + 3 * 6


async def test_every_key_gets_the_ttl_and_each_turn_refreshes_all_of_them(store):
    c = store.client
    deltas, _ = synthetic_rollout(random.Random(2), [1, 2])
    await commit_all(store, "r", deltas[:2])
    keys = store.keys_for("r", 2)
    assert all(900_000 < t <= 1_000_000 for t in [await c.pttl(k) for k in keys])
    for k in keys:
        await c.pexpire(k, 5_000)  # as if the rollout had been idle for a long time
    await store.append_turn("r", deltas[2], expected_turn=2)
    assert all(900_000 < t <= 1_000_000 for t in [await c.pttl(k) for k in keys])  # segment 0 too, though untouched
    for k in keys:
        await c.pexpire(k, 5_000)
    assert await store.touch("r") is True
    assert all(900_000 < t <= 1_000_000 for t in [await c.pttl(k) for k in keys])


async def test_rollout_expires_as_a_whole(redis_server):
    s = RedisRolloutStore.from_url(redis_server, ttl_seconds=0.2, key_prefix=f"t{uuid.uuid4().hex[:8]}")
    deltas, _ = synthetic_rollout(random.Random(3), [1, 1])
    await commit_all(s, "short", deltas)
    assert await s.exists("short")
    await asyncio.sleep(0.4)
    assert await s.load("short") is None
    assert await scan_keys(s.client, s.key_pattern("short")) == []
    await s.close()


async def test_history_survives_a_server_restart_through_the_aof(tmp_path):
    server = EmbeddedRedis(tmp_path / "aof")
    url = server.start()
    try:
        s = RedisRolloutStore.from_url(url)
        deltas, expected = synthetic_rollout(random.Random(4), [3, 2])
        await commit_all(s, "durable", deltas)
        await s.close()
        pid = server.pid
        server.restart()
        assert server.pid != pid and server.url == url
        s = RedisRolloutStore.from_url(url)
        expected.rollout_id = "durable"
        assert await s.load("durable") == expected
        with pytest.raises(TurnConflict):
            await s.append_turn("durable", deltas[0], expected_turn=0)
        await s.close()
        assert any((tmp_path / "aof" / "appendonlydir").iterdir())
    finally:
        server.stop()
    assert server.process is None


async def test_a_supervised_server_killed_with_sigkill_is_restarted_and_the_same_client_carries_on(tmp_path):
    """What ``up`` does for its embedded Redis: SIGKILL the server under a live client; the supervisor
    starts it again on the same port and AOF, and the very same store object (its connection pool
    and registered Lua scripts) loads every acknowledged turn and appends the next one."""
    server = EmbeddedRedis(tmp_path / "sup")
    url = server.start()
    logged: list[str] = []
    server.supervise(log=logged.append, interval_s=0.1)
    s = RedisRolloutStore.from_url(url)
    try:
        deltas, expected = synthetic_rollout(random.Random(5), [3])
        await commit_all(s, "killed", deltas[:2])
        pid = server.pid
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 20
        while server.restarts == 0:
            assert time.monotonic() < deadline, f"not restarted: {logged}"
            await asyncio.sleep(0.05)
        assert server.pid != pid and server.url == url
        assert any("restarted" in line for line in logged), logged
        while True:  # the first call after the kill may still meet the dead connection
            try:
                state = await s.load("killed")
                break
            except StoreUnavailable:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.1)
        assert state.turn == 2
        await s.append_turn("killed", deltas[2], expected_turn=2)
        expected.rollout_id = "killed"
        assert await s.load("killed") == expected
    finally:
        await s.close()
        server.stop()
    time.sleep(0.3)  # a stopped server stays stopped: the supervisor has ended
    assert server.process is None and server.restarts == 1


async def test_unreachable_server_is_unavailable_not_a_crash():
    s = RedisRolloutStore.from_url(f"redis://127.0.0.1:{free_port('127.0.0.1')}/0", socket_connect_timeout=0.5)
    assert await s.ping() is False
    with pytest.raises(StoreUnavailable):
        await s.load("r")
    await s.close()


def test_missing_redis_server_binary_says_how_to_install(tmp_path):
    with pytest.raises(EmbeddedRedisError, match="apt-get install"):
        EmbeddedRedis(tmp_path, redis_server=str(tmp_path / "no-such-redis-server")).start()


@pytest.mark.parametrize(
    "url, clean, cluster",
    [
        ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0", False),
        ("redis+cluster://10.0.0.1:7000", "redis://10.0.0.1:7000", True),
        ("rediss+cluster://h:7000/?ssl_cert_reqs=none", "rediss://h:7000/?ssl_cert_reqs=none", True),
        ("redis://h:7000/?cluster=true&protocol=3", "redis://h:7000/?protocol=3", True),
        ("redis://h:7000/?cluster=0", "redis://h:7000/", False),
    ],
)
def test_url_selects_the_client(url, clean, cluster):
    assert parse_redis_url(url) == (clean, cluster)


def test_unknown_url_scheme_is_refused():
    with pytest.raises(ValueError):
        parse_redis_url("http://127.0.0.1:6379")


@pytest.fixture(scope="module")
def cluster_url(tmp_path_factory):
    """A real one-node Redis Cluster owning all 16384 slots: exercises RedisCluster routing of the scripts."""
    server = EmbeddedRedis(tmp_path_factory.mktemp("cluster"), extra_args=["--cluster-enabled", "yes"])
    server.start()
    import redis

    r = redis.Redis(host=server.host, port=server.port)
    r.execute_command("CLUSTER", "ADDSLOTSRANGE", 0, 16383)
    deadline = time.monotonic() + 10
    while b"cluster_state:ok" not in r.execute_command("CLUSTER", "INFO"):
        assert time.monotonic() < deadline, "cluster did not become ok"
        time.sleep(0.05)
    r.close()
    yield f"redis+cluster://{server.host}:{server.port}"
    server.stop()


async def test_same_code_runs_on_a_redis_cluster(cluster_url):
    s = RedisRolloutStore.from_url(cluster_url, ttl_seconds=1000)
    assert s.is_cluster and isinstance(s.client, aioredis.RedisCluster)
    deltas, expected = synthetic_rollout(random.Random(5), [2, 2])
    await commit_all(s, "clustered", deltas)
    expected.rollout_id = "clustered"
    assert await s.load("clustered") == expected
    with pytest.raises(TurnConflict):
        await s.append_turn("clustered", deltas[-1], expected_turn=3)
    for k in s.keys_for("clustered", 2):
        assert await s.client.cluster_keyslot(k) == key_slot(k.encode()) == key_slot(b"clustered")
    assert 900 < await s.ttl("clustered") <= 1000
    assert await s.delete("clustered") is True and await s.load("clustered") is None
    assert await s.ping() is True
    await s.close()


def _deadline_store(url: str, **store) -> RedisRolloutStore:
    from rollout_service.config import StoreConfig

    return RedisRolloutStore.from_config(StoreConfig.model_validate({"redis_url": url, **store}))


async def test_a_stalled_redis_answers_store_unavailable_within_the_configured_deadline(tmp_path):
    """SIGSTOP the redis-server: every operation fails with StoreUnavailable after about
    (store.retries + 1) x store.timeout_s, never hangs; after SIGCONT the same store works."""
    server = EmbeddedRedis(tmp_path / "stalled")
    url = server.start()
    s = _deadline_store(url, timeout_s=0.4, retries=1, retry_backoff_cap_s=0.1)
    try:
        deltas, _ = synthetic_rollout(random.Random(6), [3])
        await commit_all(s, "stalled", deltas[:1])
        os.kill(server.pid, signal.SIGSTOP)
        try:
            for op in (lambda: s.load("stalled"), lambda: s.append_turn("stalled", deltas[1], expected_turn=1)):
                t0 = time.monotonic()
                with pytest.raises(StoreUnavailable) as err:
                    await asyncio.wait_for(op(), 10)
                took = time.monotonic() - t0
                # What the wire carries: 503 store_unavailable, saying why.
                answer = http_error(err.value).envelope()["error"]
                assert (err.value.status, answer["code"], answer["type"]) == (503, "store_unavailable",
                                                                            "service_unavailable")
                assert "redis unavailable" in answer["message"]
                print(f"stalled redis: StoreUnavailable after {took:.2f}s (timeout 0.4 s, 1 retry)")
                assert 0.7 <= took <= 2.0
        finally:
            os.kill(server.pid, signal.SIGCONT)
        # The append sent while Redis was stopped may have been executed when it woke up (its answer
        # lost): its retry with the same turn is then told "conflict", never applied twice.
        state = await s.load("stalled")
        assert state.turn in (1, 2)
        if state.turn == 1:
            await s.append_turn("stalled", deltas[1], expected_turn=1)
        await s.append_turn("stalled", deltas[2], expected_turn=2)
        assert (await s.load("stalled")).turn == 3
    finally:
        await s.close()
        server.stop()


async def test_an_append_whose_answer_is_lost_is_retried_and_applied_once(tmp_path):
    """A TCP proxy forwards the append to the real redis-server and drops the connection before the
    answer comes back: redis-py sends it again (store.retries) and the append id makes the second
    execution a success, not a 409 conflict and not a second copy of the turn."""
    from reply_dropper import ReplyDropper

    server = EmbeddedRedis(tmp_path / "lossy")
    url = server.start()
    proxy = ReplyDropper(int(url.rsplit(":", 1)[1].split("/")[0]))
    proxy_url = await proxy.start()
    s = _deadline_store(proxy_url, timeout_s=2.0, retries=2)
    try:
        deltas, expected = synthetic_rollout(random.Random(7), [2, 2])
        await commit_all(s, "lossy", deltas[:2])
        proxy.armed = True
        await s.append_turn("lossy", deltas[2], expected_turn=2)  # answer lost once, retried
        assert proxy.dropped == 1
        await s.append_turn("lossy", deltas[3], expected_turn=3)
        expected.rollout_id = "lossy"
        assert await s.load("lossy") == expected  # every turn once, in order
    finally:
        await s.close()
        proxy.close()
        server.stop()


@pytest.mark.parametrize("shards", [1, 4], ids=["one set", "4 shards as on a Cluster"])
async def test_the_recent_index_pages_newest_first_without_repeats_and_stays_bounded(redis_server, shards):
    """store/recent.py: every append moves its rollout to the front; pages follow next_cursor without
    repeating or skipping, also across equal timestamps and across shards; a deleted rollout leaves the
    index; each set never holds more than its share of store.recent_rollouts; summaries come from the
    append script."""
    s = RedisRolloutStore.from_url(redis_server, ttl_seconds=1000, key_prefix=f"t{uuid.uuid4().hex[:8]}",
                                   recent_size=12, recent_shards=shards)
    try:
        assert len(s.recent.keys) == shards
        rids = [f"r{i:02d}" for i in range(15)]
        for i, rid in enumerate(rids):
            rng = random.Random(i)
            d1 = synthetic_delta(rng, turn=1, segment_index=0, new_segment=True, segment_len=0, weight_version=f"v{i}")
            d2 = synthetic_delta(rng, turn=2, segment_index=0, new_segment=False, segment_len=len(d1.token_ids),
                                 weight_version=f"v{i}")
            for d in (d1, d2):
                d.record.constrained = i == 3
                d.record.migrations = 1 if i == 4 else 0
            await commit_all(s, rid, [d1, d2])
        await asyncio.sleep(0.01)  # scores are milliseconds: r05's new turn is later than r14's
        await commit_all(s, "r05", [synthetic_delta(random.Random(99), turn=3, segment_index=1, new_segment=True,
                                                    segment_len=0, prompt_tokens=5, gen_tokens=3)])
        newest_first = ["r05"] + [f"r{i:02d}" for i in range(14, -1, -1) if i != 5]
        share = 12 // shards
        kept = [rid for rid in newest_first  # each set keeps its own newest `share`
                if [r for r in newest_first if s.recent.key_of(r) == s.recent.key_of(rid)].index(rid) < share]
        if shards == 1:
            assert kept == newest_first[:12]  # trimmed to its size: r00..r02 fell out
        assert len({s.recent.key_of(r) for r in rids}) > 1 or shards == 1  # the ids really spread
        for key in s.recent.keys:
            assert await s.client.zcard(key) <= share
        seen, cursor = [], None
        while True:
            rows, cursor, indexed = await s.list_recent(5, cursor)
            seen += rows
            if cursor is None:
                break
        assert indexed == len(kept)
        assert [r["id"] for r in seen] == kept
        by_id = {r["id"]: r for r in seen}
        assert (by_id["r05"]["turns"], by_id["r05"]["segments"], by_id["r05"]["forked"]) == (3, 2, True)
        if "r07" in by_id:
            assert by_id["r07"]["weight_version"] == "v7" and by_id["r07"]["turns"] == 2
        if "r03" in by_id:
            assert by_id["r03"]["constrained_calls"] == 2
        if "r04" in by_id:
            assert by_id["r04"]["migrations"] == 2
        # Equal timestamps: one score for every member; pages of 4 still give each id once.
        for rid in kept:
            await s.client.zadd(s.recent.key_of(rid), {rid: 1000})
        seen, cursor = [], None
        while True:
            rows, cursor, _ = await s.list_recent(4, cursor)
            seen += [r["id"] for r in rows]
            if cursor is None:
                break
        assert seen == sorted(kept, reverse=True)
        await s.delete(kept[3])
        rows, _, indexed = await s.list_recent(100)
        assert kept[3] not in [r["id"] for r in rows] and indexed == len(kept) - 1
        with pytest.raises(ValueError):
            await s.list_recent(5, "not-a-cursor")
    finally:
        await s.close()


async def test_more_concurrent_calls_than_pooled_connections_wait_for_one_and_all_succeed(redis_server):
    """store.max_connections bounds a client's connections; a call that finds them all busy waits for a
    free one (redis-py's BlockingConnectionPool, at most the command deadline) instead of failing with
    "Too many connections" (its default ConnectionPool: 100)."""
    from rollout_service.config import StoreConfig

    config = StoreConfig(redis_url=redis_server, key_prefix=f"t{uuid.uuid4().hex[:8]}", max_connections=3)
    store = RedisRolloutStore.from_config(config)
    try:
        deltas = {f"r{i}": synthetic_rollout(random.Random(i), [2])[0] for i in range(64)}
        await asyncio.gather(*(commit_all(store, rid, d) for rid, d in deltas.items()))
        loaded = await asyncio.gather(*(store.load(rid) for rid in deltas))
        assert all(s is not None and s.turn == 2 for s in loaded)
        assert store.client.connection_pool.max_connections == 3
    finally:
        await store.close()
    plain = aioredis.Redis.from_url(redis_server, max_connections=3)  # what the store used before: refused
    try:
        with pytest.raises(aioredis.ConnectionError, match="Too many connections"):
            await asyncio.gather(*(plain.execute_command("DEBUG", "SLEEP", "0.05") for _ in range(8)))
    finally:
        await plain.aclose()
