"""rollout_service.training: trajectories into training rows, batches, GRPO advantages, diagnostics.

Rows are checked on trajectories exported by the service's own exporter (multi-segment, a refit
inside a turn, a constrained turn) and on a real trajectory from the service on the tiny model,
whose recomputed float32 logprobs must match the service's within 1e-5 on every trained token."""

from __future__ import annotations

import math
import random
import uuid

import httpx
import pytest

from rollout_service.onpolicy.trajectory import trajectory_export
from rollout_service.onpolicy.types import WeightSpan
from rollout_service.training import collate, group_advantages, rows_from_trajectory, step_diagnostics
from synthetic_rollouts import synthetic_rollout


def _trajectory(turns_per_segment=(2, 1), seed=0, refit_in_turn=None, constrained_turn=None, kept_kv=False) -> dict:
    _, state = synthetic_rollout(random.Random(seed), list(turns_per_segment), weight_version="v1")
    state.rollout_id = "r-1"
    if refit_in_turn is not None:  # a refit landed in the middle of this turn's generation
        for seg in state.segments:
            for t in seg.turns:
                if t.turn == refit_in_turn:
                    mid = (t.gen_start + t.gen_end) // 2
                    t.weight_versions = [WeightSpan("v1", t.gen_start, mid),
                                         WeightSpan("v2", mid, t.gen_end, "v1" if kept_kv else None)]
                elif t.turn > refit_in_turn:
                    t.weight_versions = [WeightSpan("v2", t.gen_start, t.gen_end)]
    if constrained_turn is not None:
        for seg in state.segments:
            for t in seg.turns:
                t.constrained = t.turn == constrained_turn
    return trajectory_export(state)


def test_rows_are_the_segments_exactly_with_a_version_per_generated_token():
    traj = _trajectory((2, 1), refit_in_turn=2)
    rows = rows_from_trajectory(traj)
    assert [r.segment for r in rows] == [0, 1]
    for row, seg in zip(rows, traj["segments"]):
        assert row.input_ids == seg["token_ids"] and row.loss_mask == seg["loss_mask"]
        assert row.behaviour_logprobs == seg["logprobs"]
        assert len(row.versions) == len(row)
        for i, m in enumerate(seg["loss_mask"]):
            assert (row.versions[i] is None) == (not m)
        assert [t.turn for t in row.turns] == [t["turn"] for t in seg["turns"]]
    first, second = rows
    t2 = first.turns[1]
    mid = (t2.gen_start + t2.gen_end) // 2
    assert first.versions[t2.gen_start:mid] == ["v1"] * (mid - t2.gen_start)
    assert first.versions[mid:t2.gen_end] == ["v2"] * (t2.gen_end - mid)
    assert first.version_set() == {"v1", "v2"} and second.version_set() == {"v2"}


def test_a_constrained_turn_is_marked_and_left_out_of_the_loss_on_request():
    traj = _trajectory((3,), constrained_turn=2)
    (row,) = rows_from_trajectory(traj)
    t = row.turns[1]
    assert t.constrained and row.constrained[t.gen_start:t.gen_end] == [1] * (t.gen_end - t.gen_start)
    assert sum(row.constrained) == t.gen_end - t.gen_start
    (masked,) = rows_from_trajectory(traj, include_constrained=False)
    assert masked.loss_mask[t.gen_start:t.gen_end] == [0] * (t.gen_end - t.gen_start)
    assert masked.num_trained == row.num_trained - (t.gen_end - t.gen_start)


@pytest.mark.parametrize("breakage, message", [
    (lambda s: s["weight_versions"].pop(), "without a weight version"),
    (lambda s: s["weight_versions"].append(dict(s["weight_versions"][0])), "overlap"),
    (lambda s: s["logprobs"].pop(), "differ in length"),
    (lambda s: s["weight_versions"][0].update(end=len(s["token_ids"]) + 5), "outside the segment"),
    (lambda s: s["turns"][0].update(gen_start=-3), "not ordered"),
])
def test_an_inconsistent_trajectory_is_refused(breakage, message):
    traj = _trajectory((2,))
    breakage(traj["segments"][0])
    with pytest.raises(ValueError, match=message):
        rows_from_trajectory(traj)


