"""Group-relative advantages (GRPO): the rollouts of one prompt form a group; each rollout's
advantage is its reward minus the group's mean, divided by the group's standard deviation (or not:
``scale="none"``, Dr. GRPO's choice, which does not up-weight groups whose rewards barely differ)."""

from __future__ import annotations

import math
from typing import Sequence


def group_advantages(rewards: Sequence[float], *, scale: str = "std", eps: float = 1e-6) -> list[float]:
    """Advantages of one group's rewards. A group whose rewards are all equal teaches nothing: all 0."""
    if scale not in ("std", "none"):
        raise ValueError(f"scale must be 'std' or 'none', got {scale!r}")
    if not rewards:
        return []
    mean = sum(rewards) / len(rewards)
    centred = [float(r) - mean for r in rewards]
    if scale == "none":
        return centred
    std = math.sqrt(sum(c * c for c in centred) / len(centred))  # population std, as GRPO's papers use
    return [c / (std + eps) for c in centred]
