"""What the engine replica reads off vLLM's request outputs, as plain data: the sampled token's
processed logprob at each position with the top alternatives if asked, the prompt logprobs, the
weight-version spans over the ids a running request has produced so far (from the record vLLM's
output processor keeps), and where the KV was recomputed whole after a refit cleared the cache.
Imports no vLLM: it reads the objects vLLM hands over.
"""

from __future__ import annotations

from rollout_service.engine.types import EngineUnavailable, spans_up_to


def prompt_logprobs(positions) -> list[list[tuple[int, float, int]] | None]:
    """vLLM's prompt logprobs as plain data: per position None or (id, logprob, rank) in vLLM's order."""
    return [None if entry is None else [(int(t), float(lp.logprob), int(lp.rank or 0)) for t, lp in entry.items()]
            for entry in positions]


def sampled_logprobs(ids: list[int], logprobs, want_top: int, listed: bool = False):
    """The sampled token's processed logprob per position, plus the top-k alternatives if asked
    (``listed``: every entry vLLM returned, in its order: the ``logprob_token_ids``)."""
    if logprobs is None:
        raise EngineUnavailable("engine returned no logprobs (logprobs must be requested)")
    out: list[float] = []
    tops: list[dict[int, float]] | None = [] if want_top or listed else None
    for pos, tid in enumerate(ids):
        entry = logprobs[pos]
        out.append(float(entry[tid].logprob))
        if listed:
            tops.append({int(t): float(lp.logprob) for t, lp in entry.items()})
        elif tops is not None:
            ranked = sorted(((t, lp) for t, lp in entry.items()), key=lambda kv: kv[1].rank or 0)
            tops.append({int(t): float(lp.logprob) for t, lp in ranked if lp.rank and lp.rank <= want_top})
    return out, tops


def spans_so_far(llm, request_id: str, n: int) -> list[tuple[str, int, int]] | None:
    """The weight-version spans over the first ``n`` generated ids of a running request, from the
    record vLLM's output processor keeps per request (the version of the engine step that produced
    each id; the final output's ``weight_versions`` are built from it). None where this vLLM keeps
    no such record: the call then carries the spans on its final chunk only."""
    processor = getattr(llm, "output_processor", None)
    internal = getattr(processor, "external_req_ids", {}).get(request_id)
    state = processor.request_states.get(internal[-1]) if internal else None
    starts = getattr(state, "weight_version_starts", None)
    if not starts:
        return None
    ends = [start for _, start in starts[1:]] + [n]
    return spans_up_to([(v, s, e) for (v, s), e in zip(starts, ends)], n)


def reset_positions(spans, versions: set[str] | None) -> list[int]:
    """Where the KV was recomputed whole: the first id of each version in ``versions``."""
    if not versions:
        return []
    out, seen = [], set()
    for v, s, _ in spans:
        if v in versions and v not in seen:
            seen.add(v)
            out.append(s)
    return out
