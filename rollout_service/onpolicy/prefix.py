"""A required token prefix: the prompt continues ids the client gives, exactly.

NeMo Gym 0.7's ``vllm_model`` client (``supply_prefix_token_ids: true``) sends, with a call that
continues an earlier call of the same rollout, ``required_prefix_token_ids``: that call's exact
prompt + generation ids. It demands that this call's prompt start with them, and checks the
``prompt_token_ids`` it gets back. Those ids are the conversation up to and including its last
assistant message as the model consumed and sampled it, so the prompt is the prefix + the
template's tail for the messages after that assistant message. That is the rule of every monotonic
turn (``prompt = P + G + tail``) with the prefix in place of the stored ``P + G``, so the prefix is
made into a one-segment state and :func:`~rollout_service.onpolicy.turn.build_prompt` derives the
tail as for any turn: an end-of-turn marker the model generated (the prefix's last id) is not
repeated; a generation cut before it is closed as the template closes it.

The prefix itself is never re-derived from the messages: re-rendering and re-tokenizing the
generation would change it (the "Skinny" merge), which is why the client sends it. What is
checked: the ids (integers, not bools, in ``[0, vocabulary)``: :class:`InvalidPrefix`); that
the messages have an assistant message with at least one message after the last one, and that
this message, when it echoes ``prompt_token_ids`` / ``generation_token_ids``, echoes exactly the
prefix (:class:`PrefixNotContinuable`); and, as for every tail, that the template can express the
new messages (:class:`UnsupportedConversation`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from rollout_service.onpolicy.errors import HistoryConflict, InvalidPrefix, PrefixNotContinuable
from rollout_service.onpolicy.messages import canonical_message
from rollout_service.onpolicy.template import ChatTemplate
from rollout_service.onpolicy.turn import PromptPlan, build_prompt, render_context
from rollout_service.onpolicy.types import RolloutState, Segment, TurnRecord


def checked_prefix(value: Any, vocab_size: int) -> list[int] | None:
    """The prefix as a list of ids; ``None`` when absent or empty (every prompt starts with ``[]``).
    Raises :class:`InvalidPrefix`."""
    if value is None:
        return None
    if not isinstance(value, (list, tuple)):
        raise InvalidPrefix(f"must be a list of token ids, got {type(value).__name__}")
    if not value:
        return None
    ids = list(value)
    # ``type(t) is int`` keeps bools out; one pass in the common case.
    if all(type(t) is int for t in ids) and min(ids) >= 0 and max(ids) < vocab_size:
        return ids
    for j, t in enumerate(ids):
        if type(t) is not int:
            raise InvalidPrefix(f"entry {j} must be an integer token id, got {type(t).__name__} {t!r:.40}")
        if not 0 <= t < vocab_size:
            raise InvalidPrefix(f"entry {j} is {t}, outside the vocabulary [0, {vocab_size})")
    raise AssertionError("unreachable")  # pragma: no cover


def plan_on_prefix(
    prefix: list[int],
    messages: list[dict[str, Any]],
    *,
    template: ChatTemplate,
    tools: list[dict] | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
    reasoning_policy: str = "keep",
    segment_index: int = 0,
    base_turn: int = 0,
) -> PromptPlan:
    """The prompt ``prefix + tail(messages after the last assistant message)``, as a plan that
    starts a new segment (index ``segment_index`` of a rollout at turn ``base_turn``) holding all of
    it: the prefix's ids are prompt to this call (loss mask 0), since nothing says which of them were
    sampled. Raises :class:`PrefixNotContinuable`, :class:`UnsupportedConversation`."""
    if not prefix:
        raise ValueError("prefix must not be empty")
    last = next((i for i in range(len(messages) - 1, -1, -1) if messages[i].get("role") == "assistant"), None)
    if last is None:
        raise PrefixNotContinuable(
            "required_prefix_token_ids continues the ids of the conversation up to its last assistant message, "
            "and messages has no assistant message")
    if last == len(messages) - 1:
        raise PrefixNotContinuable(
            f"messages ends with the assistant message {last}, which required_prefix_token_ids already holds: "
            "there is no new message (tool result, user turn) to continue it with", index=last)
    _check_echo(messages[last], last, prefix)
    canon = [canonical_message(m) for m in messages]
    n = len(prefix)
    seed = RolloutState(None, turn=1, segments=[Segment(
        token_ids=list(prefix), loss_mask=[0] * n, logprobs=[0.0] * n,
        turns=[TurnRecord(turn=1, prompt_start=0, gen_start=n, gen_end=n, finish_reason="unknown", monotonic=True)],
        messages=canon[: last + 1], render_context=render_context(tools, chat_template_kwargs))])
    try:
        plan = build_prompt(seed, messages, tools=tools, chat_template_kwargs=chat_template_kwargs, template=template,
                            history_policy="reject", reasoning_policy=reasoning_policy)
    except HistoryConflict as exc:  # pragma: no cover - the seed's messages are the request's own prefix
        raise AssertionError(f"a prefix seed conflicts with its own messages: {exc}") from exc
    return replace(plan, segment_index=segment_index, new_segment=True, added_prompt_ids=list(plan.prompt_ids),
                   new_messages=plan.messages, base_turn=base_turn, base_len=0, prompt_text=None)


def _check_echo(msg: dict[str, Any], index: int, prefix: list[int]) -> None:
    """An assistant message that echoes its call's ids (NeMo Gym's Responses path does) must echo the
    prefix: two different histories in one request would leave the prompt to a guess."""
    prompt, gen = msg.get("prompt_token_ids"), msg.get("generation_token_ids")
    if prompt is None or gen is None:
        return
    echoed = list(prompt) + list(gen)
    if echoed == prefix:
        return
    at = next((j for j, (a, b) in enumerate(zip(echoed, prefix)) if a != b), min(len(echoed), len(prefix)))
    raise PrefixNotContinuable(
        f"message {index} echoes prompt_token_ids + generation_token_ids ({len(echoed)} ids) that differ from "
        f"required_prefix_token_ids ({len(prefix)} ids) at position {at}", index=index)


__all__ = ["checked_prefix", "plan_on_prefix", "InvalidPrefix", "PrefixNotContinuable"]
