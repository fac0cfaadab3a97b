"""GRPO through the service: a policy that learns from its own multi-turn rollouts, asynchronously.

A trainer Ray actor (torch, float32, the tiny model on CPU) and agents that drive a multi-turn,
tool-using task over the service's HTTP API. Each rollout (its own ``X-Rollout-Id``):

1. the model answers the task (turn 1);
2. a tool inspects that answer and its result comes back as the next message (the way text-parsed
   tool harnesses return a tool's output to a model that cannot emit structured tool calls);
3. the model answers again (turn 2).

The reward is verifiable from the token ids alone: the share of the rollout's generated tokens that
are *frequent* tokens of the Qwen BPE (ids below ``--frequent-ids``, 20,000 by default: the
earliest merges, short common words and pieces), in [0, 1]. A random-weight model samples them at
about their share of the vocabulary (~13 %); the task is to say more of them.

Per step: G rollouts for each of P prompts (GRPO groups: each group's first turn is one call with
``n = G`` under the group's rollout id, its members' second turns their own calls; ``--separate-calls``
starts each rollout with a call of its own instead), the trajectory of each read back from the
service (exact ids, the behaviour logprob and weight version of every token), group-relative
advantages, one clipped-ratio optimizer step against the service's processed logprobs, then a refit
through ``TrainerClient`` — while the next step's rollouts are already running (asynchronous RL,
staleness bounded by one step; the per-token versions choose each token's behaviour logprob and
show which tokens were stale). The diagnostics of every step go to ``OUT/metrics.csv`` and
``OUT/curves.png`` (docs/training.md).

    python examples/grpo/train.py --steps 30 --out /tmp/grpo            # starts its own service
    RAY_ADDRESS=auto python examples/grpo/train.py --steps 30 --out /tmp/grpo \\
        --base-url http://127.0.0.1:8000                                  # next to `rollout-service up`

Exits non-zero if a step fails.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import csv
import math
import random
import signal
import sys
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from rollout_service.ops.runtime import apply_local_env  # noqa: E402

apply_local_env()

import httpx  # noqa: E402
import ray  # noqa: E402

from rollout_service.training import (  # noqa: E402
    correction_shares, correction_weights, group_advantages, rows_from_trajectory, step_diagnostics)

# weight_version: the version the step's refit published; trainer_version: the one the step's
# diagnostics compare against (the trainer's weights before the step).
COLUMNS = ["step", "reward_mean", "ratio_dev_e4_current", "ratio_dev_e4_stale", "ratio_dev_e4_mixed", "kl_k3", "clip_rate", "entropy",
           "lag_mean", "lag_max", "refit_stall_s", "weight_version", "trainer_version", "tokens", "tokens_current",
           "tokens_stale", "tokens_mixed", "loss", "wall_s", "correction", "tis_clipped", "mis_masked", "icepop_masked",
           "stale_dropped"]
SYSTEM = "You are a helpful assistant. Answer briefly."


@ray.remote(num_cpus=0)
class GRPOTrainer:
    """Holds the policy (float32), computes its logprobs on the service's exact ids, takes one
    clipped-ratio step per batch and refits the service with the new weights."""

    def __init__(self, model_path: str, controller, lr: float, clip_eps: float, seed: int, top_k: int,
                 temperature: float = 1.0, correction: str | None = None):
        import torch
        from transformers import AutoModelForCausalLM

        from rollout_service.refit.client import TrainerClient

        torch.manual_seed(seed)
        torch.set_num_threads(2)
        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        self.model.train()
        self.opt = torch.optim.Adam(self.model.parameters(), lr=lr)
        self.clip_eps = clip_eps
        self.top_k = top_k
        self.temperature = temperature
        self.correction = correction  # None: the ratio against the behaviour logprobs; tis | mis | icepop: decoupled
        self.client = TrainerClient(controller, timeout_s=120)
        self.model_path = model_path
        self.tokenizer = None  # --baseline naive: the trainer re-renders and re-tokenizes the conversations
        self.prefix = f"grpo-{uuid.uuid4().hex[:6]}"
        # The service serves exactly the trainer's starting weights (it may have been refitted before).
        init = f"{self.prefix}-init"
        self.client.refit(init, {k: v.detach() for k, v in self.model.state_dict().items()}, transport="object_store")
        self.versions = [init]

    def version(self) -> str:
        return self.versions[-1]

    def _logprobs(self, ids: list[int], grad: bool):
        """Per position i (0 at position 0): the logprob of ids[i] given ids[:i] under the distribution
        the engine sampled from — the agents' temperature and top-k cut (the service's logprobs are
        *processed* ones: after temperature and top-k, renormalized over the kept tokens) — and, without grad,
        the logprob under the whole softmax (for the KL: a step can move a token out of the top k)
        and the sampling distribution's entropy."""
        torch = self.torch
        target = torch.tensor(ids[1:]).unsqueeze(-1)
        zero = torch.zeros(1)
        self.model.train(grad)
        with torch.set_grad_enabled(grad):
            logits = self.model(torch.tensor([ids])).logits[0, :-1].float()
            full = None if grad else torch.cat([zero, torch.log_softmax(logits, -1).gather(-1, target).squeeze(-1)])
            logits = logits / self.temperature
            if self.top_k > 0:
                kth = logits.detach().topk(self.top_k, dim=-1).values[:, -1:]
                logits = logits.masked_fill(logits.detach() < kth, float("-inf"))
            logp = torch.log_softmax(logits, dim=-1)
            picked = torch.cat([zero, logp.gather(-1, target).squeeze(-1)])
            if grad:
                return picked, None, None
            p = logp.exp()
            entropy = torch.cat([zero, -(p * logp.masked_fill(p == 0, 0.0)).sum(-1)])
        return picked, full, entropy

    def _rows(self, record: dict) -> list:
        if not record.get("naive"):
            return rows_from_trajectory(record, include_constrained=False)
        if self.tokenizer is None:
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        return [naive_row(record, self.tokenizer)]

    def step(self, step: int, trajectories: list[dict], advantages: list[float]) -> dict:
        torch = self.torch
        rows, row_adv = [], []
        for traj, adv in zip(trajectories, advantages):
            for row in self._rows(traj):
                rows.append(row)
                row_adv.append(adv)
        before, before_full, entropies = [], [], []
        for row in rows:  # the trainer's own logprobs, before the step: the ratio's numerator at its start
            lp, full, ent = self._logprobs(row.input_ids, grad=False)
            before.append(lp.tolist())
            before_full.append(full.tolist())
            entropies.append(ent.tolist())
        total = sum(r.num_trained for r in rows) or 1
        # With a correction the ratio is taken against the trainer's own logprobs before the step (the
        # proximal policy) and the mismatch to the behaviour logprobs goes into a per-token weight
        # (truncated, or masked: rollout_service.training.corrections); without one, against the
        # behaviour logprobs as they are.
        weights = correction_weights(rows, before, self.correction).weights if self.correction else None
        self.opt.zero_grad()
        loss_sum = 0.0
        for k, (row, adv) in enumerate(zip(rows, row_adv)):
            lp, _, _ = self._logprobs(row.input_ids, grad=True)
            mask = torch.tensor(row.loss_mask, dtype=torch.float32)
            if weights is None:
                ratio = torch.exp(lp - torch.tensor(row.behaviour_logprobs, dtype=torch.float32))
            else:
                # A token the trainer's top-k cut (its logprob -inf) has weight 0: its ratio is never
                # formed (exp(-inf + inf) would be NaN, and NaN x 0 is still NaN).
                w = torch.tensor(weights[k], dtype=torch.float32)
                prox = torch.tensor(before[k], dtype=torch.float32)
                ratio = torch.exp(torch.where(w > 0, lp - torch.where(w > 0, prox, torch.zeros_like(prox)),
                                              torch.zeros_like(lp)))
                mask = mask * w
            clipped = torch.clamp(ratio, 1 - self.clip_eps, 1 + self.clip_eps)
            loss = -(torch.minimum(ratio * adv, clipped * adv) * mask).sum() / total
            loss.backward()
            loss_sum += float(loss)
        self.opt.step()
        after_full = [self._logprobs(r.input_ids, grad=False)[1].tolist() for r in rows]
        diag = step_diagnostics(rows, before, trainer_version=self.versions[-1], version_order=self.versions,
                                entropies=entropies, clip_eps=self.clip_eps)
        kl = step_diagnostics(rows, before_full, trainer_version=self.versions[-1], version_order=self.versions,
                              new_logprobs=after_full).kl_k3  # of the whole softmax
        trained_on, version = self.versions[-1], f"{self.prefix}-{step}"
        report = self.client.refit(version, {k: v.detach() for k, v in self.model.state_dict().items()},
                                   transport="object_store")
        self.versions.append(version)
        return {**diag.to_dict(), **correction_shares(rows, before), "correction": self.correction or "none",
                "kl_k3": kl, "loss": loss_sum, "trainer_version": trained_on, "refit_stall_s": report["stall_s"], "weight_version": version}


