"""NeMo Gym 0.7's ``required_prefix_token_ids`` over HTTP: the prompt is the given ids, kept bit-exact,
+ the template's tail for the messages after the last assistant message; the answer proves it
(``prompt_token_ids``, top-level with ``return_token_ids`` as vLLM does). Driven with plain HTTP and
with NeMo Gym 0.7's own ``vllm_model`` client (``supply_prefix_token_ids: true``), which sends the
field itself and refuses an answer whose prompt does not start with it. Malformed ids and messages
that cannot continue the prefix are in tests/test_serve_bad_input.py's table too."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from serve_helpers import IM_END, MODEL, expected_tail_text


REPO = Path(__file__).resolve().parents[1]
GYM = REPO / ".venv" / "nemo-gym-0.7"  # installed there by scripts/setup_test_clients.sh
SKIN, NY, SKINNY = 26951, 3834, 94224  # " Skin" + "ny": the text re-tokenizes to the one id " Skinny"


def _chat(http, messages, headers=None, **fields):
    body = {"model": MODEL, "messages": messages, "max_tokens": 4, "seed": 7, **fields}
    return http.post("/v1/chat/completions", json=body, headers=headers or {})


def _fresh_prompt(http, messages) -> list[int]:
    r = http.post("/tokenize", json={"model": MODEL, "messages": messages})
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def _tail(tok, new_messages, ended_with_eot: bool) -> list[int]:
    return tok.encode(expected_tail_text(new_messages, ended_with_eot), add_special_tokens=False)


def test_prefix_ids_are_kept_where_re_tokenizing_the_text_would_merge_them(http, tiny_tokenizer):
    first = [{"role": "user", "content": "Describe the jeans."}]
    gen = [SKIN, NY, IM_END]
    assert tiny_tokenizer.encode(tiny_tokenizer.decode([SKIN, NY]), add_special_tokens=False) == [SKINNY]
    prefix = _fresh_prompt(http, first) + gen
    new = [{"role": "user", "content": "Tighter?"}]
    messages = first + [{"role": "assistant", "content": " Skinny"}] + new
    r = _chat(http, messages, required_prefix_token_ids=prefix, return_token_ids=True)
    assert r.status_code == 200, r.text
    out = r.json()
    prompt = out["choices"][0]["message"]["prompt_token_ids"]
    assert prompt == prefix + _tail(tiny_tokenizer, new, ended_with_eot=True)
    # return_token_ids, as vLLM answers it: the prompt at the top level, the generated ids on the choice
    assert out["prompt_token_ids"] == prompt
    assert out["choices"][0]["token_ids"] == out["choices"][0]["message"]["generation_token_ids"]
    # The same messages without the prefix: the text re-tokenizes, the split ids are gone.
    plain = _fresh_prompt(http, messages)
    assert SKINNY in plain and SKIN not in plain and plain != prompt
    r = http.post("/tokenize", json={"model": MODEL, "messages": messages, "required_prefix_token_ids": prefix})
    assert r.json()["tokens"] == prompt  # /tokenize honours the prefix the same way


def test_responses_dialect_takes_the_prefix_too(http, tiny_tokenizer):
    first = [{"role": "user", "content": "Describe the jeans."}]
    prefix = _fresh_prompt(http, first) + [SKIN, NY, IM_END]
    new = [{"role": "user", "content": "Tighter?"}]
    body = {"model": MODEL, "input": first + [{"type": "message", "role": "assistant", "content": " Skinny"}] + new,
            "max_output_tokens": 4, "required_prefix_token_ids": prefix}
    r = http.post("/v1/responses", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["output"][-1]["prompt_token_ids"] == prefix + _tail(tiny_tokenizer, new, ended_with_eot=True)


def test_prefix_of_a_real_previous_call_cut_by_max_tokens_is_closed_like_the_template(http, tiny_tokenizer):
    first = [{"role": "user", "content": "Tell me about Paris."}]
    one = _chat(http, first, max_tokens=6, ignore_eos=True).json()["choices"][0]["message"]
    assert one["generation_token_ids"][-1] != IM_END
    prefix = one["prompt_token_ids"] + one["generation_token_ids"]
    new = [{"role": "user", "content": "And Rome?"}]
    assistant = {"role": "assistant", "content": one["content"] or "", "reasoning_content": one.get("reasoning_content")}
    r = _chat(http, first + [assistant] + new, required_prefix_token_ids=prefix)
    assert r.status_code == 200, r.text
    two = r.json()["choices"][0]["message"]
    assert two["prompt_token_ids"] == prefix + _tail(tiny_tokenizer, new, ended_with_eot=False)
    assert two["rollout"] is None  # stateless: nothing stored


def test_stored_rollout_takes_a_prefix_that_agrees_and_refuses_one_that_does_not(http):
    rid = f"rp-{uuid.uuid4().hex[:8]}"
    hdr = {"X-Rollout-Id": rid}
    first = [{"role": "user", "content": "Count to three."}]
    one = _chat(http, first, headers=hdr).json()["choices"][0]["message"]
    messages = first + [{"role": "assistant", "content": one["content"] or ""}, {"role": "user", "content": "Go on."}]
    before = http.get(f"/v1/rollouts/{rid}").content
    wrong = one["prompt_token_ids"] + one["generation_token_ids"][:-1] + [(one["generation_token_ids"][-1] + 1) % 1000]
    r = _chat(http, messages, headers=hdr, required_prefix_token_ids=wrong)
    assert r.status_code == 409, r.text
    err = r.json()["error"]
    assert (err["code"], err["param"]) == ("prefix_mismatch", "required_prefix_token_ids")
    assert f"differ at position {len(wrong) - 1}" in err["message"]
    assert http.get(f"/v1/rollouts/{rid}").content == before
    prefix = one["prompt_token_ids"] + one["generation_token_ids"]
    r = _chat(http, messages, headers=hdr, required_prefix_token_ids=prefix)
    assert r.status_code == 200, r.text
    two = r.json()["choices"][0]["message"]
    assert two["prompt_token_ids"][: len(prefix)] == prefix and two["rollout"]["monotonic"]
    seg = http.get(f"/v1/rollouts/{rid}").json()["segments"]
    assert len(seg) == 1 and seg[0]["token_ids"] == two["prompt_token_ids"] + two["generation_token_ids"]


def test_a_rollouts_first_call_with_a_prefix_starts_its_segment_from_it(http, tiny_tokenizer):
    rid = f"rp-{uuid.uuid4().hex[:8]}"
    first = [{"role": "user", "content": "Describe the jeans."}]
    prefix = _fresh_prompt(http, first) + [SKIN, NY, IM_END]
    new = [{"role": "user", "content": "Tighter?"}]
    r = _chat(http, first + [{"role": "assistant", "content": " Skinny"}] + new, headers={"X-Rollout-Id": rid},
              required_prefix_token_ids=prefix)
    assert r.status_code == 200, r.text
    msg = r.json()["choices"][0]["message"]
    assert msg["prompt_token_ids"] == prefix + _tail(tiny_tokenizer, new, ended_with_eot=True)
    (seg,) = http.get(f"/v1/rollouts/{rid}").json()["segments"]
    n = len(msg["prompt_token_ids"])
    assert seg["token_ids"] == msg["prompt_token_ids"] + msg["generation_token_ids"]
    assert seg["loss_mask"] == [0] * n + [1] * len(msg["generation_token_ids"])  # the prefix is prompt here


def test_streamed_call_sends_the_prompt_ids_first_like_vllm(http, tiny_tokenizer):
    first = [{"role": "user", "content": "Describe the jeans."}]
    prefix = _fresh_prompt(http, first) + [SKIN, NY, IM_END]
    new = [{"role": "user", "content": "Tighter?"}]
    body = {"model": MODEL, "messages": first + [{"role": "assistant", "content": " Skinny"}] + new, "max_tokens": 4,
            "seed": 7, "stream": True, "return_token_ids": True, "required_prefix_token_ids": prefix}
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert chunks[0]["prompt_token_ids"] == prefix + _tail(tiny_tokenizer, new, ended_with_eot=True)
    assert all("prompt_token_ids" not in c for c in chunks[1:])
    final = chunks[-1]["choices"][0]
    assert [t for c in chunks for t in c["choices"][0].get("token_ids") or []] == final["delta"]["generation_token_ids"]
    assert final["delta"]["prompt_token_ids"] == chunks[0]["prompt_token_ids"]


def test_empty_prefix_is_no_constraint(http):
    messages = [{"role": "user", "content": "hi"}]
    a = _chat(http, messages).json()["choices"][0]["message"]
    b = _chat(http, messages, required_prefix_token_ids=[]).json()["choices"][0]["message"]
    assert a["prompt_token_ids"] == b["prompt_token_ids"]


# ---------------------------------------------------------------------------------------- NeMo Gym 0.7


@pytest.fixture(scope="module")
def gym_run(service, tmp_path_factory):
    """NeMo Gym 0.7's VLLMModel (configured for training with prefix supply) driven against the service by
    tests/nemo_gym_driver.py, in its own process with Gym's pinned openai; returns what the driver saw
    and the requests / answers Gym's own transport log recorded."""
    if not (GYM / ".installed").exists():
        pytest.fail(f"NeMo Gym 0.7 is not installed in {GYM}: run scripts/setup_test_clients.sh")
    root = tmp_path_factory.mktemp("gym")
    log = root / "transport.jsonl"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(GYM / "pins"), str(GYM)]),  # Gym's openai pin first
           "NEMO_GYM_VLLM_TRANSPORT_LOG": str(log),
           "NEMO_GYM_CONFIG_DICT": json.dumps({"token_id_capture": {"enabled": True, "dir": str(root / "capture")}})}
    proc = subprocess.run([sys.executable, "-W", "ignore", str(REPO / "tests" / "nemo_gym_driver.py"),
                           f"{service.url}/v1", MODEL, "3"], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    events = [json.loads(line) for line in log.read_text().splitlines()]
    requests = [e["request_payload"] for e in events if e["event"] == "transport_request"]
    answers = [e["raw_response"] for e in events if e["event"] == "transport_response"]
    assert len(requests) == len(answers), events
    return json.loads(proc.stdout.strip().splitlines()[-1]), list(zip(requests, answers))


@pytest.mark.parametrize("dialect", ["chat", "responses"])
def test_nemo_gym_client_with_prefix_supply_gets_its_prefix_proven(gym_run, dialect):
    """Three calls of one Gym rollout through Gym's own server code (its /v1/chat/completions, or its
    /v1/responses, which converts to chat and echoes token ids on the assistant message): from the
    second call on Gym sends required_prefix_token_ids = the parent's prompt + generation, checks
    that the answer's prompt_token_ids start with it, and records the call as prefix-supplied."""
    seen, sent = gym_run
    run = seen[dialect]
    assert [a["status"] for a in run["answers"]] == [200, 200, 200], run["answers"][-1]["body"][-2000:]
    first = 0 if dialect == "chat" else 3  # the driver runs chat, then responses
    calls = sent[first:first + 3]
    assert "required_prefix_token_ids" not in calls[0][0]  # a root call has no parent
    for (_, prev_answer), (request, answer) in zip(calls, calls[1:]):
        prev = prev_answer["choices"][0]["message"]
        parent = prev["prompt_token_ids"] + prev["generation_token_ids"]
        assert request["required_prefix_token_ids"] == parent
        assert answer["choices"][0]["message"]["rollout"] is None  # no rollout id: stateless on our side
        if dialect == "responses":  # Gym's converter also echoes the parent's ids on the assistant message
            echoed = [m for m in request["messages"] if m.get("prompt_token_ids") is not None][-1]
            assert echoed["prompt_token_ids"] + echoed["generation_token_ids"] == parent
        prompt = answer["choices"][0]["message"]["prompt_token_ids"]
        assert prompt[: len(parent)] == parent and len(prompt) > len(parent)
    assert run["entries"] == [[False, False], [True, True], [True, True]]