def test_a_groups_document_and_the_rows_of_its_finished_members():
    from rollout_service.onpolicy.groups import call_entry, group_document
    from rollout_service.training import rows_from_group

    states = {}
    for j, seed in ((0, 1), (1, 2), (2, 3), (10, 4)):
        _, state = synthetic_rollout(random.Random(seed), [1], weight_version=f"v{j}")
        state.rollout_id = f"g/{j}"
        states[f"g/{j}"] = state
    states["g/2"].status, states["g/2"].status_reason = "aborted", "dynamic sampling"
    states["g/3"] = None  # its first call failed: nothing stored
    calls = {"g/10": "finished", "g/2": "finished", "g/1": "running", "g/0": "finished", "g/3": "failed"}
    doc = group_document("g", calls, states, trajectories=True)
    assert [m["id"] for m in doc["members"]] == ["g/0", "g/1", "g/2", "g/3", "g/10"]  # numeric member order
    assert [m["state"] for m in doc["members"]] == ["finished", "running", "aborted", "failed", "finished"]
    assert doc["members"][2]["status_reason"] == "dynamic sampling"
    assert doc["members"][0]["first_weight_version"] == doc["members"][0]["last_weight_version"] == "v0"
    assert doc["members"][3] == {"id": "g/3", "state": "failed", "turns": 0, "first_weight_version": None,
                                 "last_weight_version": None, "call_recorded_at": None, "trajectory": None}
    stamped = group_document("g", {"g/0": call_entry("running", now_s=12.5)}, {"g/0": None})
    assert stamped["members"][0]["state"] == "running" and stamped["members"][0]["call_recorded_at"] == 12.5
    assert doc["size"] == 5 and doc["states"]["finished"] == 2 and doc["states"]["missing"] == 0
    rows = rows_from_group(doc)
    assert [r.rollout_id for r in rows] == ["g/0", "g/10"]
    assert rows[0].input_ids == rows_from_trajectory(trajectory_export(states["g/0"]))[0].input_ids
    # finished, then expired: missing, no rows; a group read without trajectories cannot give rows
    gone = group_document("g", {"g/0": "finished"}, {"g/0": None})
    assert gone["members"][0]["state"] == "missing" and rows_from_group(gone) == []
    with pytest.raises(ValueError, match="trajectories=true"):
        rows_from_group(group_document("g", calls, states))


def test_collate_pads_right_and_puts_each_rows_advantage_on_its_trained_tokens():
    rows = rows_from_trajectory(_trajectory((1, 2), seed=3))
    batch = collate(rows, pad_id=0, advantages=[0.5, -1.0])
    width = max(len(r) for r in rows)
    for k, r in enumerate(rows):
        assert len(batch.input_ids[k]) == width and batch.input_ids[k][:len(r)] == r.input_ids
        assert batch.attention_mask[k] == [1] * len(r) + [0] * (width - len(r))
        assert batch.advantages[k] == [([0.5, -1.0][k] if m else 0.0) for m in r.loss_mask] + [0.0] * (width - len(r))
    tensors = batch.to_torch()
    assert tuple(tensors["input_ids"].shape) == (2, width)
    with pytest.raises(ValueError, match="max_len"):
        collate(rows, pad_id=0, max_len=width - 1)


def test_group_advantages_by_hand():
    adv = group_advantages([1.0, 0.0, 0.0, 1.0])
    assert adv == pytest.approx([1.0, -1.0, -1.0, 1.0], abs=1e-5)
    assert group_advantages([0.3, 0.3, 0.3]) == [0.0, 0.0, 0.0]
    assert group_advantages([1.0, 0.0], scale="none") == [0.5, -0.5]


def test_diagnostics_by_hand():
    traj = _trajectory((2,), refit_in_turn=2)
    (row,) = rows_from_trajectory(traj)
    trained = [i for i, m in enumerate(row.loss_mask) if m]
    current = [i for i in trained if row.versions[i] == "v2"]
    stale = [i for i in trained if row.versions[i] == "v1"]
    # The trainer (on v2) agrees exactly on v2's tokens, is off by 1e-3 in log space on v1's.
    before = list(row.behaviour_logprobs)
    for i in stale:
        before[i] += 1e-3
    after = [lp + (0.01 if m else 0.0) for lp, m in zip(before, row.loss_mask)]
    d = step_diagnostics([row], [before], trainer_version="v2", version_order=["v0", "v1", "v2"],
                         new_logprobs=[after], entropies=[[2.0] * len(row)], clip_eps=0.2)
    assert d.tokens == len(trained) and d.tokens_current == len(current) and d.tokens_stale == len(stale)
    assert d.ratio_dev_e4_current == 0.0
    assert d.ratio_dev_e4_stale == pytest.approx((math.exp(1e-3) - 1) * 1e4)
    assert d.kl_k3 == pytest.approx(math.exp(0.01) - 1 - 0.01)
    assert d.clip_rate == 0.0 and d.entropy == 2.0
    assert d.lag_mean == pytest.approx(len(stale) / len(trained)) and d.lag_max == 1
    with pytest.raises(ValueError, match="version_order"):
        step_diagnostics([row], [before], trainer_version="v2", version_order=["v2"])


