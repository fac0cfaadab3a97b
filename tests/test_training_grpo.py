"""examples/grpo/train.py end to end on the real service (the tiny model), a few short steps: the
agents' multi-turn rollouts over HTTP (each group's first turn one call with n = G, its members read
back as the group), the trainer actor's recomputed logprobs on the service's ids,
one clipped-ratio step (with the TIS correction) and a refit per step while the next step's rollouts run. Checked: the ratio
on tokens of the trainer's own version is 1 up to float32 noise (the service's processed logprobs
under the same top-k), in every step; later steps train on tokens of the previous version (the
overlap); the version advances with each refit; metrics.csv has the columns an acceptance run
reads; the plot is written. The learning run itself: docs/training.md.
The service's original weights are restored (under a new label) at the end."""

from __future__ import annotations

import argparse
import asyncio
import csv
import math
import random

import torch

from serve_helpers import MODEL, load_example

REQUIRED = ["step", "reward_mean", "ratio_dev_e4_current", "ratio_dev_e4_stale", "kl_k3", "clip_rate", "entropy",
            "lag_mean", "lag_max", "refit_stall_s", "weight_version", "correction", "tis_clipped", "mis_masked",
            "icepop_masked"]


def _example():
    return load_example("examples/grpo/train.py", "grpo_train")


def test_grpo_steps_through_the_service_are_on_policy_and_refit_each_step(service, tiny_model_dir, tmp_path):
    from safetensors.torch import load_file

    from rollout_service.refit.client import TrainerClient
    from rollout_service.refit.controller import get_controller

    grpo = _example()
    controller = get_controller()
    trainer = TrainerClient(controller, timeout_s=120)
    before = trainer.stats()["weight_version"]
    args = argparse.Namespace(steps=3, prompts=2, group_size=3, max_tokens=6, top_k=64, temperature=1.0, sync=False,
                              lr=3e-3, clip_eps=0.2, correction="tis",
                              seed=0, frequent_ids=20_000, model=MODEL, out=str(tmp_path / "run"))
    try:
        rows = asyncio.run(grpo.train(args, service.url, controller, str(tiny_model_dir)))
        # --max-staleness 0: a refit lands between the group's first turn and its members' second
        # turns (every second turn waits for it), so each member is one version behind: refused,
        # dropped from the step, nothing stored; the group shows it stale.
        weights = load_file(str(tiny_model_dir / "model.safetensors"))
        kept, group = asyncio.run(_group_across_a_refit(grpo, service.url, trainer, weights, tmp_path.name[-6:]))
    finally:
        restore = trainer.refit(f"restored-{tmp_path.name[-6:]}", load_file(str(tiny_model_dir / "model.safetensors")),
                                transport="object_store")
        assert restore["ok"]
    assert kept == [] and group["size"] == 2 and group["states"]["stale"] == 2, group
    assert all(m["turns"] == 1 for m in group["members"]), group  # the refused turn stored nothing
    assert len(rows) == 3 and all(r["stale_dropped"] == 0 for r in rows)  # no bound: none dropped
    first = rows[0]
    assert first["tokens"] > 0 and first["tokens_stale"] == 0
    assert first["ratio_dev_e4_current"] < 0.1, first  # |ratio - 1| < 1e-5 on average: exact ids, processed logprobs
    versions = [r["weight_version"] for r in rows]
    assert len(set(versions)) == 3 and before not in versions
    for r in rows:
        assert math.isfinite(r["loss"]) and math.isfinite(r["kl_k3"]) and 0.0 <= r["reward_mean"] <= 1.0
        assert r["tokens_current"] + r["tokens_stale"] == r["tokens"]
        if r["tokens_current"]:  # after a refit too: the service serves exactly the trainer's weights
            assert r["ratio_dev_e4_current"] < 0.1, r
        assert r["correction"] == "tis" and all(0.0 <= r[k] <= 1.0 for k in ("tis_clipped", "mis_masked", "icepop_masked"))
        assert r["lag_max"] <= 1  # the next step's rollouts start before the refit: at most one version behind
    # Asynchronous: later steps trained on rollouts sampled (at least partly) by the previous version.
    assert any(r["tokens_stale"] for r in rows[1:])
    with open(tmp_path / "run" / "metrics.csv") as f:
        table = list(csv.DictReader(f))
    assert set(REQUIRED) <= set(table[0]) and [int(t["step"]) for t in table] == [0, 1, 2]
    assert (tmp_path / "run" / "curves.png").stat().st_size > 10_000
    assert torch.isfinite(torch.tensor([float(t["reward_mean"]) for t in table])).all()


