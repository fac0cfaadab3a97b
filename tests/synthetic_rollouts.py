"""Synthetic rollouts for store tests and the store benchmark.

Shaped like the on-policy core's output (prompt tail with loss mask 0, generation with mask 1 and
float32 logprobs, Qwen-range ids including the ChatML specials above 2**16, unicode and tool-call
messages), so store tests exercise the byte layout with realistic values without needing the core.
"""

from __future__ import annotations

import copy
import random

import numpy as np

from rollout_service.onpolicy.types import RolloutState, TurnDelta, TurnRecord, WeightSpan

IM_START, IM_END = 151644, 151645
VOCAB = 151669


def synthetic_delta(
    rng: random.Random,
    *,
    turn: int,
    segment_index: int,
    new_segment: bool,
    segment_len: int,
    prompt_tokens: int = 20,
    gen_tokens: int = 30,
    weight_version: str = "v0",
) -> TurnDelta:
    """One call's delta on a segment currently ``segment_len`` ids long."""
    prompt = [IM_START] + [rng.randrange(VOCAB) for _ in range(max(0, prompt_tokens - 2))] + [IM_END]
    prompt = prompt[:prompt_tokens]
    gen = [rng.randrange(VOCAB) for _ in range(max(0, gen_tokens - 1))] + [IM_END]
    gen = gen[:gen_tokens]
    gen_start = segment_len + len(prompt)
    gen_end = gen_start + len(gen)
    record = TurnRecord(
        turn=turn,
        prompt_start=segment_len,
        gen_start=gen_start,
        gen_end=gen_end,
        finish_reason=rng.choice(["stop", "length", "tool_calls"]),
        monotonic=not new_segment,
        weight_versions=[WeightSpan(weight_version, gen_start, gen_end)] if gen else [],
    )
    call_id = f"call_{turn}"
    messages = [
        {"role": "tool" if turn > 1 else "user", "content": f"résultat {turn} ✓ \"quoted\"\n", "tool_call_id": call_id},
        {
            "role": "assistant",
            "content": None if turn % 2 else f"turn {turn} 🙂",
            "reasoning_content": "think " * 3,
            "tool_calls": [
                {"id": call_id, "type": "function", "function": {"name": "search", "arguments": {"q": "x", "k": turn}}}
            ],
        },
    ]
    return TurnDelta(
        turn=turn,
        segment_index=segment_index,
        new_segment=new_segment,
        token_ids=prompt + gen,
        loss_mask=[0] * len(prompt) + [1] * len(gen),
        logprobs=[0.0] * len(prompt) + [-rng.expovariate(2.0) for _ in gen],
        record=record,
        new_messages=messages,
        render_context={"tools": [{"type": "function", "function": {"name": "search"}}], "segment": segment_index},
    )


def synthetic_rollout(
    rng: random.Random, turns_per_segment: list[int], **delta_kwargs
) -> tuple[list[TurnDelta], RolloutState]:
    """Deltas in commit order, and the state a store must return after all of them (float32 logprobs)."""
    deltas: list[TurnDelta] = []
    state = RolloutState(rollout_id=None)
    turn = 0
    for seg_index, n_turns in enumerate(turns_per_segment):
        for k in range(n_turns):
            turn += 1
            seg_len = 0 if k == 0 else len(state.segments[seg_index].token_ids)
            delta = synthetic_delta(
                rng, turn=turn, segment_index=seg_index, new_segment=k == 0, segment_len=seg_len, **delta_kwargs
            )
            deltas.append(delta)
            copy.deepcopy(delta).apply(state)
    for seg in state.segments:
        seg.logprobs = np.asarray(seg.logprobs, dtype=np.float32).tolist()
    return deltas, state
