"""Rollout affinity: every call of a rollout lands on one replica; a dead replica loses nothing."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import uuid

import httpx
import pytest
import ray

from serve_helpers import IM_END, MODEL



async def _turn(client, rid, messages, seed, retries=40):
    body = {"model": MODEL, "messages": messages, "max_tokens": 4, "seed": seed}
    for _ in range(retries):
        r = await client.post("/v1/chat/completions", json=body, headers={"X-Rollout-Id": rid})
        if r.status_code != 503:  # a killed replica answers 503 until Serve routes around it
            break
        await asyncio.sleep(0.25)
    assert r.status_code == 200, r.text
    return r.headers["x-rollout-replica"], r.json()["choices"][0]["message"]


async def _run_rollouts(url, rids, turns, state, between=None):
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        for turn in turns:
            if between is not None and turn == between[0]:
                await between[1]()

            async def one(rid):
                msgs = state[rid]["messages"]
                replica, msg = await _turn(client, rid, msgs, seed=turn)
                state[rid]["replicas"].append(replica)
                state[rid]["calls"].append(msg)
                msgs += [{"role": "assistant", "content": msg["content"] or ""},
                         {"role": "user", "content": f"turn {turn} of {rid}"}]

            await asyncio.gather(*[one(r) for r in rids])


def _new_state(rids):
    return {r: {"messages": [{"role": "user", "content": f"start {r}"}], "replicas": [], "calls": []} for r in rids}


def _check_trajectories(url, state):
    for rid, s in state.items():
        traj = httpx.get(f"{url}/v1/rollouts/{rid}").json()
        assert traj["turns"] == len(s["calls"]) and len(traj["segments"]) == 1, rid
        seg = traj["segments"][0]
        masked = [t for t, m in zip(seg["token_ids"], seg["loss_mask"]) if m]
        assert masked == [t for c in s["calls"] for t in c["generation_token_ids"]]
        for prev, cur in zip(s["calls"], s["calls"][1:]):
            base = prev["prompt_token_ids"] + prev["generation_token_ids"]
            assert cur["prompt_token_ids"][: len(base)] == base
        assert seg["token_ids"] == s["calls"][-1]["prompt_token_ids"] + s["calls"][-1]["generation_token_ids"]


def _affinity_replicas():
    return [a for a in ray.util.list_named_actors(all_namespaces=True) if "RolloutService" in a["name"]]


async def test_each_rollout_sticks_to_one_replica(service):
    rids = [f"aff-{i}-{uuid.uuid4().hex[:6]}" for i in range(32)]
    state = _new_state(rids)
    await _run_rollouts(service.url, rids, range(1, 6), state)
    per_replica = collections.Counter()
    for rid, s in state.items():
        assert len(s["replicas"]) == 5
        assert len(set(s["replicas"])) == 1, f"{rid} hit {set(s['replicas'])}"
        per_replica[s["replicas"][0]] += 1
    print("rollouts per replica:", dict(per_replica))
    assert len(per_replica) >= 2, "all rollouts landed on one replica"
    _check_trajectories(service.url, state)


@pytest.fixture(scope="module")
def drill_url(service):
    """A second app of the same service (same fleet, store and config, its own two replicas): the
    kill drill below kills one of *its* replicas, not one of the session service's, which every
    later test uses (a replica kill there once left a later call hanging: docs/data-plane.md).
    Its forwarded turns must be accepted within 1 ms, which no hop meets: every forwarded turn takes
    the fallback (the kill drill sends X-Rollout-Id only, so it forwards nothing)."""
    from ray import serve

    from rollout_service.serve.app import build_app

    config = service.config.model_copy(deep=True)
    config.service.forward_accept_timeout_s = 0.001
    serve.run(build_app(config), name="kill-drill", route_prefix="/kill-drill")
    yield f"{service.url}/kill-drill"
    serve.delete("kill-drill")


def _drill_replicas():
    return [a for a in _affinity_replicas() if "kill-drill" in a["name"]]


async def test_killed_affinity_replica_loses_no_rollout(drill_url):
    rids = [f"kill-{i}-{uuid.uuid4().hex[:6]}" for i in range(16)]
    state = _new_state(rids)
    killed = []

    async def kill_one():
        victim_id = collections.Counter(s["replicas"][-1] for s in state.values()).most_common(1)[0][0]
        victim = next(a for a in _drill_replicas() if victim_id in a["name"])
        ray.kill(ray.get_actor(victim["name"], namespace=victim["namespace"]), no_restart=False)
        killed.append(victim_id)

    await _run_rollouts(drill_url, rids, range(1, 6), state, between=(3, kill_one))
    moved = [rid for rid, s in state.items() if killed[0] in s["replicas"][:2]]
    assert moved, "no rollout was on the killed replica"
    for rid in moved:
        assert killed[0] not in state[rid]["replicas"][2:]
    _check_trajectories(drill_url, state)
    await _healed(drill_url)


async def _healed(url: str, timeout_s: float = 120.0) -> None:
    """The service heals: Serve's replacement replica answers rollouts again (and the session's
    later tests get the service they started with: both replicas serving)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    seen: set[str] = set()
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        while len(seen) < 2:
            assert loop.time() < deadline, f"only replicas {seen} answered {timeout_s:.0f} s after the kill"
            rid = f"heal-{uuid.uuid4().hex[:8]}"
            r = await client.post("/v1/chat/completions", headers={"X-Rollout-Id": rid},
                                  json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
            if r.status_code == 200:
                seen.add(r.headers["x-rollout-replica"])
            else:
                await asyncio.sleep(0.5)
            await client.delete(f"/v1/rollouts/{rid}", headers={"X-Rollout-Id": rid})


async def test_a_forwarded_turn_not_accepted_in_time_runs_where_it_arrived_and_stays_exact(drill_url):
    """service.forward_accept_timeout_s: a turn forwarded to its rollout's owner (X-Session-ID, not
    routed by the proxy) that the owner has not accepted in time is cancelled there and run on the
    replica that received it, exact from the store: one segment, every turn monotonic."""
    rid = f"fallback-{uuid.uuid4().hex[:8]}"
    state = _new_state([rid])
    receivers, owners = [], []
    async with httpx.AsyncClient(base_url=drill_url, timeout=120) as client:
        owner, msg = await _turn(client, rid, state[rid]["messages"], seed=1)
        state[rid]["calls"].append(msg)
        for turn in range(2, 10):
            msgs = state[rid]["messages"]
            msgs += [{"role": "assistant", "content": state[rid]["calls"][-1]["content"] or ""},
                     {"role": "user", "content": f"turn {turn}"}]
            r = await client.post("/v1/chat/completions", headers={"X-Session-ID": rid},
                                  json={"model": MODEL, "messages": msgs, "max_tokens": 4, "seed": turn})
            assert r.status_code == 200, r.text
            assert r.headers.get("x-rollout-forward") == "fallback", dict(r.headers)
            receivers.append(r.headers["x-rollout-replica"])
            owners.append(r.headers["x-rollout-owner"])
            message = r.json()["choices"][0]["message"]
            assert message["rollout"]["turn"] == turn and message["rollout"]["monotonic"], message["rollout"]
            state[rid]["calls"].append(message)
        state[rid]["messages"] = msgs
    assert owners == receivers, "a turn ran elsewhere than where it arrived: it was not the fallback"
    assert any(r != owner for r in receivers), f"every call arrived at the owner {owner}: nothing shown"
    _check_trajectories(drill_url, state)


@pytest.fixture(scope="module")
def quiet_url(service):
    """Another app of the same service whose replicas send no heartbeat on a forwarded turn's stream
    within the 2 s the sender allows it to stay silent: a quiet forwarded turn looks lost there."""
    from ray import serve

    from rollout_service.serve.app import build_app

    config = service.config.model_copy(deep=True)
    config.service.forward_accept_timeout_s = 2.0
    config.service.forward_heartbeat_s = 30.0
    serve.run(build_app(config), name="quiet-forward", route_prefix="/quiet-forward")
    yield f"{service.url}/quiet-forward"
    serve.delete("quiet-forward")


def _engine_handles(service):
    from rollout_service.fleet.fleet import fleet_name, get_fleet

    return ray.get(get_fleet(fleet_name(service.config.service.instance_name)).view.remote()).handles()


@contextlib.contextmanager
def _engines_paused(engines):
    """Every engine paused (keep: nothing aborted, no token generated) until the block ends."""
    ray.get([e.pause.remote("keep") for e in engines], timeout=60)
    try:
        yield
    finally:
        ray.get([e.resume.remote() for e in engines], timeout=60)


async def _started_rollout(client, prefix: str):
    """A new rollout with its first turn stored (X-Rollout-Id): its id, state and owning replica."""
    rid = f"{prefix}-{uuid.uuid4().hex[:8]}"
    state = _new_state([rid])
    owner, msg = await _turn(client, rid, state[rid]["messages"], seed=1)
    state[rid]["calls"].append(msg)
    return rid, state, owner


def _next_messages(state, rid: str, user: str) -> list[dict]:
    """The rollout's messages with its last answer and a new user message appended."""
    msgs = state[rid]["messages"]
    msgs += [{"role": "assistant", "content": state[rid]["calls"][-1]["content"] or ""},
             {"role": "user", "content": user}]
    return msgs


async def _forwarded_turn_while_paused(service, url: str, pause_s: float, rollouts: int = 4, attempts: int = 6):
    """The next turn of each of ``rollouts`` rollouts, sent at once with X-Session-ID while every
    engine is paused (keep) for ``pause_s``, until one arrives at a replica that does not own its
    rollout and is forwarded (each arrives at either replica: with 4 rollouts a round forwards none
    1 time in 16); returns that response, its rollout's owner, and every rollout's state (checked by
    the caller)."""
    engines = _engine_handles(service)
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        started = [await _started_rollout(client, "quiet") for _ in range(rollouts)]
        owners = {rid: owner for rid, _, owner in started}
        state = {rid: st[rid] for rid, st, _ in started}
        for turn in range(2, 2 + attempts):
            bodies = {rid: {"model": MODEL, "messages": _next_messages(state, rid, f"turn {turn}"), "max_tokens": 4,
                            "seed": turn} for rid in state}
            with _engines_paused(engines):
                calls = {rid: asyncio.create_task(client.post("/v1/chat/completions", json=body,
                                                              headers={"X-Session-ID": rid}))
                         for rid, body in bodies.items()}
                await asyncio.sleep(pause_s)
                assert not any(c.done() for c in calls.values()), "a turn was answered while every engine was paused"
            forwarded = None
            for rid, call in calls.items():
                r = await call
                assert r.status_code == 200, r.text
                message = r.json()["choices"][0]["message"]
                assert message["rollout"]["turn"] == turn and message["rollout"]["monotonic"], message["rollout"]
                state[rid]["calls"].append(message)
                if r.headers["x-rollout-replica"] != owners[rid] and forwarded is None:
                    forwarded = (r, owners[rid])
            if forwarded is not None:
                return (*forwarded, state)
    raise AssertionError(f"none of {attempts} rounds of turns arrived at a replica that does not own its rollout")


async def test_a_forwarded_turn_kept_quiet_by_a_paused_engine_is_kept_alive_by_heartbeats(service):
    """service.forward_heartbeat_s: the owner of a forwarded turn heartbeats while the turn waits for a
    paused engine, so a turn silent for longer than forward_accept_timeout_s (5 s) still completes on
    its owner: not given up, not run twice."""
    assert service.config.service.forward_heartbeat_s < service.config.service.forward_accept_timeout_s < 6.0
    r, owner, state = await _forwarded_turn_while_paused(service, service.url, pause_s=6.0)
    assert "x-rollout-forward" not in r.headers, dict(r.headers)
    assert r.headers["x-rollout-owner"] == owner != r.headers["x-rollout-replica"]
    _check_trajectories(service.url, state)


async def test_a_forwarded_turn_whose_stream_goes_silent_runs_where_it_arrived_and_stays_exact(service, quiet_url):
    """After its acceptance a forwarded turn's stream silent for forward_accept_timeout_s counts as lost
    (no heartbeat came: the owner of this app sends none within it): the sender cancels it there and
    runs it itself, exact from the store (the owner's generation was aborted, nothing stored twice)."""
    r, owner, state = await _forwarded_turn_while_paused(service, quiet_url, pause_s=3.5)
    assert r.headers.get("x-rollout-forward") == "fallback", dict(r.headers)
    assert r.headers.get("x-rollout-forward-reason") == "silent", dict(r.headers)
    assert r.headers["x-rollout-owner"] == r.headers["x-rollout-replica"] != owner
    assert r.json()["choices"][0]["message"]["rollout"]["replayed"] is False
    _check_trajectories(quiet_url, state)


async def test_a_forwarded_stream_that_goes_silent_after_deltas_ends_with_a_retryable_error(service, quiet_url):
    """Part of a streamed answer reached the client when the owner's stream went silent: it cannot be
    run again under the client's feet, so the stream ends with a 503 forward_lost error event; the
    same request sent again continues the rollout exactly (one segment, turn 2)."""
    import json

    engines = _engine_handles(service)
    async with httpx.AsyncClient(base_url=quiet_url, timeout=120) as client:
        rid, state, owner = await _started_rollout(client, "quiet-stream")
        body = {"model": MODEL, "messages": _next_messages(state, rid, "a long story"), "max_tokens": 400,
                "ignore_eos": True, "seed": 2, "stream": True}
        error = None
        for _ in range(12):  # until the call arrives at the replica that does not own the rollout
            async with client.stream("POST", "/v1/chat/completions", json=body, headers={"X-Session-ID": rid}) as r:
                assert r.status_code == 200
                if r.headers["x-rollout-replica"] == owner:
                    continue  # ran by the owner itself: leaving aborts it, nothing is stored
                lines = r.aiter_lines()
                async for line in lines:
                    if line.startswith("data: {"):
                        break  # the stream starts on the call's first generated tokens: now the engines stop
                with _engines_paused(engines):
                    async for line in lines:
                        if line.startswith("data: {") and '"error"' in line:
                            error = json.loads(line[len("data: "):])["error"]
                break
        assert error is not None, "no forwarded stream, or it ended without an error"
        assert error["code"] == "forward_lost" and error["type"] == "service_unavailable", error
        r = await client.post("/v1/chat/completions", json={**body, "stream": False, "max_tokens": 4},
                              headers={"X-Session-ID": rid})
        assert r.status_code == 200, r.text
        message = r.json()["choices"][0]["message"]
        assert message["rollout"]["turn"] == 2 and message["rollout"]["monotonic"], message["rollout"]
        state[rid]["calls"].append(message)
    _check_trajectories(quiet_url, state)
