"""The per-step figures RL teams read on a trainer's side, computed on the trained positions of a
step's rows (``loss_mask`` 1):

- ``ratio_dev_e4_current``: mean |π_trainer / π_behaviour − 1| × 10⁴ over tokens sampled by the
  version the trainer holds before its step. π_trainer is the trainer's own logprob of the token
  (a forward pass of the same weights on the same ids); π_behaviour the logprob the engine sampled
  it with. Exact ids and processed logprobs make this ~0 (fp32 noise); a re-tokenized history or
  raw logprobs at a temperature ≠ 1 do not.
- ``ratio_dev_e4_stale``: the same over tokens sampled by older versions (asynchronous RL: the
  policy moved on; this is the off-policyness the loss must correct for, not a mismatch).
- ``ratio_dev_e4_mixed``: the same over tokens sampled by the trainer's version over KV cache an
  older version computed (``kv_versions``: a refit landed mid-generation and kept the KV). Not
  counted as current: the engine's distribution there is neither policy, so its ratio is not 1.
- ``kl_k3``: Schulman's k3 estimator, mean of (r − 1 − log r) with r = π_new / π_old on the
  sampled tokens (π_old: the trainer's logprobs before the step, π_new: after it). The tokens were
  sampled by (close to) π_old, so it estimates KL(π_old ‖ π_new), equal to KL(π_new ‖ π_old) to
  second order in the step.
- ``clip_rate``: the share of tokens whose ratio π_loss / π_behaviour left [1 − ε, 1 + ε], with
  π_loss the logprobs the clipped loss used, whatever the advantage's sign (the "clipfrac" of
  OpenAI baselines; verl counts only the side the clip binds on).
- ``entropy``: the mean of the per-token entropies the trainer passes (its full distributions).
- ``lag_mean`` / ``lag_max``: how many versions each token's version is behind the trainer's (the
  position in ``version_order``, the versions the trainer labelled in order).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Sequence

from rollout_service.training.rows import TrainingRow


@dataclass
class StepDiagnostics:
    tokens: int
    tokens_current: int
    tokens_stale: int
    ratio_dev_e4_current: float
    ratio_dev_e4_stale: float
    tokens_mixed: int
    ratio_dev_e4_mixed: float
    kl_k3: float
    clip_rate: float
    entropy: float
    lag_mean: float
    lag_max: int

    def to_dict(self) -> dict:
        return asdict(self)


def step_diagnostics(
    rows: Sequence[TrainingRow],
    trainer_logprobs: Sequence[Sequence[float]],
    *,
    trainer_version: str,
    version_order: Sequence[str],
    new_logprobs: Sequence[Sequence[float]] | None = None,
    loss_logprobs: Sequence[Sequence[float]] | None = None,
    entropies: Sequence[Sequence[float]] | None = None,
    clip_eps: float = 0.2,
) -> StepDiagnostics:
    """``trainer_logprobs[k][i]``: the trainer's logprob (before its step) of ``rows[k].input_ids[i]``
    given the ids before it; ``new_logprobs``: the same after the step (for ``kl_k3``);
    ``loss_logprobs``: those the clipped loss used (for ``clip_rate``; default ``trainer_logprobs``);
    ``entropies``: per position. Only trained positions count; a figure with no token is NaN."""
    order = {v: i for i, v in enumerate(version_order)}
    if trainer_version not in order:
        raise ValueError(f"trainer version {trainer_version!r} is not in version_order")
    now = order[trainer_version]
    dev_cur, dev_stale, dev_mixed, k3, clipped, ent, lags = [], [], [], [], [], [], []
    loss_logprobs = loss_logprobs if loss_logprobs is not None else trainer_logprobs
    for k, row in enumerate(rows):
        for i, m in enumerate(row.loss_mask):
            if not m:
                continue
            version = row.versions[i]
            if version not in order:
                raise ValueError(f"rollout {row.rollout_id!r}: token {i} has version {version!r}, not in version_order")
            behaviour = row.behaviour_logprobs[i]
            deviation = abs(math.exp(trainer_logprobs[k][i] - behaviour) - 1.0) * 1e4
            if version != trainer_version:
                dev_stale.append(deviation)
            elif row.kv_version(i) not in (None, version):
                dev_mixed.append(deviation)
            else:
                dev_cur.append(deviation)
            lags.append(now - order[version])
            if new_logprobs is not None:
                log_r = new_logprobs[k][i] - trainer_logprobs[k][i]
                k3.append(math.exp(log_r) - 1.0 - log_r)
            clipped.append(abs(math.exp(loss_logprobs[k][i] - behaviour) - 1.0) > clip_eps)
            if entropies is not None:
                ent.append(entropies[k][i])

    def mean(xs) -> float:
        return sum(xs) / len(xs) if xs else float("nan")

    return StepDiagnostics(tokens=len(lags), tokens_current=len(dev_cur), tokens_stale=len(dev_stale),
                           ratio_dev_e4_current=mean(dev_cur), ratio_dev_e4_stale=mean(dev_stale),
                           tokens_mixed=len(dev_mixed), ratio_dev_e4_mixed=mean(dev_mixed),
                           kl_k3=mean(k3), clip_rate=mean(clipped), entropy=mean(ent),
                           lag_mean=mean(lags), lag_max=max(lags, default=0))


def token_logprobs(logits, input_ids):
    """(logprobs, entropies) per position of one sequence from a causal LM's logits ``[T, V]``
    (float32): position i's logprob is that of ``input_ids[i]`` under the logits at i − 1; position
    0 has none (0.0). Torch tensors in, Python lists out."""
    import torch

    logp = torch.log_softmax(logits.float(), dim=-1)
    ids = torch.as_tensor(input_ids, dtype=torch.long, device=logits.device)
    picked = logp[:-1].gather(-1, ids[1:].unsqueeze(-1)).squeeze(-1)
    entropy = torch.special.entr(logp[:-1].exp()).sum(-1)  # 0 log 0 = 0 (masked logits)
    return [0.0] + picked.tolist(), [0.0] + entropy.tolist()
