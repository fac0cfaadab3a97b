"""The service as the generation backend of TRL's ``GRPOTrainer`` (trl 1.16: ``rollout_func``).

TRL calls ``rollout_func(prompts, trainer)`` for a batch (each prompt already repeated
``num_generations`` times) and wants one row per prompt: ``prompt_ids``, ``completion_ids`` (for a
multi-turn rollout: everything after the first prompt, the tool results and templates between
turns included), ``logprobs`` (the sampled logprob of each completion token) and, optionally,
``env_mask`` (1 on tokens the model generated, 0 on what the environment added: TRL multiplies it
into the loss mask). :func:`trl_rollout` turns one trajectory (``GET /v1/rollouts/{id}``) into that
row from the service's exact ids, loss mask and processed logprobs, with the weight version of
every completion token beside them; :func:`rollout_output` a batch of them into ``rollout_func``'s
return value.

Weights: :class:`ServiceWeightSync` pushes the trainer's weights to the service with a
``TrainerClient`` (``refit``). :func:`attach` hands it to a ``GRPOTrainer``: as a ``TrainerCallback``
(a refit after each optimizer step) and through TRL's own vLLM hooks, which then (1) call
``sync_weights()`` before each generation whose weights were not pushed yet (the first one: the
trainer's starting weights), and (2) apply TRL's importance-sampling correction with the service's
logprobs as the sampling policy, logging
``sampling/sampling_logp_difference/*`` (the trainer's recompute against what was sampled: ~1e-5
with the service's exact ids and processed logprobs: TRL's own float32 log-softmax). TRL's logprobs are ``log_softmax(logits / T)``
over the whole vocabulary: sample at ``GRPOConfig.temperature`` without top-k / top-p.

Pure Python; imports neither TRL, Ray nor torch (the trainer, the client and the model are passed in).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from rollout_service.training.rows import rows_from_trajectory


def trl_rollout(trajectory: dict[str, Any]) -> dict[str, Any]:
    """One rollout as a row of TRL's ``rollout_func`` output: ``prompt_ids``, ``completion_ids``,
    ``logprobs``, ``env_mask``, ``weight_versions`` (per completion token; None on environment
    tokens). A rollout whose history was edited (more than one segment) has no single token sequence
    for TRL: ValueError (keep the agent's history append-only, or split it yourself)."""
    rows = rows_from_trajectory(trajectory, include_constrained=True)
    if len(rows) != 1:
        raise ValueError(f"rollout {trajectory.get('id')!r} has {len(rows)} segments: TRL trains on one token "
                         "sequence per rollout (an edited history forked it)")
    row = rows[0]
    if not row.turns:
        raise ValueError(f"rollout {trajectory.get('id')!r} has no generated turn")
    start = row.turns[0].gen_start
    mask = [0 if c else m for m, c in zip(row.loss_mask, row.constrained)][start:]  # a grammar's turn: not trained
    return {"prompt_ids": row.input_ids[:start], "completion_ids": row.input_ids[start:],
            "logprobs": row.behaviour_logprobs[start:], "env_mask": mask, "weight_versions": row.versions[start:]}


def rollout_output(trajectories: Sequence[dict[str, Any]], **extra: Sequence[Any]) -> dict[str, list]:
    """``rollout_func``'s return value for ``trajectories`` (in the order of TRL's prompts); ``extra``
    columns (one value per rollout, e.g. ``env_reward``) reach the reward functions as keyword
    arguments."""
    rows = [trl_rollout(t) for t in trajectories]
    out: dict[str, list] = {k: [r[k] for r in rows] for k in ("prompt_ids", "completion_ids", "logprobs", "env_mask",
                                                               "weight_versions")}
    for name, values in extra.items():
        if len(values) != len(rows):
            raise ValueError(f"{name}: {len(values)} values for {len(rows)} rollouts")
        out[name] = list(values)
    return out


class ServiceWeightSync:
    """What TRL's vLLM path calls to publish weights (``sync_weights``), pointed at the service:
    each push refits the service with ``state_dict()`` under a new version label (``<prefix>-<n>``)
    through ``client`` (a :class:`~rollout_service.refit.client.TrainerClient`), at most once per
    optimizer step of the trainer it is attached to."""

    def __init__(self, client, state_dict: Callable[[], dict], prefix: str, transport: str = "object_store"):
        self.client = client
        self.state_dict = state_dict
        self.prefix = prefix
        self.transport = transport
        self.trainer = None  # set by attach(): whose global_step a push is for
        self.versions: list[str] = []
        self.reports: list[dict] = []
        self.pushed_step: int | None = None

    def sync_weights(self) -> None:
        step = None if self.trainer is None else self.trainer.state.global_step
        if step is not None and step == self.pushed_step:
            return  # this step's weights are already on the service
        accelerator = getattr(self.trainer, "accelerator", None)
        if accelerator is not None and not accelerator.is_main_process:
            return  # attach() refuses more than one process; kept for safety
        version = f"{self.prefix}-{len(self.versions)}"
        report = self.client.refit(version, {k: v.detach() for k, v in self.state_dict().items()},
                                   transport=self.transport)
        if not report.get("ok"):
            raise RuntimeError(f"refit {version} failed: {report.get('error')}")
        self.versions.append(version)
        self.reports.append(report)
        self.pushed_step = step

    def generate(self, *args, **kwargs):  # TRL's own generation path: never taken with a rollout_func
        raise RuntimeError("generations come from the service through rollout_func")


def refit_callback(sync: ServiceWeightSync):
    """A ``transformers.TrainerCallback`` that refits the service after each optimizer step."""
    from transformers import TrainerCallback

    class RefitAfterEachStep(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.is_world_process_zero:
                sync.sync_weights()

    return RefitAfterEachStep()


def attach(trainer, sync: ServiceWeightSync) -> None:
    """Make ``trainer`` (a ``trl.GRPOTrainer`` built with a ``rollout_func`` and ``use_vllm=False``) push
    its weights to the service through ``sync`` after each optimizer step (:func:`refit_callback`)
    and before its first generation, and correct its loss with the service's logprobs (TRL's
    ``vllm_importance_sampling_correction``, on by default): the switches TRL's vLLM server mode
    sets, with the service in vLLM's place. Written against trl 1.16.0 (``pyproject``'s ``train``
    extra pins it)."""
    if getattr(trainer, "rollout_func", None) is None:
        raise ValueError("the trainer has no rollout_func: its generations would not come from the service")
    accelerator = getattr(trainer, "accelerator", None)
    if accelerator is not None and accelerator.num_processes > 1:
        # Every process would push, and a sharded (FSDP / ZeRO-3) or PEFT model's state_dict is not the
        # full weights: gathering them as TRL's own sync does is not built here.
        raise ValueError(f"attach() supports one training process, not {accelerator.num_processes}: the weights "
                         "would have to be gathered (FSDP, ZeRO-3, PEFT) and pushed from the main process only")
    sync.trainer = trainer
    trainer.add_callback(refit_callback(sync))
    trainer.use_vllm = True
    trainer.vllm_mode = "server"
    trainer.vllm_generation = sync
    trainer._last_loaded_step = -1  # TRL's own marker (set in its vLLM set-up): sync before the first generation
