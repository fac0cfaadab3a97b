"""routing.group_placement together on two real engines, through the turn runner: a GRPO group's
rollouts (the same first prompt, or the same X-Rollout-Group) start on one engine, so the shared
prompt is prefilled there; different groups use both engines; later turns follow each rollout's pin.
The routing rule itself (home engine, load margin, a home that leaves) is tested purely in
test_fleet_client_routing.py."""

from __future__ import annotations

import asyncio
import dataclasses

from fleet_helpers import run_events, turn_request


async def test_a_groups_rollouts_start_on_one_engine(fleet_rig, tiny_tokenizer):
    from rollout_service.fleet.client import connect
    from rollout_service.fleet.routing import Sticky
    from rollout_service.serve.turns import TurnRunner

    rig = fleet_rig
    cfg = rig.config.model_copy(deep=True)
    cfg.routing.group_placement = "together"
    client = await connect(rig.fleet, policy=Sticky())
    runner = TurnRunner(cfg, client, rig.store, tiny_tokenizer)
    try:
        async def first_turns(prompt: str, n: int, group: str | None = None) -> set[int]:
            rids = [f"grp-{abs(hash((prompt, group))) % 10**8}-{i}" for i in range(n)]
            reqs = [dataclasses.replace(turn_request(rid, [{"role": "user", "content": prompt}], seed=i,
                                                     stream=False, max_tokens=4), rollout_group=group)
                    for i, rid in enumerate(rids)]
            finals = await asyncio.gather(*(run_events(runner, r) for r in reqs))
            assert all("__error__" not in f[-1] for f in finals), finals
            return {client.pins[rid][0] for rid in rids}

        engines = set()
        for g in range(6):  # the same first prompt: one engine per group, though 4 run at once
            slots = await first_turns(f"Group {g}: name a colour.", 4)
            assert len(slots) == 1, (g, slots)
            engines |= slots
        assert engines == {0, 1}  # groups spread over both engines (6 groups: all on one is 1 in 32)
        # X-Rollout-Group names the group whatever the prompts say
        slots = set()
        for i in range(4):
            slots |= await first_turns(f"Different prompt {i}.", 1, group="shared-group")
        assert len(slots) == 1
    finally:
        client.stop_watching()
        client.close_channels()
