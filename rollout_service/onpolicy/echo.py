"""Stateless mode: rebuild a rollout's state from the ids a client echoes back.

NeMo Gym's data interface puts ``prompt_token_ids``, ``generation_token_ids`` and
``generation_log_probs`` on the assistant message of every earlier call. Those ids are the stored
state; the same turn algorithm then runs on them. What the echo cannot carry is the message
history the ids were built from, so every echoed call is *verified* against the messages as they
are now: the first call's prompt must equal a fresh render of the messages before it, each later
call's prompt must be the previous prompt + generation + the tail those messages render to.
A client that edited a message before the last echoed call therefore fails verification, and the
conflict goes to the history policy (fork / reject) exactly as a stored rollout's would — the
echoed ids are never silently trusted over the messages, nor the messages over the ids.

Cost: verification renders one bounded window per echoed call, so a stateless request costs
O(calls so far); a stored rollout (``X-Rollout-Id``) costs O(1) windows per call.
"""

from __future__ import annotations

from typing import Any, Callable

from rollout_service.onpolicy.errors import HistoryConflict
from rollout_service.onpolicy.messages import (
    ECHO_FIELDS,
    canonical_message,
    first_difference,
    render_message,
    strip_echo,
)
from rollout_service.onpolicy.template import ChatTemplate
from rollout_service.onpolicy.turn import render_context
from rollout_service.onpolicy.types import RolloutState, Segment, TurnRecord


def has_echo(msg: dict[str, Any]) -> bool:
    return (
        msg.get("role") == "assistant"
        and msg.get("prompt_token_ids") is not None
        and msg.get("generation_token_ids") is not None
    )


def state_from_echo(
    messages: list[dict[str, Any]],
    *,
    template: ChatTemplate,
    tools: list[dict] | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
    reasoning_policy: str = "keep",
    parse: Callable[[list[int]], dict[str, Any]] | None = None,
    rollout_id: str | None = None,
) -> tuple[RolloutState | None, list[dict[str, Any]]]:
    """(state, messages without echo fields). ``None`` state when nothing was echoed.

    ``parse`` (gen ids -> assistant message, e.g. a partial of :func:`parse_output`) also checks
    each echoed assistant message against its own generation, so an edited assistant message is
    caught too; reasoning dropped from it is not an edit under ``reasoning_policy="keep"``.
    """
    clean = [strip_echo(m) if isinstance(m, dict) else m for m in messages]
    echoed = [i for i, m in enumerate(messages) if isinstance(m, dict) and has_echo(m)]
    if not echoed:
        return None, clean
    canon = [canonical_message(m) for m in clean]
    rendered = [render_message(m) for m in clean]
    ctx = render_context(tools, chat_template_kwargs)
    state = RolloutState(rollout_id=rollout_id)
    conflict: HistoryConflict | None = None
    prev = -1
    for i in echoed:
        m = messages[i]
        prompt = [int(t) for t in m["prompt_token_ids"]]
        gen = [int(t) for t in m["generation_token_ids"]]
        logprobs = m.get("generation_log_probs")
        logprobs = [float(x) for x in logprobs] if logprobs is not None else [0.0] * len(gen)
        if len(logprobs) != len(gen):
            raise ValueError(f"message {i}: {len(logprobs)} generation_log_probs for {len(gen)} generation_token_ids")
        seg = state.current
        extends = seg is not None and len(prompt) > len(seg.token_ids) and prompt[: len(seg.token_ids)] == seg.token_ids
        if conflict is None:
            conflict = _verify(template, rendered, prev, i, prompt, seg if extends else None, ctx)
        if conflict is None and parse is not None:
            diff = first_difference([canonical_message(parse(gen))], [canon[i], None], reasoning_policy=reasoning_policy)
            if diff is not None:
                conflict = HistoryConflict(i, diff[1], f"message {i} differs from its own echoed generation (field {diff[1]!r})")
        if extends:
            added = prompt[len(seg.token_ids):]
            start = len(seg.token_ids)
            new_messages = canon[prev + 1 : i + 1]
        else:
            seg = Segment()
            state.segments.append(seg)
            added, start, new_messages = prompt, 0, canon[: i + 1]
        state.turn += 1
        gen_start = start + len(added)
        seg.token_ids.extend(added + gen)
        seg.loss_mask.extend([0] * len(added) + [1] * len(gen))
        seg.logprobs.extend([0.0] * len(added) + logprobs)
        seg.turns.append(
            TurnRecord(
                turn=state.turn,
                prompt_start=start,
                gen_start=gen_start,
                gen_end=gen_start + len(gen),
                finish_reason=m.get("finish_reason") or "unknown",
                monotonic=bool(extends) or len(state.segments) == 1,
            )
        )
        seg.messages.extend(new_messages)
        seg.render_context = ctx
        prev = i
    if conflict is not None:
        state.pending_conflict = conflict.to_dict()
    return state, clean


def _verify(template, rendered, prev, i, prompt, seg, ctx) -> HistoryConflict | None:
    kwargs = ctx["chat_template_kwargs"]
    if seg is None:
        expected = template.prompt_ids(rendered[:i], tools=ctx["tools"], chat_template_kwargs=kwargs)
        if expected == prompt:
            return None
        first = 0
        what = f"messages [0, {i}) no longer render to the prompt_token_ids echoed on message {i}"
    else:
        tail = template.tail_text(
            rendered[:i], prev + 1, tools=ctx["tools"], chat_template_kwargs=kwargs,
            last_generated_id=seg.token_ids[-1] if seg.token_ids else None,
        )
        if template.encode(tail) == prompt[len(seg.token_ids):]:
            return None
        first = prev + 1
        what = f"messages [{prev + 1}, {i}) no longer render to the ids echoed on message {i}"
    return HistoryConflict(first, "echo", what + " (the history was edited after that call)")


__all__ = ["state_from_echo", "has_echo", "ECHO_FIELDS"]
