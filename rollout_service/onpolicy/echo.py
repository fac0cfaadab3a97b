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

Before any of that, the echo fields themselves are checked (:class:`InvalidEcho`, 400, naming
the message index and the field): they sit only on assistant messages; ``prompt_token_ids`` and
``generation_token_ids`` come together and are lists of ints (not bools) in ``[0, vocab_size)``,
the prompt non-empty (an aborted call may have generated nothing); ``generation_log_probs``, when
present, is a list of finite numbers, one per generated id (absent: logprobs 0.0);
``finish_reason`` is a string. Ids are checked because nothing downstream would:
a generated id is never re-rendered, so an out-of-vocabulary or negative one would go straight
into the next prompt and fail (or worse, not fail) inside the engine. All messages are checked
before any state is built, so a bad echo changes nothing.

Cost: verification renders one bounded window per echoed call, so a stateless request costs
O(calls so far); a stored rollout (``X-Rollout-Id``) costs O(1) windows per call.
"""

from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple

from rollout_service.onpolicy.errors import HistoryConflict, InvalidEcho
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
    whitespace_policy: str = "edges",
    parse: Callable[[list[int]], dict[str, Any]] | None = None,
    rollout_id: str | None = None,
    vocab_size: int | None = None,
) -> tuple[RolloutState | None, list[dict[str, Any]]]:
    """(state, messages without echo fields). ``None`` state when nothing was echoed.

    ``parse`` (gen ids -> assistant message, e.g. a partial of :func:`parse_output`) also checks
    each echoed assistant message against its own generation, so an edited assistant message is
    caught too; reasoning dropped from it is not an edit under ``reasoning_policy="keep"``.

    ``vocab_size`` bounds the echoed ids (default: ``len`` of the template's tokenizer). A model
    whose embedding is padded past the tokenizer (Qwen3: 151,936 rows for 151,669 tokens) can
    sample the padding ids, and they come back in ``generation_token_ids``; a server for such a
    model passes the engine's vocabulary size so its own output echoes back cleanly.
    Raises :class:`InvalidEcho` for malformed echo fields, before anything is built.
    """
    calls = checked_echo(messages, len(template.tokenizer) if vocab_size is None else vocab_size)
    clean = [strip_echo(m) if isinstance(m, dict) else m for m in messages]
    echoed = sorted(calls)
    if not echoed:
        return None, clean
    canon = [canonical_message(m) for m in clean]
    rendered = [render_message(m) for m in clean]
    ctx = render_context(tools, chat_template_kwargs)
    state = RolloutState(rollout_id=rollout_id)
    conflict: HistoryConflict | None = None
    prev = -1
    for i in echoed:
        prompt, gen, logprobs, finish_reason = calls[i]
        seg = state.current
        extends = seg is not None and len(prompt) > len(seg.token_ids) and prompt[: len(seg.token_ids)] == seg.token_ids
        if conflict is None:
            conflict = _verify(template, rendered, prev, i, prompt, seg if extends else None, ctx)
        if conflict is None and parse is not None:
            diff = first_difference([canonical_message(parse(gen))], [canon[i], None], reasoning_policy=reasoning_policy,
                                    whitespace_policy=whitespace_policy)
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
                finish_reason=finish_reason or "unknown",
                monotonic=bool(extends) or len(state.segments) == 1,
            )
        )
        seg.messages.extend(new_messages)
        seg.render_context = ctx
        prev = i
    if conflict is not None:
        state.pending_conflict = conflict.to_dict()
    return state, clean


class _EchoedCall(NamedTuple):
    prompt_ids: list[int]
    gen_ids: list[int]
    logprobs: list[float]
    finish_reason: str | None


def checked_echo(messages: list[Any], vocab_size: int) -> dict[int, _EchoedCall]:
    """Every message's echo fields, checked; {message index: its echoed call}. Raises InvalidEcho."""
    calls: dict[int, _EchoedCall] = {}
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            continue
        present = [k for k in ECHO_FIELDS if m.get(k) is not None]
        if not present:
            continue
        if m.get("role") != "assistant":
            raise InvalidEcho(
                i, present[0], f"echoed token data belongs on an assistant message, not on a {m.get('role')!r} message"
            )
        for k in ("prompt_token_ids", "generation_token_ids"):
            if k not in present:
                raise InvalidEcho(
                    i, k, f"missing: an echoed call needs both prompt_token_ids and generation_token_ids (got {', '.join(present)})"
                )
        prompt = _token_ids(i, "prompt_token_ids", m["prompt_token_ids"], vocab_size, allow_empty=False)
        # An aborted call can end with no generated id, and is stored (and returned) like any other.
        gen = _token_ids(i, "generation_token_ids", m["generation_token_ids"], vocab_size, allow_empty=True)
        raw = m.get("generation_log_probs")
        logprobs = [0.0] * len(gen) if raw is None else _logprobs(i, raw, len(gen))
        finish_reason = m.get("finish_reason")
        if finish_reason is not None and not isinstance(finish_reason, str):
            raise InvalidEcho(i, "finish_reason", f"must be a string, got {type(finish_reason).__name__}")
        calls[i] = _EchoedCall(prompt, gen, logprobs, finish_reason)
    return calls


def _token_ids(i: int, field: str, value: Any, vocab_size: int, *, allow_empty: bool) -> list[int]:
    if not isinstance(value, (list, tuple)):
        raise InvalidEcho(i, field, f"must be a list of token ids, got {type(value).__name__}")
    if not value:
        if allow_empty:
            return []
        raise InvalidEcho(i, field, "must not be empty (every call's prompt has at least one token)")
    ids = list(value)
    # ``type(t) is int`` keeps bools (and other int subclasses) out; one pass in the common case.
    if all(type(t) is int for t in ids) and min(ids) >= 0 and max(ids) < vocab_size:
        return ids
    for j, t in enumerate(ids):
        if type(t) is not int:
            raise InvalidEcho(i, field, f"entry {j} must be an integer token id, got {type(t).__name__} {t!r:.40}")
        if not 0 <= t < vocab_size:
            raise InvalidEcho(i, field, f"entry {j} is {t}, outside the vocabulary [0, {vocab_size})")
    raise AssertionError("unreachable")  # pragma: no cover


def _logprobs(i: int, value: Any, n_gen: int) -> list[float]:
    field = "generation_log_probs"
    if not isinstance(value, (list, tuple)):
        raise InvalidEcho(i, field, f"must be a list of numbers, got {type(value).__name__}")
    if len(value) != n_gen:
        raise InvalidEcho(i, field, f"has {len(value)} entries for {n_gen} generation_token_ids (one logprob per generated id)")
    out: list[float] = []
    for j, x in enumerate(value):
        if isinstance(x, bool) or not isinstance(x, (int, float)):
            raise InvalidEcho(i, field, f"entry {j} must be a number, got {type(x).__name__} {x!r:.40}")
        try:
            f = float(x)
        except OverflowError:
            f = math.inf
        if not math.isfinite(f):
            raise InvalidEcho(i, field, f"entry {j} must be a finite number, got {x!r:.40}")
        out.append(f)
    return out


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


__all__ = ["state_from_echo", "has_echo", "ECHO_FIELDS", "InvalidEcho"]