def test_tokens_sampled_over_kept_kv_are_their_own_class():
    """A refit inside turn 2 that kept the KV: its v2 tokens attended to v1's KV (kv_version v1),
    so they are neither current nor stale but mixed; the later turn's v2 tokens are pure."""
    traj = _trajectory((2, 1), refit_in_turn=2, kept_kv=True)
    spans = [w for seg in traj["segments"] for w in seg["weight_versions"]]
    assert all(set(w) == {"version", "start", "end", "kv_version"} for w in spans)
    assert [(w["version"], w["kv_version"]) for w in spans].count(("v2", "v1")) == 1
    rows = rows_from_trajectory(traj)
    mixed = [(k, i) for k, r in enumerate(rows) for i, m in enumerate(r.loss_mask)
             if m and r.versions[i] == "v2" and r.kv_versions[i] == "v1"]
    pure = [(k, i) for k, r in enumerate(rows) for i, m in enumerate(r.loss_mask)
            if m and r.versions[i] == "v2" and r.kv_versions[i] == "v2"]
    assert mixed and pure
    before = [list(r.behaviour_logprobs) for r in rows]
    for k, i in mixed:
        before[k][i] += 2e-3
    d = step_diagnostics(rows, before, trainer_version="v2", version_order=["v1", "v2"])
    assert (d.tokens_current, d.tokens_mixed) == (len(pure), len(mixed))
    assert d.tokens == d.tokens_current + d.tokens_stale + d.tokens_mixed
    assert d.ratio_dev_e4_current == 0.0 and d.ratio_dev_e4_mixed == pytest.approx((math.exp(2e-3) - 1) * 1e4)
    # Without kv_versions (rows built by hand): every token counts by its version alone.
    for r in rows:
        r.kv_versions = []
    assert step_diagnostics(rows, before, trainer_version="v2", version_order=["v1", "v2"]).tokens_mixed == 0


def test_a_real_trajectorys_rows_match_a_float32_forward_of_the_same_weights(service, tiny_model_dir):
    """Two turns on the service (the tiny model), the trajectory turned into rows, the model's own
    float32 forward on the row's ids: every trained token's logprob within 1e-5 of the service's."""
    import torch

    from engine_helpers import load_hf_model
    from rollout_service.training.diagnostics import token_logprobs
    from serve_helpers import MODEL

    rid = f"train-{uuid.uuid4().hex[:8]}"
    messages = [{"role": "user", "content": "count the apples"}]
    with httpx.Client(base_url=service.url, timeout=300) as client:
        for turn in range(2):
            r = client.post("/v1/chat/completions", headers={"X-Rollout-Id": rid}, json={
                "model": MODEL, "messages": messages, "max_tokens": 24, "seed": 5 + turn, "temperature": 1.0})
            assert r.status_code == 200, r.text
            msg = r.json()["choices"][0]["message"]
            messages += [{"role": "assistant", "content": msg["content"] or ""},
                         {"role": "user", "content": "3 apples"}]
        traj = client.get(f"/v1/rollouts/{rid}").json()
    (row,) = rows_from_trajectory(traj)
    assert len(row.turns) == 2 and row.num_trained > 0
    model = load_hf_model(str(tiny_model_dir))
    with torch.no_grad():
        logits = model(torch.tensor([row.input_ids])).logits[0]
    lps, entropies = token_logprobs(logits, row.input_ids)
    worst = max(abs(lps[i] - row.behaviour_logprobs[i]) for i, m in enumerate(row.loss_mask) if m)
    (version,) = row.version_set()
    d = step_diagnostics([row], [lps], trainer_version=version, version_order=[version], entropies=[entropies])
    print(f"{row.num_trained} trained tokens: max |logprob - service| {worst:.2e}, "
          f"ratio deviation {d.ratio_dev_e4_current:.3f}e-4, entropy {d.entropy:.2f}")
    assert worst < 1e-5 and d.ratio_dev_e4_current < 0.1 and d.tokens_stale == 0 and d.lag_max == 0


