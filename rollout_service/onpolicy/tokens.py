"""Token in, token out: a call whose prompt the client rendered to ids itself.

prime-rl's stack (verifiers' train client, ``renderers``) templates and tokenizes the conversation
on its side and sends the ids (vLLM's ``/inference/v1/generate``). There are no messages to compare,
and none are needed: the ids are the truth. A call continues its rollout when its prompt starts
with the rollout's stored ids, the previous call's prompt + generation exactly (``prompt = P + G +
tail``; the tail is whatever the client added: a tool result, the next user message, the template's
markers, nothing). Anything else is an edit of the history the model saw: a fork (a new segment
holding the whole prompt) or, under ``reject``, a :class:`HistoryConflict` naming the first
differing position. The ids the client added are prompt (loss mask 0), as every tail is.
"""

from __future__ import annotations

from rollout_service.onpolicy.errors import HistoryConflict
from rollout_service.onpolicy.turn import HISTORY_POLICIES, PromptPlan
from rollout_service.onpolicy.types import RolloutState

TOKENS_CONTEXT = {"dialect": "tokens"}  # render context of a segment whose calls sent ids, not messages


def first_mismatch(stored: list[int], given: list[int]) -> int:
    """The first position where ``given`` does not continue ``stored`` (``len(given)`` if it is shorter)."""
    return next((i for i, (a, b) in enumerate(zip(stored, given)) if a != b), min(len(stored), len(given)))


def plan_on_tokens(state: RolloutState | None, prompt_ids: list[int], *, history_policy: str = "fork") -> PromptPlan:
    """The plan of a call whose prompt is ``prompt_ids``: monotonic on the rollout's current segment
    when the ids start with it, else a new segment (``fork``) or :class:`HistoryConflict` (``reject``)."""
    if history_policy not in HISTORY_POLICIES:
        raise ValueError(f"history_policy must be one of {HISTORY_POLICIES}, not {history_policy!r}")
    ids = [int(t) for t in prompt_ids]
    base_turn = state.turn if state is not None else 0
    seg = state.current if state is not None else None
    conflict = None
    if seg is not None and seg.turns:
        stored = seg.token_ids
        if ids[: len(stored)] == stored:
            return PromptPlan(prompt_ids=ids, segment_index=len(state.segments) - 1, new_segment=False, monotonic=True,
                              added_prompt_ids=ids[len(stored):], messages=[], new_messages=[],
                              render_context=seg.render_context, base_turn=base_turn, base_len=len(stored))
        at = first_mismatch(stored, ids)
        what = (f"the prompt's {len(ids)} ids end at position {at}, inside the {len(stored)} ids the rollout holds"
                if at == len(ids) else f"at position {at} the prompt has id {ids[at]}, the rollout holds {stored[at]}")
        conflict = HistoryConflict(None, "token_ids", f"the prompt does not continue the rollout's stored prompt + "
                                   f"generation ({len(stored)} ids): {what}")
        if history_policy == "reject":
            raise conflict
    return PromptPlan(prompt_ids=ids, segment_index=len(state.segments) if state is not None else 0, new_segment=True,
                      monotonic=conflict is None, added_prompt_ids=list(ids), messages=[], new_messages=[],
                      render_context=dict(TOKENS_CONTEXT), base_turn=base_turn, base_len=0, conflict=conflict)
