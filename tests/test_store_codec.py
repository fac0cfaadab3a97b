"""The stored byte layout: records written before a field existed still decode, and so do records
written by newer code (a rolling deploy); a decoded delta is what a reload shows."""

from __future__ import annotations

import json
import random

import numpy as np

from rollout_service.onpolicy.types import RolloutState, TurnRecord, WeightSpan
from rollout_service.store.codec import decode_delta, encode_delta
from synthetic_rollouts import synthetic_delta

OLD_RECORD = ('{"turn":3,"prompt_start":10,"gen_start":14,"gen_end":20,"finish_reason":"stop","monotonic":true,'
              '"weight_versions":[{"version":"v1","start":14,"end":20}]}')


def test_a_record_written_before_replay_fields_existed_decodes_with_none():
    rec = TurnRecord.from_dict(json.loads(OLD_RECORD))
    assert rec == TurnRecord(3, 10, 14, 20, "stop", True, [WeightSpan("v1", 14, 20)])
    assert rec.request_digest is None and rec.idempotency_key is None and rec.answer is None


def test_a_record_without_replay_data_encodes_as_before():
    rec = TurnRecord.from_dict(json.loads(OLD_RECORD))
    assert json.dumps(rec.to_dict(), separators=(",", ":")) == OLD_RECORD


def test_unknown_record_fields_from_newer_code_are_ignored():
    doc = {**json.loads(OLD_RECORD), "answer": {"message": {"role": "assistant", "content": "x"}, "stop_reason": None},
           "sampled_by": "a future field"}
    rec = TurnRecord.from_dict(doc)
    assert rec.answer == {"message": {"role": "assistant", "content": "x"}, "stop_reason": None}
    assert not hasattr(rec, "sampled_by")


def test_constrained_is_stored_only_when_true_and_read_back():
    rec = TurnRecord.from_dict(json.loads(OLD_RECORD))
    assert rec.constrained is False and "constrained" not in rec.to_dict()
    rec.constrained = True
    assert TurnRecord.from_dict(json.loads(json.dumps(rec.to_dict()))).constrained is True


def test_decoded_delta_is_what_a_reload_shows_and_shares_nothing():
    d = synthetic_delta(random.Random(0), turn=1, segment_index=0, new_segment=True, segment_len=0)
    d.new_messages.append({"role": "user", "content": "t", "args": (1, 2)})
    d.record.answer = {"message": {"role": "assistant", "content": "a"}, "stop_reason": None}
    back = decode_delta(encode_delta(d, expected_turn=0))
    assert back.token_ids == d.token_ids and back.loss_mask == d.loss_mask
    assert back.logprobs == np.asarray(d.logprobs, dtype=np.float32).tolist()
    assert back.new_messages[-1]["args"] == [1, 2]
    assert back.record == d.record and back.record is not d.record
    assert back.record.answer is not d.record.answer and back.render_context is not d.render_context
    state = back.apply(RolloutState("r"))
    assert state.turn == 1 and state.segments[0].turns == [d.record]


def test_a_mixed_spans_kv_version_is_stored_beside_the_spans_where_older_readers_ignore_it():
    import json

    from rollout_service.onpolicy.types import TurnRecord, WeightSpan

    rec = TurnRecord(turn=1, prompt_start=0, gen_start=2, gen_end=8, finish_reason="length", monotonic=True,
                     weight_versions=[WeightSpan("v1", 2, 5), WeightSpan("v2", 5, 8, "v1")])
    stored = json.loads(json.dumps(rec.to_dict()))
    assert stored["weight_versions"] == [{"version": "v1", "start": 2, "end": 5}, {"version": "v2", "start": 5, "end": 8}]
    assert stored["kv_versions"] == [None, "v1"]
    back = TurnRecord.from_dict(stored)
    assert back == rec and [w.to_dict()["kv_version"] for w in back.weight_versions] == ["v1", "v1"]
    pure = TurnRecord(turn=1, prompt_start=0, gen_start=0, gen_end=3, finish_reason="stop", monotonic=True,
                      weight_versions=[WeightSpan("v1", 0, 3)])
    assert "kv_versions" not in pure.to_dict()  # records of pure spans are as they always were