def test_a_rollout_across_a_refit_carries_both_versions_and_each_token_matches_its_own_weights(service,
                                                                                               tiny_model_dir):
    """Turn 1 on weights A, a refit to B, turn 2 on B: the rollout's row carries both versions, each
    generated token matches a float32 forward of the weights that sampled it (within 1e-5), and the
    diagnostics count turn 1's tokens as stale for a trainer holding B."""
    import torch
    from safetensors.torch import load_file

    from engine_helpers import load_hf_model
    from refit_helpers import perturbed
    from rollout_service.refit.client import TrainerClient
    from rollout_service.refit.controller import get_controller
    from rollout_service.training.diagnostics import token_logprobs
    from serve_helpers import MODEL

    trainer = TrainerClient(get_controller(), timeout_s=120)
    tag = uuid.uuid4().hex[:6]
    base = load_file(str(tiny_model_dir / "model.safetensors"))
    weights = {f"A-{tag}": base, f"B-{tag}": perturbed(base, seed=17)}
    rid = f"train-refit-{tag}"
    messages = [{"role": "user", "content": "count the pears"}]
    try:
        with httpx.Client(base_url=service.url, timeout=300) as client:
            for turn, version in enumerate(weights):
                assert trainer.refit(version, weights[version], transport="object_store")["ok"]
                r = client.post("/v1/chat/completions", headers={"X-Rollout-Id": rid}, json={
                    "model": MODEL, "messages": messages, "max_tokens": 16, "seed": 9 + turn, "temperature": 1.0})
                assert r.status_code == 200, r.text
                messages += [{"role": "assistant", "content": r.json()["choices"][0]["message"]["content"] or ""},
                             {"role": "user", "content": "2 pears"}]
            traj = client.get(f"/v1/rollouts/{rid}").json()
    finally:
        assert trainer.refit(f"restored-{tag}", base, transport="object_store")["ok"]
    (row,) = rows_from_trajectory(traj)
    assert row.version_set() == set(weights) and len(row.turns) == 2
    model = load_hf_model(str(tiny_model_dir))
    per_version = {}
    for version, state in weights.items():
        model.load_state_dict(state)
        with torch.no_grad():
            per_version[version] = token_logprobs(model(torch.tensor([row.input_ids])).logits[0], row.input_ids)[0]
    # each generated token under the weights that sampled it
    worst = max(abs(per_version[row.versions[i]][i] - row.behaviour_logprobs[i])
                for i, m in enumerate(row.loss_mask) if m)
    b = f"B-{tag}"
    d = step_diagnostics([row], [per_version[b]], trainer_version=b, version_order=list(weights))
    print(f"versions {sorted(row.version_set())}: max |own-weights logprob - service| {worst:.2e}; trainer on B: "
          f"{d.tokens_current} current (dev {d.ratio_dev_e4_current:.3f}e-4), {d.tokens_stale} stale "
          f"(dev {d.ratio_dev_e4_stale:.0f}e-4), lag max {d.lag_max}")
    assert worst < 1e-5
    t1, t2 = row.turns
    assert d.tokens_stale == t1.gen_end - t1.gen_start and d.tokens_current == t2.gen_end - t2.gen_start
    assert d.ratio_dev_e4_current < 0.1 and d.ratio_dev_e4_stale > 10 and d.lag_max == 1


def test_the_training_module_imports_without_vllm_ray_or_torch():
    import subprocess
    import sys

    code = ("import sys, rollout_service.training; "
            "print(sorted(m for m in ('ray', 'vllm', 'torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_compare_draws_runs_on_one_plot(tmp_path, capsys):
    """examples/grpo/compare.py: each run's metrics.csv (as train.py writes it) on one plot, a table."""
    import csv
    import importlib.util
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("grpo_compare", root / "examples" / "grpo" / "compare.py")
    compare = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(compare)
    runs = []
    for label, dev in (("ours", 0.004), ("raw", 9000.0)):
        d = tmp_path / label
        d.mkdir()
        with open(d / "metrics.csv", "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=["step", "reward_mean", "ratio_dev_e4_current", "ratio_dev_e4_stale",
                                              "clip_rate", "kl_k3", "entropy"])
            w.writeheader()
            for step in range(3):
                w.writerow({"step": step, "reward_mean": 0.1 + 0.05 * step, "ratio_dev_e4_current": dev,
                            "ratio_dev_e4_stale": "nan", "clip_rate": 0.0, "kl_k3": 0.1, "entropy": 3.0})
        runs.append(f"{label}={d}")
    assert compare.main([*runs, "--out", str(tmp_path / "c.png")]) == 0
    assert (tmp_path / "c.png").stat().st_size > 10_000
    out = capsys.readouterr().out
    assert "| ours | 3 | 0.100 → 0.200 | 0.004 | 0.000 |" in out and "| raw | 3 |" in out
