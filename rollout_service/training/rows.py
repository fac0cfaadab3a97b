"""A trajectory as training rows: one row per segment (an exact token sequence the engine saw, see
``rollout_service.onpolicy.types``), every position labelled with what a policy-gradient loss needs.

A rollout's segments are independent sequences: a monotonic conversation is one segment; an edited
history (``fork``) starts another. Each row carries, per token position:

- ``input_ids``: the ids exactly as the engine saw and sampled them (never re-tokenized);
- ``loss_mask``: 1 on ids the model generated (0 on prompt ids, the rendered tool results and user
  turns between calls), and 0 on a constrained turn's ids when ``include_constrained`` is False;
- ``behaviour_logprobs``: the logprob each generated id was sampled with (the engine's processed
  logprob: after temperature, top-k/p; 0.0 on prompt ids);
- ``versions``: the weight version that sampled each generated id (None on prompt ids): the
  behaviour policy per token, which can change inside one turn when a refit lands mid-generation;
- ``kv_versions``: the oldest version whose KV cache that id's sampling attended to (None on prompt
  ids): equal to ``versions[i]`` when the KV is pure; older on a token sampled after a refit that
  kept the KV (``refit.clear_cache: false``) — current weights over older KV, not exactly either
  policy (``step_diagnostics`` counts them apart);
- ``constrained``: 1 on ids sampled under a grammar (forced tool choice, ``response_format``),
  whose logprobs are renormalized over the allowed tokens (docs/trainer-integration.md).

Turn boundaries (``turns``) index the same positions.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence


@dataclass(frozen=True)
class TurnBounds:
    """One model call in a row: ids ``[prompt_start, gen_start)`` were added as its prompt,
    ``[gen_start, gen_end)`` were generated."""

    turn: int
    prompt_start: int
    gen_start: int
    gen_end: int
    finish_reason: str
    constrained: bool = False
    migrations: int = 0


@dataclass
class TrainingRow:
    rollout_id: str | None
    segment: int
    input_ids: list[int]
    loss_mask: list[int]
    behaviour_logprobs: list[float]
    versions: list[str | None]
    constrained: list[int]
    turns: list[TurnBounds] = field(default_factory=list)
    kv_versions: list[str | None] = field(default_factory=list)  # [] from callers that built rows without it

    def kv_version(self, i: int) -> str | None:
        """Position ``i``'s KV version (its ``versions[i]`` when the row carries none)."""
        return self.kv_versions[i] if self.kv_versions else self.versions[i]

    def __len__(self) -> int:
        return len(self.input_ids)

    @property
    def num_trained(self) -> int:
        return sum(self.loss_mask)

    def version_set(self) -> set[str]:
        return {v for v, m in zip(self.versions, self.loss_mask) if m and v is not None}


def rows_from_trajectory(trajectory: dict[str, Any], *, include_constrained: bool = True) -> list[TrainingRow]:
    """Training rows of one trajectory (as ``GET /v1/rollouts/{id}`` returns it), one per segment.
    Raises ValueError if the trajectory is inconsistent (lengths differ, a generated id has no
    version, spans overlap or leave the segment): training on it would be silently wrong."""
    rows = []
    for seg in trajectory.get("segments") or []:
        ids, mask, lps = list(seg["token_ids"]), list(seg["loss_mask"]), list(seg["logprobs"])
        n = len(ids)
        where = f"rollout {trajectory.get('id')!r} segment {seg.get('index')}"
        if not (len(mask) == len(lps) == n):
            raise ValueError(f"{where}: token_ids, loss_mask and logprobs differ in length ({n}, {len(mask)}, {len(lps)})")
        versions: list[str | None] = [None] * n
        kv_versions: list[str | None] = [None] * n
        for span in seg.get("weight_versions") or []:
            start, end = int(span["start"]), int(span["end"])
            if not 0 <= start <= end <= n:
                raise ValueError(f"{where}: weight-version span [{start}, {end}) outside the segment ({n} ids)")
            for i in range(start, end):
                if versions[i] is not None:
                    raise ValueError(f"{where}: weight-version spans overlap at position {i}")
                versions[i] = str(span["version"])
                kv_versions[i] = str(span.get("kv_version") or span["version"])
        missing = [i for i in range(n) if mask[i] and versions[i] is None]
        if missing:
            raise ValueError(f"{where}: generated ids without a weight version (first at {missing[0]})")
        turns, constrained = [], [0] * n
        for t in seg.get("turns") or []:
            bounds = TurnBounds(turn=int(t["turn"]), prompt_start=int(t["prompt_start"]), gen_start=int(t["gen_start"]),
                                gen_end=int(t["gen_end"]), finish_reason=str(t.get("finish_reason", "")),
                                constrained=bool(t.get("constrained")), migrations=int(t.get("migrations") or 0))
            if not 0 <= bounds.prompt_start <= bounds.gen_start <= bounds.gen_end <= n:
                raise ValueError(f"{where}: turn {bounds.turn}'s bounds ({bounds.prompt_start}, {bounds.gen_start}, "
                                 f"{bounds.gen_end}) are not ordered inside the segment ({n} ids)")
            turns.append(bounds)
            if bounds.constrained:
                for i in range(bounds.gen_start, bounds.gen_end):
                    constrained[i] = 1
        loss = [m if include_constrained or not c else 0 for m, c in zip(mask, constrained)]
        rows.append(TrainingRow(rollout_id=trajectory.get("id"), segment=int(seg.get("index", len(rows))),
                                input_ids=ids, loss_mask=loss, behaviour_logprobs=[float(x) for x in lps],
                                versions=versions, constrained=constrained, turns=turns, kv_versions=kv_versions))
    return rows


