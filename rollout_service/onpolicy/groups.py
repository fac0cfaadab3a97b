"""A group of rollouts (GRPO: the samples of one prompt) as the trainer reads it: ``GET /v1/groups/{id}``,
``TrainerClient.group``.


A group is formed by a call with ``n > 1`` under ``X-Rollout-Id: R`` (members ``R/0 ... R/{n-1}``,
the group ``R`` unless ``X-Rollout-Group`` names another) or by calls that each name it in
``X-Rollout-Group``. The store keeps each member's last call *under the group* as ``running``,
``finished`` or ``failed``; the member's own status (``aborted``, ``stale``) overrides that. A member
whose first call failed has no stored turn (``failed``, ``turns: 0``); one that finished and whose
rollout then expired or was deleted is ``missing``.
"""

from __future__ import annotations

import time
from typing import Any

from rollout_service.onpolicy.trajectory import trajectory_export
from rollout_service.onpolicy.types import RolloutState

CALL_STATES = ("running", "finished", "failed")  # what the store records per member call
MEMBER_STATES = CALL_STATES + ("aborted", "stale", "missing")


def call_entry(call_state: str, now_s: float | None = None) -> str:
    """A member's record in the group's hash: its last call's state and when it was recorded."""
    return f"{call_state}:{int((time.time() if now_s is None else now_s) * 1000)}"


def parse_call_entry(entry: str) -> tuple[str, float | None]:
    """(state, recorded at in Unix seconds) of a :func:`call_entry` (a bare state: no time)."""
    state, _, ms = entry.partition(":")
    return state, (int(ms) / 1000.0 if ms.isdigit() else None)


def abort_creates(entry: str) -> bool:
    """Whether a group abort creates a member that has no stored rollout (``mark(create=True)``): one
    whose call may still be on its first turn does; one that finished and has gone since (expired,
    deleted) is not brought back."""
    return parse_call_entry(entry)[0] != "finished"


def member_order(member_id: str) -> tuple:
    """``R/2`` before ``R/10``: members sort by their numeric suffix where they have one."""
    head, _, tail = member_id.rpartition("/")
    return (head, int(tail), "") if tail.isdigit() else (member_id, -1, member_id)


def member_state(call_state: str, state: RolloutState | None) -> str:
    if state is not None and state.status in ("aborted", "stale"):
        return state.status
    if state is None and call_state == "finished":
        return "missing"  # finished, then expired or deleted
    return call_state if call_state in CALL_STATES else "running"


def _versions(state: RolloutState) -> tuple[str | None, str | None]:
    spans = [w for seg in state.segments for t in seg.turns for w in t.weight_versions]
    return (spans[0].version, spans[-1].version) if spans else (None, None)


def group_document(group_id: str, calls: dict[str, str], states: dict[str, RolloutState | None], *,
                   trajectories: bool = False) -> dict[str, Any]:
    """The group's document: every member (in order) with its state, turns, first and last weight
    version, when its last call under the group was recorded (``call_recorded_at``: a member
    ``running`` for far longer than a call takes was left by a replica that died) and, with
    ``trajectories``, its ``GET /v1/rollouts/{id}`` document when it has one; and how many members
    are in each state. ``calls``: the store's record (:func:`call_entry` per member)."""
    members = []
    for rid in sorted(calls, key=member_order):
        state = states.get(rid)
        call_state, at = parse_call_entry(calls[rid])
        first, last = _versions(state) if state is not None else (None, None)
        entry: dict[str, Any] = {"id": rid, "state": member_state(call_state, state),
                                 "turns": state.turn if state is not None else 0,
                                 "first_weight_version": first, "last_weight_version": last, "call_recorded_at": at}
        if state is not None and state.status_reason:
            entry["status_reason"] = state.status_reason
        if trajectories:
            entry["trajectory"] = trajectory_export(state) if state is not None else None
        members.append(entry)
    counts = {s: sum(m["state"] == s for m in members) for s in MEMBER_STATES}
    return {"id": group_id, "object": "rollout.group", "size": len(members), "states": counts, "members": members}
