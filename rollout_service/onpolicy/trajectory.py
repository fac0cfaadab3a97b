"""The trainer's view of a rollout, as a JSON document (``GET /v1/rollouts/{id}``, ``get_rollout``)."""

from __future__ import annotations

from typing import Any

from rollout_service.onpolicy.types import RolloutState


def trajectory_export(state: RolloutState) -> dict[str, Any]:
    """The trainer's view: per segment exact ids, loss mask, logprobs, versions, turn boundaries."""
    segments = []
    for i, seg in enumerate(state.segments):
        spans = [w.to_dict() for t in seg.turns for w in t.weight_versions]
        segments.append({
            "index": i,
            "token_ids": list(seg.token_ids),
            "loss_mask": list(seg.loss_mask),
            "logprobs": list(seg.logprobs),
            "weight_versions": spans,
            "turns": [{**{k: v for k, v in t.to_dict().items() if k != "kv_versions"},
                       "weight_versions": [w.to_dict() for w in t.weight_versions],
                       "constrained": t.constrained, "migrations": t.migrations} for t in seg.turns],
            "num_messages": len(seg.messages),
        })
    out = {"id": state.rollout_id, "object": "rollout", "turns": state.turn, "segments": segments}
    # "running" while it takes calls; "aborted" (by the trainer) or "stale" (a call refused past the
    # staleness bound), with the reason given.
    out["status"] = state.status or "running"
    if state.status_reason:
        out["status_reason"] = state.status_reason
    return out