@dataclass
class Batch:
    """Rows padded to one length (right padding). ``attention_mask`` is 1 on real positions;
    ``advantages`` holds each row's advantage on its trained positions (0 elsewhere)."""

    input_ids: list[list[int]]
    attention_mask: list[list[int]]
    loss_mask: list[list[int]]
    behaviour_logprobs: list[list[float]]
    versions: list[list[str | None]]
    advantages: list[list[float]]

    def to_torch(self):
        """The numeric fields as tensors (ids, masks: int64; logprobs, advantages: float32)."""
        import torch

        return {"input_ids": torch.tensor(self.input_ids, dtype=torch.long),
                "attention_mask": torch.tensor(self.attention_mask, dtype=torch.long),
                "loss_mask": torch.tensor(self.loss_mask, dtype=torch.long),
                "behaviour_logprobs": torch.tensor(self.behaviour_logprobs, dtype=torch.float32),
                "advantages": torch.tensor(self.advantages, dtype=torch.float32)}


def collate(rows: Sequence[TrainingRow], pad_id: int, *, advantages: Sequence[float] | None = None,
            max_len: int | None = None) -> Batch:
    """Pad ``rows`` to the longest (or refuse rows longer than ``max_len``: truncating would cut
    generated ids out of their context). ``advantages``: one per row."""
    if advantages is not None and len(advantages) != len(rows):
        raise ValueError(f"{len(advantages)} advantages for {len(rows)} rows")
    width = max((len(r) for r in rows), default=0)
    if max_len is not None and width > max_len:
        raise ValueError(f"a row has {width} ids, more than max_len={max_len}")
    out = Batch([], [], [], [], [], [])
    for k, r in enumerate(rows):
        pad = width - len(r)
        adv = float(advantages[k]) if advantages is not None else 0.0
        out.input_ids.append(r.input_ids + [pad_id] * pad)
        out.attention_mask.append([1] * len(r) + [0] * pad)
        out.loss_mask.append(r.loss_mask + [0] * pad)
        out.behaviour_logprobs.append(r.behaviour_logprobs + [0.0] * pad)
        out.versions.append(r.versions + [None] * pad)
        out.advantages.append([adv if m else 0.0 for m in r.loss_mask] + [0.0] * pad)
    return out


def rows_from_group(group: dict[str, Any], *, include_constrained: bool = True) -> list[TrainingRow]:
    """Training rows of every finished member of a group (``GET /v1/groups/{id}?trajectories=true``,
    ``TrainerClient.group``), in member order (``R/0``, ``R/1``, ...): the rows of one GRPO group.
    Members that are running, failed, aborted, stale or missing give none. Raises ValueError if a
    finished member came without its trajectory (the group was read without trajectories)."""
    rows: list[TrainingRow] = []
    for member in group.get("members") or []:
        if member.get("state") != "finished":
            continue
        trajectory = member.get("trajectory")
        if trajectory is None:
            raise ValueError(f"group {group.get('id')!r}: member {member.get('id')!r} has no trajectory "
                             "(read the group with trajectories: GET /v1/groups/{id}?trajectories=true)")
        rows.extend(rows_from_trajectory(trajectory, include_constrained=include_constrained))
    return rows