async def _group_across_a_refit(grpo, base_url: str, trainer, weights, tag: str):
    """examples/grpo's one_group under --max-staleness 0 with a refit before the members' second
    turns; returns the trajectories it kept and the group's document."""
    import httpx

    args = argparse.Namespace(model=MODEL, max_tokens=4, temperature=1.0, top_k=64, group_size=2, max_staleness=0)
    refit, group_ids = [], []

    async def refit_before_second_turns(request):
        if "x-max-staleness" not in request.headers:
            group_ids.append(request.headers.get("x-rollout-id"))
            return
        if not refit:
            refit.append(asyncio.ensure_future(trainer.arefit(f"stale-{tag}", weights, transport="object_store")))
        assert (await refit[0])["ok"]

    async with httpx.AsyncClient(base_url=base_url, timeout=120,
                                 event_hooks={"request": [refit_before_second_turns]}) as client:
        kept = await grpo.one_group(client, "Task: describe a river.", args, random.Random(0))
        group = (await client.get(f"/v1/groups/{group_ids[0]}")).json()
    return kept, group


def test_the_naive_baseline_retokenizes_and_puts_the_reported_logprobs_on_by_position(tiny_tokenizer):
    """--baseline naive's rows: the final conversation re-rendered and re-tokenized; an answer sampled
    as a non-canonical split of its text gets its logprobs on the canonical tokens, by position."""
    grpo = _example()
    tok = tiny_tokenizer
    pieces = ["Hel", "lo", " wor", "ld"]  # how a sampler may have produced " Hello world"'s text
    sampled = [i for p in pieces for i in tok.encode(p, add_special_tokens=False)]
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"},
                {"role": "assistant", "content": "Hello world"}, {"role": "user", "content": "[tool] 2 words."},
                {"role": "assistant", "content": "ok"}]
    answers = [sampled + [im_end], tok.encode("ok", add_special_tokens=False) + [im_end]]
    record = {"naive": True, "messages": messages, "turns": [
        {"generation_token_ids": ids, "logprobs": [-0.1 * (j + 1) for j in range(len(ids))],
         "weight_versions": [{"version": "v1", "start": 0, "end": len(ids)}]} for ids in answers]}
    row = grpo.naive_row(record, tok)
    rendered = tok.encode(tok.apply_chat_template(messages, tokenize=False), add_special_tokens=False)
    assert row.input_ids == rendered
    first = row.turns[0]
    canonical = row.input_ids[first.gen_start:first.gen_end]
    assert canonical != sampled[: len(canonical)]  # the trainer's ids are not the ones sampled
    assert row.behaviour_logprobs[first.gen_start:first.gen_end] == record["turns"][0]["logprobs"][: len(canonical)]
    assert len(canonical) < len(sampled) + 1  # fewer canonical tokens: the tail of the reported logprobs is lost
    assert sum(row.loss_mask) == sum(t.gen_end - t.gen_start for t in row.turns)
    assert {row.versions[i] for i, m in enumerate(row.loss_mask) if m} == {"v1"}
    assert grpo.reward_of(record, 20_000) == sum(i < 20_000 for ids in answers for i in ids) / sum(map(len, answers))
