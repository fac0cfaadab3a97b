"""A hung engine (SIGSTOP) is declared dead within the configured time and replaced; its
in-flight calls run again elsewhere (no token sent yet) or continue on the other engine from the
tokens already streamed (mid-turn migration); the stopped process is killed, never reused. On stand-in engines (``sim_rig``): the detection, the
kill and the migration are the fleet's and the data plane's; the real engine's mid-turn migration is
tests/test_fleet_engine_death.py's."""

from __future__ import annotations

import asyncio
import signal
import time

import pytest

from fleet_helpers import FLEET, call, kill_pid, new_rid, process_gone, run_events, turn_request



async def test_sigstopped_engine_is_detected_killed_and_replaced(sim_rig):
    rig = sim_rig
    view = await rig.view()
    pids = await rig.member_pids()
    victim = view.members[0]
    client = rig.runner.fleet

    # A streaming call that has already sent tokens when the engine hangs.
    streaming_rid = new_rid("hung-stream")
    client.pins[streaming_rid] = victim.key
    req = turn_request(streaming_rid, [{"role": "user", "content": "a long story"}], seed=3, stream=True, max_tokens=400)
    events: list[dict] = []
    first_delta = asyncio.Event()

    async def consume():
        events.extend(await run_events(rig.runner, req, lambda e: e.get("kind") == "delta" and first_delta.set()))

    streaming = asyncio.create_task(consume())
    await asyncio.wait_for(first_delta.wait(), 60)

    kill_pid(pids[victim.slot], signal.SIGSTOP)
    t_stop = time.monotonic()
    # A non-streaming call pinned to the hung engine: nothing sent yet, so it is retried elsewhere.
    quiet_rid = new_rid("hung-quiet")
    client.pins[quiet_rid] = victim.key
    quiet = asyncio.create_task(call(rig.runner, quiet_rid, [{"role": "user", "content": "hi"}], seed=4, stream=False))

    detect_s = await rig.wait_not_serving(victim.slot, timeout=60)
    bound = FLEET["unresponsive_after_s"] + FLEET["probe_interval_s"] + FLEET["probe_timeout_s"] + 2
    print(f"SIGSTOP -> declared dead: {detect_s:.1f}s (bound {bound:.1f}s)")
    assert detect_s <= bound

    await asyncio.wait_for(streaming, 120)
    final = events[-1]
    assert "__error__" not in final, final  # continued on the other engine once the hang was declared
    streamed = [t for e in events[:-1] if e.get("kind") == "delta" for t in e["token_ids"]]
    assert streamed == final["generation_token_ids"] and final["rollout"]["migrations"] == 1
    assert final["engine_index"] != victim.slot
    stored = await rig.store.load(streaming_rid)
    assert stored.segments[0].token_ids == final["prompt_token_ids"] + final["generation_token_ids"]
    assert stored.segments[0].turns[0].migrations == 1

    result = await asyncio.wait_for(quiet, 60)
    assert "__error__" not in result and result["rollout"]["turn"] == 1, result
    assert (await rig.store.load(quiet_rid)).turn == 1

    # The stopped process is killed (SIGKILL reaches a stopped process); a SIGCONT finds nothing to resume.
    deadline = time.monotonic() + 30
    while not process_gone(pids[victim.slot]):
        assert time.monotonic() < deadline, "the hung engine's process was not killed"
        await asyncio.sleep(0.2)
    try:
        kill_pid(pids[victim.slot], signal.SIGCONT)
    except ProcessLookupError:
        pass
    await rig.wait_serving(2, version=view.version)
    new_pids = await rig.member_pids()
    assert new_pids[victim.slot] != pids[victim.slot]
    print(f"SIGSTOP -> two engines serving again: {time.monotonic() - t_stop:.1f}s")