def reward_of(trajectory: dict, frequent_ids: int) -> float:
    if trajectory.get("naive"):  # the ids the engine sampled, as each answer reported them
        ids = [i for turn in trajectory["turns"] for i in turn["generation_token_ids"]]
    else:
        ids = [i for seg in trajectory["segments"] for i, m in zip(seg["token_ids"], seg["loss_mask"]) if m]
    return sum(1 for i in ids if i < frequent_ids) / len(ids) if ids else 0.0


def naive_row(record: dict, tokenizer):
    """What a naive stack trains on: the final conversation re-rendered by the chat template and
    re-tokenized; each assistant message's tokens (found by rendering the conversation up to it) get
    the logprobs the engine reported for that answer, position by position, as far as both go (a
    re-tokenization that changed the count shifts them, and the tail goes untrained)."""
    from rollout_service.training import TrainingRow, TurnBounds

    messages = record["messages"]

    def ids_of(upto: int, generation_prompt: bool) -> list[int]:
        text = tokenizer.apply_chat_template(messages[:upto], tokenize=False, add_generation_prompt=generation_prompt)
        return tokenizer.encode(text, add_special_tokens=False)

    ids = ids_of(len(messages), False)
    mask, behaviour, versions, bounds = [0] * len(ids), [0.0] * len(ids), [None] * len(ids), []
    answers = [k for k, m in enumerate(messages) if m["role"] == "assistant"]
    if len(answers) != len(record["turns"]):
        raise ValueError(f"{len(answers)} assistant messages but {len(record['turns'])} recorded answers")
    for k, turn in zip(answers, record["turns"]):
        start, end = len(ids_of(k, True)), min(len(ids_of(k + 1, False)), len(ids))
        by_position: list[str | None] = [None] * len(turn["logprobs"])
        for span in turn["weight_versions"]:
            for j in range(max(0, span["start"]), min(span["end"], len(by_position))):
                by_position[j] = span["version"]
        if None in by_position:
            raise ValueError(f"answer {len(bounds)}: generated tokens without a weight version")
        n = max(0, min(end - start, len(turn["logprobs"])))
        for j in range(n):
            mask[start + j], behaviour[start + j], versions[start + j] = 1, turn["logprobs"][j], by_position[j]
        bounds.append(TurnBounds(turn=len(bounds), prompt_start=0, gen_start=start, gen_end=start + n,
                                 finish_reason="stop"))
    return TrainingRow(rollout_id=None, segment=0, input_ids=ids, loss_mask=mask, behaviour_logprobs=behaviour,
                       versions=versions, constrained=[0] * len(ids), turns=bounds)


