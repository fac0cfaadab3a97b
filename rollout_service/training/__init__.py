"""Trainer-side helpers: trajectories (``GET /v1/rollouts/{id}``, ``TrainerClient.get_rollout``) into
training rows, padded batches, GRPO group advantages, mismatch corrections (TIS, MIS, IcePop), and the per-step diagnostics RL teams read.
Pure Python; torch only where a function takes or returns tensors. Imports neither vLLM nor Ray.
docs/training.md says what every field means."""

from rollout_service.training.corrections import Correction, CorrectionWeights, correction_shares, correction_weights
from rollout_service.training.diagnostics import StepDiagnostics, step_diagnostics
from rollout_service.training.grpo import group_advantages
from rollout_service.training.parity import ParityStats, rows_parity
from rollout_service.training.rows import Batch, TrainingRow, TurnBounds, collate, rows_from_group, rows_from_trajectory

__all__ = ["Batch", "Correction", "CorrectionWeights", "ParityStats", "StepDiagnostics", "TrainingRow", "TurnBounds", "collate", "correction_shares", "correction_weights", "group_advantages",
           "rows_from_group", "rows_from_trajectory", "rows_parity", "step_diagnostics"]
