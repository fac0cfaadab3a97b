"""Mid-turn migration, the pure parts: how a generation's progress is carried to another engine
(the continuation request, the spans across the seam, what cannot move) and how a stop string
straddling the seam is caught on the real tokenizer. The end-to-end tests (a real engine killed
mid-stream) are in test_fleet_engine_death.py."""

from __future__ import annotations

import pytest

from rollout_service.engine.sampling import SamplingOptions
from rollout_service.engine.types import GenerateRequest, GenerationChunk
from rollout_service.fleet.migration import Progress, merge_spans, unmovable
from rollout_service.serve.seams import SeamStops


def _req(**sampling) -> GenerateRequest:
    return GenerateRequest(prompt_ids=[1, 2, 3], sampling=SamplingOptions.validated(**sampling), max_tokens=10)


def _chunk(ids, version="v1", spans=None, finish=None, migrations=0) -> GenerationChunk:
    return GenerationChunk(token_ids=list(ids), logprobs=[-0.5] * len(ids), weight_version=version,
                           weight_versions=spans, finish_reason=finish, migrations=migrations)


def test_a_continuation_starts_from_prompt_plus_generated_ids_with_the_tokens_left():
    p = Progress(_req(seed=7, temperature=0.7))
    assert p.take(_chunk([10, 11], spans=[("v1", 0, 2)])).migrations == 0
    p.take(_chunk([12], spans=[("v1", 0, 3)]))
    nxt = p.continuation()
    assert nxt.prompt_ids == [1, 2, 3, 10, 11, 12] and nxt.max_tokens == 7
    assert nxt.sampling == p.request.sampling and nxt.request_id != p.request.request_id
    # The next engine's chunks: spans shifted past the seam and merged, the original prompt length.
    out = p.take(GenerationChunk(token_ids=[13, 14], logprobs=[-1, -1], weight_version="v2",
                                 weight_versions=[("v2", 0, 2)], num_prompt_tokens=6))
    assert out.migrations == 1 and out.num_prompt_tokens == 3
    assert out.weight_versions == [("v1", 0, 3), ("v2", 3, 5)]
    final = p.take(_chunk([15], spans=[("v2", 0, 3)], finish="length"))
    assert final.weight_versions == [("v1", 0, 3), ("v2", 3, 6)] and p.finished
    assert p.ids == [10, 11, 12, 13, 14, 15]


def test_spans_of_one_version_on_both_sides_of_the_seam_are_one_span():
    p = Progress(_req())
    p.take(_chunk([10, 11], spans=[("v1", 0, 2)]))
    p.continuation()
    out = p.take(_chunk([12], spans=[("v1", 0, 1)], finish="stop", migrations=0))
    assert out.weight_versions == [("v1", 0, 3)]
    assert merge_spans([("a", 0, 2), ("a", 2, 2), ("a", 2, 4), ("b", 4, 5)]) == [("a", 0, 4), ("b", 4, 5)]


def test_a_generation_without_exact_spans_is_not_continued():
    """An engine that labels its chunks only (no spans on each): the version it had when it sent a
    chunk is not always the one that produced it, so the spans across a seam would be a guess."""
    p = Progress(_req())
    p.take(_chunk([10, 11], version="v1"))
    p.take(_chunk([12], version="v2"))
    reason = unmovable(p.request, p)
    assert reason is not None and "weight version" in reason
    exact = Progress(_req())
    exact.take(_chunk([10, 11], spans=[("v1", 0, 2)]))
    assert unmovable(exact.request, exact) is None


def test_an_engine_lost_after_the_last_allowed_id_ends_the_call_with_length():
    p = Progress(GenerateRequest(prompt_ids=[1], sampling=SamplingOptions.validated(), max_tokens=2))
    p.take(_chunk([10, 11], spans=[("v1", 0, 2)]))
    assert p.continuation() is None
    end = p.length_end(0)
    assert end.finish_reason == "length" and end.token_ids == [] and end.weight_versions == [("v1", 0, 2)]
    assert end.migrations == 1


@pytest.mark.parametrize("sampling, movable", [
    ({}, True),
    ({"temperature": 0.3, "top_p": 0.9, "top_k": 5, "repetition_penalty": 1.2, "stop": ["x"], "seed": 3}, True),
    ({"presence_penalty": 0.5}, False),
    ({"frequency_penalty": -0.2}, False),
    ({"structured_outputs": {"json_object": True}}, False),
])
def test_what_cannot_continue_on_another_engine_says_why(sampling, movable):
    reason = unmovable(_req(**sampling))
    assert (reason is None) == movable
    if reason:
        assert "grammar" in reason or "penalties" in reason


# ------------------------------------------------------------------ stop strings across the seam
def _ids(tok, text):
    return tok.encode(text, add_special_tokens=False)