async def rollout(client: httpx.AsyncClient, prompt: str, args, rng: random.Random) -> dict:
    """One multi-turn, tool-using rollout; returns its trajectory as the service stored it. Naive
    (``--baseline naive``): no rollout id and no echoed ids, so the service renders every prompt from
    the messages' text (the history re-templated and re-tokenized, as a plain OpenAI server does);
    returns the final messages and each answer's sampled ids, logprobs and weight versions."""
    naive = getattr(args, "baseline", None) == "naive"
    rid = f"grpo-{uuid.uuid4().hex[:12]}"
    headers = {} if naive else {"X-Rollout-Id": rid}
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": prompt}]
    turns = []
    for turn in range(2):
        r = await client.post("/v1/chat/completions", headers={**headers, **({} if naive else staleness_header(args, turn))}, json={
            "model": args.model, "messages": messages, "max_tokens": args.max_tokens, "temperature": args.temperature,
            "seed": rng.randrange(2**31), **({"top_k": args.top_k} if args.top_k > 0 else {})})
        if stale(r):
            return None
        if r.status_code != 200:
            raise RuntimeError(f"{rid} turn {turn + 1}: {r.status_code} {r.text[:300]}")
        message = r.json()["choices"][0]["message"]
        answer = message["content"] or ""
        turns.append({"generation_token_ids": message["generation_token_ids"],
                      "logprobs": message["generation_log_probs"], "weight_versions": message["weight_versions"]})
        messages.append({"role": "assistant", "content": answer})
        if turn == 0:  # the tool: inspects the answer; its output is the next message
            messages.append({"role": "user", "content": f"[tool: word_count] {len(answer.split())} words. Continue."})
    if naive:
        return {"naive": True, "messages": messages, "turns": turns}
    r = await client.get(f"/v1/rollouts/{rid}")
    r.raise_for_status()
    return r.json()


