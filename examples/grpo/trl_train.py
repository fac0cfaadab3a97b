"""TRL's GRPOTrainer with rollout-service as its generation backend.

The same multi-turn, tool-using task and reward as ``train.py`` (its agents drive the service over
HTTP, one ``X-Rollout-Id`` per rollout), but the trainer is TRL's ``GRPOTrainer`` (trl 1.16, the
``train`` extra): its ``rollout_func`` runs the agents and hands TRL each rollout's exact token ids,
the service's processed logprobs and the mask of generated tokens
(``rollout_service.training.trl_rollouts``); TRL computes the group-relative advantages and its
loss, and before each generation after an optimizer step pushes its weights to the service through
``TrainerClient.refit`` (TRL's own vLLM weight-sync hook, pointed at the service). TRL's
importance-sampling correction uses the service's logprobs as the sampling policy and logs how far
its own recompute is from them (``sampling/sampling_logp_difference/*``: ~1e-5 here, TRL's own float32
log-softmax over the 152k vocabulary).

Synchronous, as TRL is: each step's rollouts are sampled by the weights the previous step produced.
TRL's logprobs are over the whole vocabulary at ``GRPOConfig.temperature``, so the agents sample at
temperature 1 without top-k.

    python examples/grpo/trl_train.py --steps 8 --out /tmp/trl-grpo          # starts its own service
    RAY_ADDRESS=auto python examples/grpo/trl_train.py --steps 8 --out /tmp/trl-grpo \\
        --base-url http://127.0.0.1:8000                                     # next to `rollout-service up`

Writes ``OUT/metrics.csv`` (one row per step: TRL's logged figures) and exits non-zero if training fails.
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import random
import sys
import uuid
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))
sys.path.insert(0, str(HERE))

from rollout_service.ops.runtime import apply_local_env  # noqa: E402

apply_local_env()

import httpx  # noqa: E402

from rollout_service.training.trl_rollouts import ServiceWeightSync, attach, rollout_output  # noqa: E402
from train import reward_of, rollout, service_for  # noqa: E402  (this folder's train.py: the task and its reward)

# TRL's log keys -> metrics.csv columns
COLUMNS = {"reward": "reward_mean", "sampling/sampling_logp_difference/mean": "logp_diff_mean",
           "sampling/sampling_logp_difference/max": "logp_diff_max",
           "sampling/importance_sampling_ratio/min": "is_ratio_min",
           "sampling/importance_sampling_ratio/mean": "is_ratio_mean",
           "sampling/importance_sampling_ratio/max": "is_ratio_max", "entropy": "entropy", "loss": "loss",
           # TRL counts only the side its clip binds on (train.py's clip_rate counts both), and
           # num_tokens is its running total of prompt + completion tokens
           "clip_ratio/region_mean": "clip_ratio_region", "num_tokens": "num_tokens_seen"}


async def collect(base_url: str, prompts: list[str], args, seed: int) -> list[dict]:
    rng = random.Random(seed)
    async with httpx.AsyncClient(base_url=base_url, timeout=300) as client:
        out = list(await asyncio.gather(*[rollout(client, p, args, random.Random(rng.random())) for p in prompts]))
    if any(t is None for t in out):  # TRL's rollout_func owes a completion for every prompt
        raise RuntimeError(f"{out.count(None)} of {len(out)} rollouts were refused by the service's staleness "
                           "bound (rollouts.max_staleness): this example cannot drop them")
    return out


def run(args, base_url: str, controller, model_path: str) -> list[dict]:
    """Train ``args.steps`` steps; returns one dict per step (the metrics.csv rows)."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from rollout_service.refit.client import TrainerClient

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    rng = random.Random(args.seed)
    prompts = [f"Task {i}: describe a {rng.choice(['river', 'city', 'tool', 'song'])}."
               for i in range(args.prompts * args.steps)]
    sampled_by: list[str] = []  # the version each generation (one per step here) was sampled by

    def rollout_func(batch: list[str], trainer) -> dict:
        trajectories = asyncio.run(collect(base_url, batch, args, seed=args.seed * 1000 + len(sampled_by)))
        sampled_by.append(sync.versions[-1])
        return rollout_output(trajectories, env_reward=[reward_of(t, args.frequent_ids) for t in trajectories])

    def env_reward(completions, env_reward, **kwargs) -> list[float]:
        return list(env_reward)

    config = GRPOConfig(output_dir=str(out / "trl"), use_cpu=True, bf16=False, gradient_checkpointing=False,
                        report_to="none", per_device_train_batch_size=args.prompts * args.group_size,
                        num_generations=args.group_size, max_steps=args.steps, logging_steps=1, save_strategy="no",
                        learning_rate=args.lr, temperature=1.0, beta=0.0, seed=args.seed, shuffle_dataset=False,
                        max_completion_length=4 * args.max_tokens + 64)
    trainer = GRPOTrainer(model=model, reward_funcs=env_reward, args=config, train_dataset=Dataset.from_dict(
        {"prompt": prompts}), processing_class=tokenizer, rollout_func=rollout_func)
    sync = ServiceWeightSync(TrainerClient(controller, timeout_s=120), lambda: trainer.model.state_dict(),
                             prefix=f"trl-{uuid.uuid4().hex[:6]}")
    attach(trainer, sync)
    trainer.train()

    rows = []
    logged = [h for h in trainer.state.log_history if "reward" in h]
    for step, h in enumerate(logged):
        version = sampled_by[step] if step < len(sampled_by) else None
        report = sync.reports[sync.versions.index(version)] if version in sync.versions else {}
        row = {"step": step, **{col: h.get(key) for key, col in COLUMNS.items()},
               "weight_version": version, "refit_stall_s": report.get("stall_s")}
        rows.append(row)
    with open(out / "metrics.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else ["step"])
        writer.writeheader()
        writer.writerows(rows)
    for r in rows:
        print(f"step {r['step']:3d}  reward {r['reward_mean']:.3f}  |logp diff| mean {r['logp_diff_mean']:.2e} "
              f"max {r['logp_diff_max']:.2e}  IS ratio {r['is_ratio_min']:.6f}..{r['is_ratio_max']:.6f}  "
              f"version {r['weight_version']}", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--out", required=True)
    p.add_argument("--base-url", help="a running service (its Ray cluster joined with RAY_ADDRESS=auto); default: "
                   "start one here on the tiny model")
    p.add_argument("--instance", default="rollout-service", help="service.instance_name of the running service")
    p.add_argument("--model", default="tiny-qwen3", help="the served model name")
    p.add_argument("--prompts", type=int, default=2)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=12)
    p.add_argument("--frequent-ids", type=int, default=20_000)
    p.add_argument("--lr", type=float, default=5e-3)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    args.temperature, args.top_k, args.baseline = 1.0, 0, None  # TRL's logprobs: the whole vocabulary at T 1

    try:
        with service_for(args) as (base_url, controller, config):  # temperature 1, no top-k: raw = processed
            rows = run(args, base_url, controller, config.engine.resolved_model())
        print(f"reward {rows[0]['reward_mean']:.3f} -> {rows[-1]['reward_mean']:.3f} over {len(rows)} steps; "
              f"{args.out}/metrics.csv")
        return 0
    except Exception as exc:  # noqa: BLE001 - a failed run: say it, exit non-zero
        print(f"training failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