def test_a_stop_string_straddling_the_seam_ends_the_call_on_the_id_that_completes_it(tiny_tokenizer):
    tok = tiny_tokenizer
    before, after = _ids(tok, "The answer is DO"), _ids(tok, "NE and more text after it")
    seams = SeamStops(tok, ["DONE"], skip_special_tokens=True)
    assert seams.feed(_chunk(before)).finish_reason is None
    cut = seams.feed(_chunk(after, migrations=1, spans=[("v1", 0, len(before) + len(after))]))
    assert cut.finish_reason == "stop" and cut.stop_reason == "DONE"
    kept = before + cut.token_ids
    text = tok.decode(kept)
    assert "DONE" in text, text
    assert "DONE" not in tok.decode(kept[:-1])  # the last id kept is the one that completed it
    assert len(cut.logprobs) == len(cut.token_ids)
    assert cut.weight_versions == [("v1", 0, len(kept))]


def test_stop_strings_not_across_a_seam_are_left_to_the_engine(tiny_tokenizer):
    tok = tiny_tokenizer
    seams = SeamStops(tok, ["DONE"], skip_special_tokens=True)
    # No migration: the engine matched its own stop strings; nothing is cut here.
    chunk = _chunk(_ids(tok, "all DONE here"))
    assert seams.feed(chunk) is chunk
    # A seam whose both sides hold no straddling stop string: passed on untouched, also later.
    seams = SeamStops(tok, ["DONE"], skip_special_tokens=True)
    seams.feed(_chunk(_ids(tok, "first part ")))
    a = _chunk(_ids(tok, "second part, long enough to close the seam"), migrations=1)
    assert seams.feed(a) is a and seams.seam is None
    b = _chunk(_ids(tok, " DO"))
    assert seams.feed(b) is b


def test_a_stop_string_completed_by_a_later_chunk_after_the_seam(tiny_tokenizer):
    tok = tiny_tokenizer
    seams = SeamStops(tok, ["<END>", "zzz"], skip_special_tokens=True)
    seams.feed(_chunk(_ids(tok, "result: <E")))
    first = _chunk(_ids(tok, "N"), migrations=1)
    assert seams.feed(first) is first  # not complete yet
    cut = seams.feed(_chunk(_ids(tok, "D> trailing words")))
    assert cut.finish_reason == "stop" and cut.stop_reason == "<END>"
    assert "<END>" in tok.decode(seams.ids) and "<END>" not in tok.decode(seams.ids[:-1])


def test_kv_versions_follow_the_resets_a_refit_and_a_seam_make():
    from rollout_service.engine.types import kv_spans

    # A refit that kept the KV: v2's ids attended to v1's KV.
    assert kv_spans([("v1", 0, 3), ("v2", 3, 6)], []) == [("v1", 0, 3, "v1"), ("v2", 3, 6, "v1")]
    # One that cleared it (recomputed at resume, reset at v2's first id): pure again; a later refit
    # that kept it: v3 over v2's KV.
    assert kv_spans([("v1", 0, 3), ("v2", 3, 6), ("v3", 6, 8)], [3]) == [
        ("v1", 0, 3, "v1"), ("v2", 3, 6, "v2"), ("v3", 6, 8, "v2")]
    # A reset inside a span splits it; None (an engine that keeps no record) is no reset.
    assert kv_spans([("v1", 0, 2), ("v2", 2, 6)], [4]) == [("v1", 0, 2, "v1"), ("v2", 2, 4, "v1"), ("v2", 4, 6, "v2")]
    assert kv_spans([("v1", 0, 4)], None) == [("v1", 0, 4, "v1")]
    # The prompt's KV came from the version the request started on: a refit that kept it before the
    # first sampled id leaves every id mixed; one that cleared it resets at 0.
    assert kv_spans([("v2", 0, 3)], [], base="v1") == [("v2", 0, 3, "v1")]
    assert kv_spans([("v2", 0, 3)], [0], base="v1") == [("v2", 0, 3, "v2")]
    # A migration: the next engine prefills prompt + ids anew, so the seam is a reset even where
    # the version does not change; the engine's own resets are shifted past the seam.
    p = Progress(_req())
    p.take(GenerationChunk(token_ids=[10, 11], logprobs=[-1, -1], weight_versions=[("v1", 0, 1), ("v2", 1, 2)],
                           kv_resets=[]))
    p.continuation()
    out = p.take(GenerationChunk(token_ids=[12, 13, 14], logprobs=[-1] * 3, weight_versions=[("v2", 0, 1), ("v3", 1, 3)],
                                 kv_resets=[1], finish_reason="length"))
    assert out.weight_versions == [("v1", 0, 1), ("v2", 1, 3), ("v3", 3, 5)] and out.kv_resets == [2, 3]
    assert kv_spans(out.weight_versions, out.kv_resets) == [
        ("v1", 0, 1, "v1"), ("v2", 1, 2, "v1"), ("v2", 2, 3, "v2"), ("v3", 3, 5, "v3")]
