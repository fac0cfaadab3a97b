"""truncate_prompt_tokens as vLLM's renderer applies it (serve/truncation.py); the served behaviour
is compared with vLLM's own server in test_serve_vs_vllm.py (the truncate cases)."""

from __future__ import annotations

import pytest

from rollout_service.serve.protocol.envelope import ServiceError
from rollout_service.serve.truncation import fitted, truncated

IDS = [10, 11, 12, 13, 14]


def test_a_prompt_is_cut_from_the_side_asked_left_by_default():
    assert truncated(IDS, 3, None, max_model_len=64, max_tokens=16) == [12, 13, 14]  # vLLM's tokenizer: left
    assert truncated(IDS, 3, "left", max_model_len=64, max_tokens=16) == [12, 13, 14]
    assert truncated(IDS, 2, "right", max_model_len=64, max_tokens=16) == [10, 11]
    assert truncated(IDS, None, "right", max_model_len=64, max_tokens=16) is IDS
    assert truncated(IDS, 5, None, max_model_len=64, max_tokens=16) is IDS  # nothing to cut


def test_minus_one_is_the_context_less_one_with_max_tokens_and_the_bounds_are_vllms():
    long = list(range(100))
    assert truncated(long, -1, None, max_model_len=64, max_tokens=16) == long[-63:]
    assert truncated(long, -1, None, max_model_len=64, max_tokens=None) == long[-64:]
    with pytest.raises(ServiceError) as beyond:
        truncated(IDS, 65, None, max_model_len=64, max_tokens=16)
    assert beyond.value.status == 400 and beyond.value.param == "truncate_prompt_tokens"
    with pytest.raises(ServiceError) as nothing:
        truncated(IDS, 0, None, max_model_len=64, max_tokens=16)
    assert nothing.value.status == 400


def test_max_tokens_fits_the_room_a_cut_prompt_leaves():
    assert fitted(60, 10, 64) == 54  # within the context: as much as there is room for (vLLM's get_max_tokens)
    assert fitted(8, 10, 64) == 8
    assert fitted(None, 10, 64) is None
    assert fitted(100, 10, 64) == 100  # beyond the context: left to the usual 400
