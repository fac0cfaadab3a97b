"""UK AISI's inspect-ai 0.3 driving the service as it drives a vLLM server (its ``vllm`` provider with
``base_url``), in its own venv (tests/inspect_ai_thinking.py): the edge-whitespace rule
(``service.whitespace_policy: edges``, the default) against inspect's real re-serialization.

The tiny model's answers are reasoning-only under the default template (thinking on): the service
answers ``content: null`` with ``reasoning_content``; inspect re-sends each such answer as
``content: "\\n"`` beside its reasoning. The stored tokens are what the model saw, so that is not an
edit: the three calls stay one segment. Whitespace changed *inside* an answer's content is an edit
(a fork), and an answer sent back as inspect keeps it (thinking off: plain content) continues."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import httpx
import pytest

from serve_helpers import MODEL

SEED = 7


def _stored(service, rid: str) -> dict:
    r = httpx.get(f"{service.url}/v1/rollouts/{rid}", timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def _sampled_logprobs(stored: dict) -> list[float]:
    return [lp for seg in stored["segments"] for lp, m in zip(seg["logprobs"], seg["loss_mask"]) if m]


@pytest.fixture(scope="module")
def inspect_runs(service):
    venv = Path(__file__).resolve().parents[1] / ".venv" / "inspect-ai-0.3"  # scripts/setup_test_clients.sh
    if not (venv / ".installed").exists():
        pytest.fail(f"inspect-ai is not installed in {venv}: run scripts/setup_test_clients.sh")
    driver = Path(__file__).with_name("inspect_ai_thinking.py")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    proc = subprocess.run([str(venv / "bin" / "python"), str(driver), service.url, MODEL, str(SEED)],
                          capture_output=True, text=True, timeout=240, env=env, cwd=driver.parent)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_inspect_ai_re_serialized_thinking_answers_keep_the_rollout_one_segment(service, inspect_runs):
    conv = inspect_runs["thinking"]
    calls = conv["calls"]
    for i, call in enumerate(calls):
        assert call["content"] == "" and call["reasoning"], call  # reasoning-only: content null on the wire
        # what inspect sent back for each past answer: "\n" as content, the reasoning beside it
        assert [m["content"] for m in call["sent_assistants"]] == ["\n"] * i
        assert [m["reasoning_content"] for m in call["sent_assistants"]] == [c["reasoning"] for c in calls[:i]]
    stored = _stored(service, conv["id"])
    assert stored["turns"] == 3
    assert len(stored["segments"]) == 1, "inspect's \"\\n\" for a null content was taken as an edit"
    assert all(t["monotonic"] for t in stored["segments"][0]["turns"])
    assert _sampled_logprobs(stored) == [lp for c in calls for lp in c["logprobs"]]


def test_whitespace_changed_inside_an_answer_is_still_an_edit(service, inspect_runs):
    plain, inner = inspect_runs["plain"], inspect_runs["inner"]
    first = plain["calls"][0]["content"]
    assert first.strip() and inner["calls"][0]["content"] == first  # same first call (seed), content this time
    assert plain["calls"][1]["sent_assistants"][0]["content"] == first  # inspect re-sends it as it was
    kept_msg, edited_msg = plain["calls"][1]["sent_assistants"][0], inner["calls"][1]["sent_assistants"][0]
    assert {**kept_msg, "content": None} == {**edited_msg, "content": None}  # only the content differs
    edited = edited_msg["content"]
    assert edited != first and edited.strip() != first.strip() and "".join(edited.split()) == "".join(first.split())

    kept = _stored(service, plain["id"])
    assert [len(s["turns"]) for s in kept["segments"]] == [2]
    forked = _stored(service, inner["id"])
    assert [len(s["turns"]) for s in forked["segments"]] == [1, 1]
    assert forked["segments"][1]["turns"][0]["monotonic"] is False
    for conv, stored in ((plain, kept), (inner, forked)):
        assert _sampled_logprobs(stored) == [lp for c in conv["calls"] for lp in c["logprobs"]]
