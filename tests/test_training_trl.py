"""TRL's GRPOTrainer as a client of the service (rollout_service.training.trl_rollouts,
examples/grpo/trl_train.py).

- A trajectory becomes TRL's rollout_func row exactly: prompt = the ids before the first generated
  one, completion = the rest (tool results included), the service's logprobs on generated ids, the
  environment mask, a version per generated id; an edited (forked) history is refused by name.
- Two TRL steps on the test session's service: TRL's own recompute of the sampled tokens is within
  float32 noise of the service's logprobs (its importance-sampling correction reads ~1), every step's
  rollouts were sampled by the weights TRL pushed before it, a refit follows each optimizer step,
  and the service serves the last one.
"""

from __future__ import annotations

import argparse
import math
import random

import pytest

from rollout_service.onpolicy.trajectory import trajectory_export
from rollout_service.training.rows import rows_from_trajectory
from rollout_service.training.trl_rollouts import ServiceWeightSync, attach, rollout_output, trl_rollout
from serve_helpers import load_example
from synthetic_rollouts import synthetic_rollout


def _trajectory(turns=(3,), seed=0) -> dict:
    _, state = synthetic_rollout(random.Random(seed), list(turns), weight_version="v1")
    state.rollout_id = f"r-{seed}"
    return trajectory_export(state)


def test_a_trajectory_is_one_row_of_trls_rollout_func_exactly():
    traj = _trajectory((3,))
    (row,) = rows_from_trajectory(traj)
    out = trl_rollout(traj)
    start = row.turns[0].gen_start
    seg = traj["segments"][0]
    assert out["prompt_ids"] + out["completion_ids"] == seg["token_ids"]
    assert len(out["prompt_ids"]) == start and start > 0
    assert out["env_mask"] == seg["loss_mask"][start:]
    assert 0 in out["env_mask"] and 1 in out["env_mask"]  # the tool results between turns are masked out
    assert out["logprobs"] == seg["logprobs"][start:]
    assert all((v is None) == (m == 0) for v, m in zip(out["weight_versions"], out["env_mask"]))
    batch = rollout_output([traj, _trajectory((2,), seed=1)], env_reward=[0.5, 0.25])
    assert batch["env_reward"] == [0.5, 0.25] and len(batch["completion_ids"]) == 2
    with pytest.raises(ValueError, match="2 values for 1 rollouts"):
        rollout_output([traj], env_reward=[1.0, 2.0])
    with pytest.raises(ValueError, match="2 segments"):
        trl_rollout(_trajectory((2, 1), seed=2))


def test_attach_refuses_a_trainer_without_a_rollout_func():
    class Trainer:
        rollout_func = None

    with pytest.raises(ValueError, match="rollout_func"):
        attach(Trainer(), ServiceWeightSync(None, dict, "x"))


def test_one_push_per_optimizer_step():
    """The callback after a step and TRL's hook before the next generation: one refit for that step."""
    class Client:
        def __init__(self):
            self.refits = []

        def refit(self, version, state_dict, transport):
            self.refits.append(version)
            return {"ok": True, "stall_s": 0.0}

    class State:
        global_step = 0
        is_world_process_zero = True

    class Trainer:
        rollout_func = object()
        state = State()
        callbacks: list = []

        def add_callback(self, cb):
            self.callbacks.append(cb)

    client, trainer = Client(), Trainer()
    sync = ServiceWeightSync(client, dict, "t")
    attach(trainer, sync)
    assert trainer.use_vllm and trainer.vllm_generation is sync and trainer._last_loaded_step == -1
    sync.sync_weights()  # TRL's hook before the first generation: the starting weights
    for step in (1, 2):
        trainer.state.global_step = step
        trainer.callbacks[0].on_step_end(None, trainer.state, None)  # after the optimizer step
        sync.sync_weights()  # TRL's hook before the next generation: nothing new
    assert client.refits == ["t-0", "t-1", "t-2"]


def _example():
    return load_example("examples/grpo/trl_train.py", "trl_train")


def test_trls_grpo_trainer_trains_through_the_service_on_its_exact_tokens(service, tiny_model_dir, tmp_path):
    from safetensors.torch import load_file

    from rollout_service.refit.client import TrainerClient
    from rollout_service.refit.controller import get_controller
    from serve_helpers import MODEL

    trl_train = _example()
    controller = get_controller()
    trainer = TrainerClient(controller, timeout_s=120)
    args = argparse.Namespace(steps=2, prompts=2, group_size=2, max_tokens=6, lr=5e-3, seed=0, frequent_ids=20_000,
                              model=MODEL, out=str(tmp_path / "run"), temperature=1.0, top_k=0, baseline=None)
    try:
        rows = trl_train.run(args, service.url, controller, str(tiny_model_dir))
        served = trainer.stats()["weight_version"]
    finally:
        restore = trainer.refit(f"restored-trl-{tmp_path.name[-6:]}", load_file(str(tiny_model_dir / "model.safetensors")),
                                transport="object_store")
        assert restore["ok"]
    assert len(rows) == 2
    for r in rows:
        print({k: r[k] for k in ("step", "reward_mean", "logp_diff_mean", "logp_diff_max", "is_ratio_min",
                                 "is_ratio_max", "weight_version")})
        assert 0.0 <= r["reward_mean"] <= 1.0 and math.isfinite(r["loss"])
        # TRL's recompute of every sampled token against the service's logprobs: float32 noise (its own
        # log-softmax over the 152k vocabulary: ~1e-5), and its importance-sampling ratio, a product over
        # each sequence's tokens in TRL's default sequence_mask mode, within 1e-3 of 1 (a re-tokenized
        # history or raw logprobs put it at 0)
        assert r["logp_diff_max"] < 1e-4 and abs(r["is_ratio_min"] - 1) < 1e-3 and abs(r["is_ratio_max"] - 1) < 1e-3
    versions = [r["weight_version"] for r in rows]
    assert len(set(versions)) == 2  # each step's rollouts sampled by the weights pushed before it
    # pushed: the starting weights, then after each optimizer step; the service serves the last
    assert served == f"{versions[0].rsplit('-', 1)[0]}-2"
    with open(tmp_path / "run" / "metrics.csv") as f:
        assert f.readline().strip().split(",")[:3] == ["step", "reward_mean", "logp_diff_mean"]