def staleness_header(args, turn: int) -> dict[str, str]:
    """``--max-staleness K``: a rollout's later turns are admitted only while its oldest token is at
    most K versions behind the engines' (409 ``rollout_stale`` beyond it; docs/data-plane.md)."""
    bound = getattr(args, "max_staleness", None)
    return {"X-Max-Staleness": str(bound)} if bound is not None and turn > 0 else {}


def stale(r: httpx.Response) -> bool:
    """The turn was refused by the staleness bound: the rollout is dropped (nothing was generated)."""
    if r.status_code != 409:
        return False
    try:
        error = r.json().get("error")
    except ValueError:
        return False
    return isinstance(error, dict) and error.get("code") == "rollout_stale"


async def one_group(client: httpx.AsyncClient, prompt: str, args, rng: random.Random) -> list[dict]:
    """One GRPO group as the service forms it: the first turn of all G rollouts in one call (``n = G``
    under the group's rollout id R: rollouts R/0 .. R/{G-1}, one prompt), then each member's second
    turn on its own; the members' trajectories read back as the group (``GET /v1/groups/R``). A
    member refused by ``--max-staleness`` is left out (the group's state shows it ``stale``)."""
    rid = f"grpo-{uuid.uuid4().hex[:12]}"
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": prompt}]
    sampling = {"model": args.model, "max_tokens": args.max_tokens, "temperature": args.temperature,
                **({"top_k": args.top_k} if args.top_k > 0 else {})}
    r = await client.post("/v1/chat/completions", headers={"X-Rollout-Id": rid},
                          json={**sampling, "messages": messages, "n": args.group_size, "seed": rng.randrange(2**31)})
    if r.status_code != 200:
        raise RuntimeError(f"{rid} turn 1 (n={args.group_size}): {r.status_code} {r.text[:300]}")

    refused: set[str] = set()

    async def second_turn(choice: dict) -> None:
        message = choice["message"]
        answer = message["content"] or ""
        history = messages + [{"role": "assistant", "content": answer},
                              {"role": "user", "content": f"[tool: word_count] {len(answer.split())} words. Continue."}]
        member = message["rollout"]["id"]
        r = await client.post("/v1/chat/completions", headers={"X-Rollout-Id": member, **staleness_header(args, 1)},
                              json={**sampling, "messages": history, "seed": rng.randrange(2**31)})
        if stale(r):
            refused.add(member)
            return
        if r.status_code != 200:
            raise RuntimeError(f"{member} turn 2: {r.status_code} {r.text[:300]}")

    await asyncio.gather(*[second_turn(c) for c in r.json()["choices"]])
    r = await client.get(f"/v1/groups/{rid}", params={"trajectories": "true"})
    r.raise_for_status()
    return [m["trajectory"] for m in r.json()["members"] if m["id"] not in refused]


async def collect(base_url: str, step: int, args) -> tuple[list[dict], list[float], list[float], int]:
    """P groups of G rollouts; returns trajectories, their rewards, their group-relative advantages
    (over the members kept), and how many rollouts ``--max-staleness`` dropped."""
    rng = random.Random(args.seed * 1000 + step)
    prompts = [f"Task {step}.{p}: describe a {rng.choice(['river', 'city', 'tool', 'song'])}." for p in range(args.prompts)]
    async with httpx.AsyncClient(base_url=base_url, timeout=300) as client:
        if getattr(args, "baseline", None) == "naive" or getattr(args, "separate_calls", False):
            groups = await asyncio.gather(*[
                asyncio.gather(*[rollout(client, prompt, args, random.Random(rng.random())) for _ in range(args.group_size)])
                for prompt in prompts])
        else:
            groups = await asyncio.gather(*[one_group(client, prompt, args, random.Random(rng.random()))
                                            for prompt in prompts])
    trajectories, rewards, advantages = [], [], []
    dropped = 0
    for group in groups:
        dropped += args.group_size - len(group := [t for t in group if t is not None])
        r = [reward_of(t, args.frequent_ids) for t in group]
        trajectories += group
        rewards += r
        advantages += group_advantages(r)
    return trajectories, rewards, advantages, dropped


