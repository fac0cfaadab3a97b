"""Every engine killed: calls answer 503 during the outage, the fleet heals with no operator
action (on the current weights, from the copy it keeps), and the interrupted rollout continues exactly. On stand-in engines (``sim_rig``): the outage and the
heal are the fleet's; a real engine replaced on the current weights is tests/test_fleet_engine_death.py's."""

from __future__ import annotations

import asyncio
import time

import pytest

from safetensors.torch import load_file

from fleet_helpers import assert_trajectory_exact, call, kill_pid, new_rid
from refit_helpers import perturbed



async def test_all_engines_killed_503_then_healed_and_the_rollout_continues_exactly(sim_rig, tiny_model_dir):
    rig = sim_rig
    # The current version is not the model's own weights, and no engine survives to copy it from:
    # the replacements can only load the copy the fleet keeps.
    base = load_file(str(tiny_model_dir / "model.safetensors"))
    report = await asyncio.to_thread(rig.trainer.refit, "outage-1", perturbed(base, seed=31), transport="object_store")
    assert report["ok"] and sorted(report["engines"]) == [0, 1]
    version = (await rig.view()).version
    checksums = await rig.checksums_by_slot()
    assert version == "outage-1" and len(set(checksums.values())) == 1
    rid = new_rid("outage")
    messages = [{"role": "user", "content": "before the outage"}]
    first = await call(rig.runner, rid, messages, seed=1, stream=False)
    assert "__error__" not in first

    for pid in (await rig.member_pids()).values():
        kill_pid(pid)
    t_kill = time.monotonic()
    messages += [{"role": "assistant", "content": first["message"]["content"]}, {"role": "user", "content": "after"}]
    outage_errors = []
    while True:  # what an agent sees meanwhile: 503 (never a 500), history untouched
        result = await call(rig.runner, rid, messages, seed=2, stream=False)
        if "__error__" not in result:
            break
        assert result["__error__"] == 503 and result["error"]["code"] in ("no_engine", "engine_lost"), result
        outage_errors.append(result["error"]["code"])
        assert (await rig.store.load(rid)).turn == 1
        assert time.monotonic() - t_kill < 300, "not healed"
        await asyncio.sleep(0.5)
    healed_s = time.monotonic() - t_kill
    print(f"outage: {len(outage_errors)} calls answered 503 ({sorted(set(outage_errors))}); "
          f"first successful call {healed_s:.1f}s after the kill")
    assert outage_errors, "the outage was not observed"
    await assert_trajectory_exact(rig.store, rid, [first, result])
    await rig.wait_serving(2, version=version)
    assert await rig.checksums_by_slot() == checksums  # both replacements loaded the current version
