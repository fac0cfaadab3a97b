"""One call of a rollout: prompt ids before generation, the stored delta after it.

``build_prompt`` and ``finish_turn`` are pure functions of (stored state, request) and
(plan, generation): the Serve shell loads the state, calls them around the engine, and appends the
returned :class:`TurnDelta` to the store. No I/O happens here, so every rule below is tested on its
own with a real tokenizer and real templates.

Why ``prompt = P + G + tail``: the previous prompt ``P`` and generation ``G`` are exactly what the
model consumed and sampled; re-rendering them from messages loses that (re-tokenization merges or
re-splits the generated ids, the template re-formats tool calls, drops reasoning). Only the tail —
new messages between the previous generation and the next generation prompt — is rendered.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable

from rollout_service.onpolicy.errors import HistoryConflict
from rollout_service.onpolicy.messages import canonical_message, first_difference, render_message
from rollout_service.onpolicy.template import ChatTemplate
from rollout_service.onpolicy.types import RolloutState, TurnDelta, TurnRecord, WeightSpan

HISTORY_POLICIES = ("fork", "reject")


@dataclass
class PromptPlan:
    """What one call will feed the engine, and where its ids go in the trajectory."""

    prompt_ids: list[int]
    segment_index: int
    new_segment: bool
    monotonic: bool  # False only when this call forks away from an edited history
    added_prompt_ids: list[int]  # the ids this call adds before generation (tail, or whole prompt)
    messages: list[dict[str, Any]]  # canonical request messages
    new_messages: list[dict[str, Any]]  # canonical messages this call appends to the segment
    render_context: dict[str, Any]
    base_turn: int = 0  # state.turn the plan was built on (finish_turn checks it did not move)
    base_len: int = 0  # segment length the tail was appended to (0 on a new segment)
    conflict: HistoryConflict | None = None  # why it forked, when it did
    prompt_text: str | None = field(default=None, repr=False)  # rendered text of added_prompt_ids


class _LazyRendered:
    """Template-form messages, normalized on first access: a monotonic turn touches only the
    bounded window and the new messages, so normalizing the whole history would make each turn
    cost grow with the rollout."""

    def __init__(self, messages: list[Any]):
        self._raw = messages
        self._done: dict[int, dict[str, Any]] = {}

    def __len__(self) -> int:
        return len(self._raw)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self._raw)))]
        if i < 0:
            i += len(self._raw)
        m = self._done.get(i)
        if m is None:
            m = self._done[i] = render_message(self._raw[i])
        return m


def _normalize_tools(tools: list[dict] | None) -> list[dict] | None:
    if not tools:
        return None
    return [t.model_dump(exclude_none=True) if hasattr(t, "model_dump") else dict(t) for t in tools]


def render_context(tools: list[dict] | None, chat_template_kwargs: dict | None) -> dict[str, Any]:
    return {"tools": _normalize_tools(tools), "chat_template_kwargs": dict(chat_template_kwargs or {})}


def build_open_prompt(
    messages: list[dict[str, Any]],
    *,
    tools: list[dict] | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
    template: ChatTemplate,
    continue_final_message: bool,
) -> PromptPlan:
    """Prompt ids of a stateless call rendered without the generation prompt, or continuing its final
    message (vLLM's ``add_generation_prompt: false`` / ``continue_final_message``). Never a rollout's
    next call: such a prompt is not a history the rollout's later calls extend."""
    if not messages:
        raise ValueError("messages must not be empty")
    canon = [canonical_message(m) for m in messages]
    ctx = render_context(tools, chat_template_kwargs)
    text = template.render_open_prompt(_LazyRendered(messages)[:], tools=ctx["tools"],
                                       chat_template_kwargs=ctx["chat_template_kwargs"],
                                       continue_final_message=continue_final_message)
    ids = template.encode(text)
    return PromptPlan(prompt_ids=ids, segment_index=0, new_segment=True, monotonic=True, added_prompt_ids=ids,
                      messages=canon, new_messages=canon, render_context=ctx, prompt_text=text)


def build_prompt(
    state: RolloutState | None,
    messages: list[dict[str, Any]],
    *,
    tools: list[dict] | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
    template: ChatTemplate,
    history_policy: str = "fork",
    reasoning_policy: str = "keep",
    whitespace_policy: str = "edges",
) -> PromptPlan:
    """Prompt ids for the next call of a rollout.

    Monotonic request (the stored canonical messages are a prefix of ``messages``, and the tools
    did not change): extend the current segment by the rendered tail. Otherwise the history was
    edited: ``fork`` renders ``messages`` fresh as a new segment, ``reject`` raises
    :class:`HistoryConflict` naming the first differing message and field. The template raises
    :class:`UnsupportedConversation` for conversations it cannot express.
    """
    if history_policy not in HISTORY_POLICIES:
        raise ValueError(f"history_policy must be one of {HISTORY_POLICIES}, not {history_policy!r}")
    if not messages:
        raise ValueError("messages must not be empty")
    canon = [canonical_message(m) for m in messages]
    rendered = _LazyRendered(messages)
    ctx = render_context(tools, chat_template_kwargs)
    kwargs = ctx["chat_template_kwargs"]
    seg = state.current if state is not None else None
    base_turn = state.turn if state is not None else 0

    conflict: HistoryConflict | None = None
    if seg is not None and seg.turns:
        conflict = _find_conflict(state, seg.messages, seg.render_context, canon, ctx, reasoning_policy,
                                  whitespace_policy)
        if conflict is None:
            text = template.tail_text(
                rendered,
                len(seg.messages),
                tools=ctx["tools"],
                chat_template_kwargs=kwargs,
                last_generated_id=seg.token_ids[-1] if seg.token_ids else None,
            )
            added = template.encode(text)
            return PromptPlan(
                prompt_ids=seg.token_ids + added,
                segment_index=len(state.segments) - 1,
                new_segment=False,
                monotonic=True,
                added_prompt_ids=added,
                messages=canon,
                new_messages=canon[len(seg.messages):],
                render_context=ctx,
                base_turn=base_turn,
                base_len=len(seg.token_ids),
                prompt_text=text,
            )
        if history_policy == "reject":
            raise conflict

    text = template.render_prompt(rendered[:], tools=ctx["tools"], chat_template_kwargs=kwargs)
    ids = template.encode(text)
    return PromptPlan(
        prompt_ids=ids,
        segment_index=len(state.segments) if state is not None else 0,
        new_segment=True,
        monotonic=conflict is None,
        added_prompt_ids=list(ids),
        messages=canon,
        new_messages=canon,
        render_context=ctx,
        base_turn=base_turn,
        base_len=0,
        conflict=conflict,
        prompt_text=text,
    )


def _find_conflict(state, stored, stored_ctx, canon, ctx, reasoning_policy,
                   whitespace_policy="edges") -> HistoryConflict | None:
    pending = getattr(state, "pending_conflict", None)
    if pending:
        return HistoryConflict.from_dict(pending)
    diff = first_difference(stored, canon, reasoning_policy=reasoning_policy, whitespace_policy=whitespace_policy)
    if diff is not None:
        index, fld = diff
        if fld == "missing":
            why = f"the request has {len(canon)} messages, fewer than the {len(stored)} the model already saw"
        elif fld == "new_messages":
            why = "the request adds no message after the stored assistant output"
        else:
            why = f"message {index} differs from the history the model saw (field {fld!r})"
        return HistoryConflict(index, fld, why)
    if (stored_ctx or {}).get("tools") != ctx["tools"]:
        return HistoryConflict(None, "tools", "the request's tools differ from those the earlier prompt was rendered with")
    return None


def _span(w: Any) -> WeightSpan:
    if isinstance(w, WeightSpan):
        return w
    if isinstance(w, dict):
        kv = w.get("kv_version")
        return WeightSpan(str(w["version"]), int(w["start"]), int(w["end"]), None if kv is None else str(kv))
    version, start, end, *kv = w
    return WeightSpan(str(version), int(start), int(end), str(kv[0]) if kv and kv[0] is not None else None)


def finish_turn(
    state: RolloutState | None,
    plan: PromptPlan,
    *,
    gen_ids: list[int],
    logprobs: list[float] | None,
    finish_reason: str,
    weight_versions: Iterable[WeightSpan | dict | tuple] = (),
    assistant_message: dict[str, Any],
) -> TurnDelta:
    """The delta one call appends: its added prompt ids (mask 0), its generated ids (mask 1).

    ``weight_versions`` are spans over the *generation* (as the engine reports them); they are
    stored as segment offsets. ``assistant_message`` is the message returned to the client — its
    canonical form is what the next request must repeat to stay monotonic.
    """
    gen_ids = [int(t) for t in gen_ids]
    logprobs = [float(x) for x in logprobs] if logprobs is not None else [0.0] * len(gen_ids)
    if len(logprobs) != len(gen_ids):
        raise ValueError(f"{len(logprobs)} logprobs for {len(gen_ids)} generated ids")
    turn_now = state.turn if state is not None else 0
    if turn_now != plan.base_turn:
        raise HistoryConflict(None, "turn", f"the rollout advanced to turn {turn_now} since this prompt was built")
    if not plan.new_segment:
        seg = state.segments[plan.segment_index]
        if len(seg.token_ids) != plan.base_len:
            raise HistoryConflict(None, "turn", "the segment changed since this prompt was built")
    start = plan.base_len
    gen_start = start + len(plan.added_prompt_ids)
    gen_end = gen_start + len(gen_ids)
    spans = []
    for w in weight_versions or ():
        s = _span(w)
        if not (0 <= s.start <= s.end <= len(gen_ids)):
            raise ValueError(f"weight span {s} outside the generation of {len(gen_ids)} ids")
        spans.append(WeightSpan(s.version, s.start + gen_start, s.end + gen_start, None if s.pure else s.kv_version))
    record = TurnRecord(
        turn=turn_now + 1,
        prompt_start=start,
        gen_start=gen_start,
        gen_end=gen_end,
        finish_reason=finish_reason,
        monotonic=plan.monotonic,
        weight_versions=spans,
    )
    n_prompt = len(plan.added_prompt_ids)
    return TurnDelta(
        turn=turn_now + 1,
        segment_index=plan.segment_index,
        new_segment=plan.new_segment,
        token_ids=list(plan.added_prompt_ids) + gen_ids,
        loss_mask=[0] * n_prompt + [1] * len(gen_ids),
        logprobs=[0.0] * n_prompt + logprobs,
        record=record,
        new_messages=list(plan.new_messages) + [canonical_message(assistant_message)],
        render_context=plan.render_context,
    )
