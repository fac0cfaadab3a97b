"""The token-in-token-out route against vLLM's own: vLLM 0.32's OpenAI server with
``--enable-scale-out`` (its ``POST /inference/v1/generate``) on the tiny model with the session
service's engine settings, and the service's route, the same requests (each with its seed,
streamed and not, temperatures and top_p that differ, 1-3 alternatives): the same ids, bit for bit,
the same logprobs within 1e-6, the same alternatives. The two servers never generate at once
(vLLM's answers first, then the service's); scripts/compare_tito_vllm.py is the longer run."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import pytest

from serve_helpers import MODEL

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

REQUESTS, MAX_TOKENS = 4, 12


@pytest.fixture(scope="module")
def vllms_answers(service, tiny_model_dir):
    from bench_service_vs_vllm import SERVED_NAME
    from compare_tito_vllm import requests, run_all, tito_server

    reqs = requests(REQUESTS, MAX_TOKENS)
    with tempfile.TemporaryDirectory(prefix="tito-vllm-") as tmp:
        server = tito_server(service.config.engine, str(tiny_model_dir), Path(tmp) / "vllm.log")
        try:
            server.start(timeout=300)
            answers = run_all(server.url, SERVED_NAME, reqs)
        finally:
            server.stop()
    return reqs, answers


def test_the_route_answers_as_vllms_own_server_on_the_same_requests(service, vllms_answers):
    from compare_tito_vllm import run_all

    reqs, theirs = vllms_answers
    ours = run_all(service.url, MODEL, reqs)
    assert {r["stream"] for r in reqs} == {True, False}
    for body, (ids_v, lps_v, tops_v), (ids_s, lps_s, tops_s) in zip(reqs, theirs, ours):
        assert len(ids_v) == MAX_TOKENS
        assert ids_s == ids_v, body
        assert lps_s == pytest.approx(lps_v, abs=1e-6), body
        assert [[t for t, _ in row] for row in tops_s] == [[t for t, _ in row] for row in tops_v], body
        assert all(len(row) >= 1 for row in tops_v)
        assert [lp for row in tops_s for _, lp in row] == pytest.approx([lp for row in tops_v for _, lp in row], abs=1e-6)