def plot(rows: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]
    panels = [("reward_mean", "reward"), ("ratio_dev_e4_current", "|ratio − 1| × 10⁴, current-version tokens"),
              ("ratio_dev_e4_stale", "|ratio − 1| × 10⁴, stale tokens"), ("kl_k3", "KL (k3)"),
              ("clip_rate", "clip rate"), ("entropy", "entropy"), ("lag_mean", "lag (versions), mean"),
              ("refit_stall_s", "refit stall (s)")]
    fig, axes = plt.subplots(2, 4, figsize=(16, 7))
    for ax, (key, title) in zip(axes.flat, panels):
        ax.plot(steps, [r[key] for r in rows], marker="o", markersize=3)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.suptitle("GRPO through rollout-service (tiny model, CPU)")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


async def train(args, base_url: str, controller, model_path: str) -> list[dict]:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    trainer = GRPOTrainer.remote(model_path, controller, args.lr, args.clip_eps, args.seed, args.top_k,
                                 args.temperature, args.correction)
    await trainer.version.remote()
    rows: list[dict] = []
    with open(out / "metrics.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        writer.writeheader()
        pending = asyncio.create_task(collect(base_url, 0, args))
        for step in range(args.steps):
            t0 = time.perf_counter()
            trajectories, rewards, advantages, dropped = await pending
            if not trajectories:
                raise RuntimeError(f"step {step}: --max-staleness {getattr(args, 'max_staleness', None)} dropped all "
                                   f"{dropped} rollouts")
            if step + 1 < args.steps and not args.sync:  # the next step's rollouts run while this one trains
                pending = asyncio.create_task(collect(base_url, step + 1, args))
            result = await trainer.step.remote(step, trajectories, advantages)
            if step + 1 < args.steps and args.sync:  # on the weights this step published
                pending = asyncio.create_task(collect(base_url, step + 1, args))
            row = {"step": step, "reward_mean": sum(rewards) / len(rewards), **result,
                   "wall_s": time.perf_counter() - t0, "stale_dropped": dropped}
            rows.append(row)
            writer.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in row.items()})
            f.flush()
            print(f"step {step:3d}  reward {row['reward_mean']:.3f}  ratio-1 e4: current {row['ratio_dev_e4_current']:.3f}"
                  f" stale {row['ratio_dev_e4_stale']:.1f}  kl {row['kl_k3']:.2e}  clip {row['clip_rate']:.3f}"
                  f"  lag {row['lag_mean']:.2f}/{row['lag_max']}  stall {row['refit_stall_s'] * 1e3:.0f} ms"
                  f"  {row['wall_s']:.1f} s", flush=True)
            if math.isnan(row["loss"]):
                raise RuntimeError(f"step {step}: the loss is NaN")
    ray.kill(trainer)
    plot(rows, out / "curves.png")
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--out", required=True)
    p.add_argument("--base-url", help="a running service (its Ray cluster joined with RAY_ADDRESS=auto); default: "
                   "start one here on the tiny model")
    p.add_argument("--baseline", choices=("naive", "raw-logprobs"),
                   help="raw-logprobs: the same loop on a service that reports vLLM's default raw logprobs "
                   "(engine.logprobs_mode raw_logprobs) with the agents at --temperature (0.7 unless given); "
                   "naive: the agents call without a rollout id or echoed ids (every prompt re-rendered from the "
                   "messages' text) and the trainer re-renders and re-tokenizes each final conversation, putting each "
                   "answer's reported logprobs on its tokens by position")
    p.add_argument("--temperature", type=float, help="the agents' sampling temperature (default 1.0; 0.7 with "
                   "--baseline raw-logprobs)")
    p.add_argument("--sync", action="store_true", help="collect each step's rollouts after the previous refit "
                   "(every token on the trainer's version) instead of while the previous step trains")
    p.add_argument("--instance", default="rollout-service", help="service.instance_name of the running service")
    p.add_argument("--model", default="tiny-qwen3", help="the served model name")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--separate-calls", action="store_true", help="start each rollout of a group with its own call "
                   "(as before groups: G prefills of the prompt) instead of one call with n = G")
    p.add_argument("--max-tokens", type=int, default=12)
    p.add_argument("--frequent-ids", type=int, default=20_000)
    p.add_argument("--top-k", type=int, default=64, help="the agents' sampling top_k (the trainer applies the same "
                   "cut to its logits); 0: the whole vocabulary")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--clip-eps", type=float, default=0.2)
    p.add_argument("--correction", choices=("tis", "mis", "icepop"),
                   help="a train/inference mismatch correction (rollout_service.training.corrections): the ratio "
                        "against the trainer's own logprobs before the step, times a per-token weight truncated (tis) "
                        "or masked (mis, icepop); metrics.csv records the share of tokens each would clip or mask")
    p.add_argument("--max-staleness", type=int, metavar="K",
                   help="a rollout's second turn is admitted only while its first turn's tokens are at most K "
                        "versions behind the engines' (X-Max-Staleness); a refused rollout is dropped from the "
                        "step (metrics.csv: stale_dropped). Default: no bound")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--staging", choices=("overlap", "inside"), default="overlap",
                   help="refit.staging of the service this run starts: the new weights staged while the engine "
                   "generates (overlap) or inside the refit's pause; a running service (--base-url) keeps its own")
    args = p.parse_args(argv)
    if args.temperature is None:
        args.temperature = 0.7 if args.baseline == "raw-logprobs" else 1.0
    logprobs_mode = "raw_logprobs" if args.baseline == "raw-logprobs" else "processed_logprobs"

    try:
        with service_for(args, logprobs_mode) as (base_url, controller, config):
            rows = asyncio.run(train(args, base_url, controller, config.engine.resolved_model()))
        first, last = rows[0]["reward_mean"], sum(r["reward_mean"] for r in rows[-3:]) / min(3, len(rows))
        print(f"reward {first:.3f} -> {last:.3f} (last 3 steps) over {len(rows)} steps; {args.out}/metrics.csv, "
              f"{args.out}/curves.png")
        return 0
    except WrongService as exc:
        print(exc, file=sys.stderr)
        return 2
    except Exception as exc:  # noqa: BLE001 - a failed step is the run's failure: say it, exit non-zero
        print(f"training failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1


class WrongService(RuntimeError):
    """The running service (``--base-url``) is not configured as this run needs."""


@contextlib.contextmanager
def service_for(args, logprobs_mode: str | None = None):
    """(base URL, refit controller, service config) to train against: the running service of
    ``args.base_url`` (its Ray cluster joined; ``args.instance`` names it), checked to report
    ``logprobs_mode`` if given, or one started here on the tiny model (one engine) and stopped on
    exit, also on Ctrl-C and SIGTERM."""
    from rollout_service.config import RolloutServiceConfig
    from rollout_service.refit.controller import controller_name, get_controller

    def stop_on_sigterm(signum, frame):  # stop what this command started (the service), as on Ctrl-C
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop_on_sigterm)
    if args.base_url:
        from rollout_service.fleet.fleet import fleet_name, get_fleet

        ray.init(address="auto", ignore_reinit_error=True, log_to_driver=False)
        base_url = args.base_url.rstrip("/").removesuffix("/v1")
        config = RolloutServiceConfig.model_validate(
            ray.get(get_fleet(fleet_name(args.instance)).service_config.remote(), timeout=60))
        if logprobs_mode is not None and config.engine.logprobs_mode != logprobs_mode:
            raise WrongService(f"the service at {base_url} reports {config.engine.logprobs_mode}; this run needs "
                               f"{logprobs_mode} (start it with engine.logprobs_mode: {logprobs_mode})")
        yield base_url, get_controller(controller_name(args.instance)), config
        return
    from rollout_service.ops.launcher import LocalService
    from rollout_service.ops.runtime import shutdown_local_ray

    engine = {"num_engines": 1, **({"logprobs_mode": logprobs_mode} if logprobs_mode else {})}
    config = RolloutServiceConfig.model_validate({"engine": engine, "refit": {"staging": args.staging}})
    svc = LocalService(config, port=_free_port(), log=lambda *a: print(*a, flush=True))
    try:
        svc.start()
        yield svc.url, svc.controller, config
    finally:
        svc.stop()
        shutdown_local_ray()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    sys.exit(main())
