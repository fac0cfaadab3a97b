"""Token in, token out (``POST /inference/v1/generate``, vLLM 0.32's route) on the real app and engine:
answers parse as vLLM's own response models and equal a raw completion on the same ids and seed;
with a rollout id the calls are recorded turns — continued when the ids start with the stored
prompt + generation, forked (or 409 under reject) when they do not, replayed for a retry; streamed
answers carry the same ids; bad input is a 400 that stores nothing."""

from __future__ import annotations

import json
import uuid

import pytest

from serve_helpers import IM_END, MODEL

ROUTE = "/inference/v1/generate"
PROMPT = [151644, 872, 198, 9707, 11, 1879, 0, 151645, 198, 151644, 77091, 198]  # <|im_start|>user\nHello, world!...
TAIL = [151644, 872, 198, 3838, 1790, 30, 151645, 198, 151644, 77091, 198]  # the next user message + generation prompt


def _generate(http, token_ids, rid=None, headers=None, **sampling):
    body = {"model": MODEL, "token_ids": token_ids,
            "sampling_params": {"max_tokens": 6, "seed": 11, "logprobs": 1, "skip_special_tokens": False,
                                "stop_token_ids": [IM_END], **sampling}}
    h = dict(headers or {})
    if rid is not None:
        h["X-Session-ID"] = rid  # prime-rl's header (X-Rollout-Id works the same)
    return http.post(ROUTE, json=body, headers=h)


def _answer(r):
    from vllm.entrypoints.scale_out.token_in_token_out.protocol import GenerateTokensResponse

    assert r.status_code == 200, r.text
    out = GenerateTokensResponse.model_validate(r.json())  # vLLM's own response model
    (choice,) = out.choices
    ids = list(choice.token_ids)
    lps = [c.logprob for c in choice.logprobs.content]
    assert [c.token_id for c in choice.logprobs.content] == ids
    return out, choice, ids, lps


def test_a_stateless_call_answers_as_vllms_route_with_the_ids_of_a_raw_completion(http):
    r = _generate(http, PROMPT, max_tokens=8, ignore_eos=True, stop_token_ids=[])
    out, choice, ids, lps = _answer(r)
    out_raw = r.json()
    assert len(ids) == 8 and choice.finish_reason == "length" and out.usage.prompt_tokens == len(PROMPT)
    assert out.request_id.startswith("generate-tokens-") and out.model == MODEL
    # the string form earlier releases answered (prime-rl's renderers checks it) rides along
    assert [e["token"] for e in out_raw["choices"][0]["logprobs"]["content"]] == [f"token_id:{t}" for t in ids]
    # vLLM lists the sampled id first among the alternatives (logprobs: 1 = one entry)
    assert all(len(c.top_logprobs) == 1 and c.top_logprobs[0].token_id == c.token_id for c in choice.logprobs.content)
    assert choice.weight_versions and choice.weight_versions[0].start == 0 and choice.weight_versions[-1].end == 8
    raw = http.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "seed": 11,
                                             "ignore_eos": True, "return_token_ids": True})
    assert raw.status_code == 200, raw.text
    c = raw.json()["choices"][0]
    assert c["token_ids"] == ids
    assert c["generation_log_probs"] == pytest.approx(lps, abs=1e-6)


def test_recorded_turns_continue_on_their_ids_fork_on_an_edit_and_replay_a_retry(http):
    rid = f"tito-{uuid.uuid4().hex[:8]}"
    _, _, g1, l1 = _answer(_generate(http, PROMPT, rid, ignore_eos=True, stop_token_ids=[]))
    p2 = PROMPT + g1 + TAIL  # the previous prompt + generation, then what the client added
    r2 = _generate(http, p2, rid, headers={"Idempotency-Key": "turn-2"}, seed=12, max_tokens=5)
    _, c2, g2, l2 = _answer(r2)
    traj = http.get(f"/v1/rollouts/{rid}").json()
    (seg,) = traj["segments"]
    assert traj["turns"] == 2 and seg["token_ids"] == p2 + g2
    assert [t for t, m in zip(seg["token_ids"], seg["loss_mask"]) if m] == g1 + g2  # only generated ids
    assert [lp for lp, m in zip(seg["logprobs"], seg["loss_mask"]) if m] == l1 + l2
    assert all(t["monotonic"] for t in seg["turns"])
    # A retry (same Idempotency-Key) is answered from the store: same ids, nothing stored.
    _, _, again, again_lps = _answer(_generate(http, p2, rid, headers={"Idempotency-Key": "turn-2"}, seed=12, max_tokens=5))
    assert again == g2 and again_lps == l2 and http.get(f"/v1/rollouts/{rid}").json()["turns"] == 2
    # An edited history: under reject a 409 naming the position; by default a fork (a new segment).
    edited = PROMPT[:-2] + [9707] + PROMPT[-1:] + g1 + g2 + TAIL
    r = _generate(http, edited, rid, headers={"X-History-Policy": "reject"})
    assert r.status_code == 409 and r.json()["error"]["code"] == "non_monotonic_history", r.text
    assert "position" in r.json()["error"]["message"]
    _, _, g3, _ = _answer(_generate(http, edited, rid))
    traj = http.get(f"/v1/rollouts/{rid}").json()
    assert traj["turns"] == 3 and len(traj["segments"]) == 2
    assert traj["segments"][1]["token_ids"] == edited + g3 and not traj["segments"][1]["turns"][0]["monotonic"]


def test_a_streamed_turn_streams_vllms_chunks_with_the_stored_ids(http):
    from vllm.entrypoints.scale_out.token_in_token_out.protocol import GenerateTokensStreamResponse

    rid = f"tito-s-{uuid.uuid4().hex[:8]}"
    body = {"model": MODEL, "token_ids": PROMPT, "stream": True, "stream_options": {"include_usage": True},
            "return_token_ids": True,
            "sampling_params": {"max_tokens": 10, "seed": 5, "logprobs": 0, "ignore_eos": True}}
    with http.stream("POST", ROUTE, json=body, headers={"X-Rollout-Id": rid}) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    chunks = [GenerateTokensStreamResponse.model_validate(json.loads(line[6:])) for line in lines[:-1]]
    assert chunks[0].prompt_token_ids == PROMPT and all(c.prompt_token_ids is None for c in chunks[1:])
    *tokens, usage = chunks
    assert usage.choices == [] and usage.usage.completion_tokens == 10
    ids = [t for c in tokens for t in c.choices[0].token_ids]
    lps = [e.logprob for c in tokens for e in c.choices[0].logprobs.content]
    assert [c.choices[0].finish_reason for c in tokens] == [None] * (len(tokens) - 1) + ["length"]
    seg = http.get(f"/v1/rollouts/{rid}").json()["segments"][0]
    assert seg["token_ids"] == PROMPT + ids and seg["logprobs"][len(PROMPT):] == lps


@pytest.mark.parametrize("body, status, param", [
    ({"token_ids": [], "sampling_params": {}}, 400, "token_ids"),
    ({"token_ids": [1, -2], "sampling_params": {}}, 400, "token_ids"),
    ({"token_ids": [1, 10**7], "sampling_params": {}}, 400, "token_ids"),
    ({"token_ids": [1] * 1100, "sampling_params": {}}, 400, "token_ids"),
    ({"token_ids": [1], "sampling_params": {"max_tokens": 5000}}, 400, "sampling_params.max_tokens"),
    ({"token_ids": [1], "sampling_params": {"temperature": -1}}, 400, "sampling_params.temperature"),
    ({"token_ids": [1], "sampling_params": {"top_p": "x"}}, 400, "sampling_params"),
    ({"token_ids": [1], "sampling_params": {"bogus": 1}}, 400, "sampling_params.bogus"),
    ({"token_ids": [1], "sampling_params": {"n": 65}}, 400, "sampling_params.n"),
    ({"token_ids": [1], "sampling_params": {"logprobs": -1}}, 400, "sampling_params.logprobs"),
    ({"token_ids": [1], "sampling_params": {"min_tokens": 2}}, 400, "sampling_params.min_tokens"),
    ({"token_ids": [1], "sampling_params": {}, "output_mode": "text"}, 400, "output_mode"),
    ({"token_ids": [1], "sampling_params": {}, "features": {"mm_hashes": {}, "mm_placeholders": {}}}, 400, "features"),
    ({"token_ids": [1]}, 400, "sampling_params"),
    ({"token_ids": [1], "sampling_params": {}, "model": "other"}, 404, "model"),
])
def test_bad_input_is_a_clear_error_and_leaves_the_rollout_as_it_was(http, body, status, param):
    rid = f"tito-bad-{uuid.uuid4().hex[:8]}"
    _answer(_generate(http, PROMPT, rid))
    r = http.post(ROUTE, json={"model": MODEL, **body}, headers={"X-Rollout-Id": rid})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    assert http.get(f"/v1/rollouts/{rid}").json()["turns"] == 1


def test_without_max_tokens_the_generation_may_fill_the_context_as_vllm_allows(http):
    body = {"model": MODEL, "token_ids": [1] * 1020, "sampling_params": {"seed": 1, "ignore_eos": True}}
    out, choice, _, _ = _answer(http.post(ROUTE, json={**body, "sampling_params": {**body["sampling_params"], "logprobs": 0}}))
    assert len(choice.token_ids) == 4 and choice.finish_reason == "length"  # max_model_len 1024


def test_calls_with_the_same_sampling_but_other_ids_are_new_turns_and_vllms_coercions_hold(http):
    """The ids are part of what makes a call the same call (retry detection); values vLLM's model
    coerces ("5", 1) are taken as it takes them, and keys sent at vLLM's defaults are accepted."""
    rid = f"tito-d-{uuid.uuid4().hex[:8]}"
    sampling = {"max_tokens": "5", "seed": 3, "logprobs": 1, "temperature": 1, "ignore_eos": True,
                "bad_words": [], "skip_reading_prefix_cache": False}
    body = {"model": MODEL, "sampling_params": sampling}
    _, _, g1, _ = _answer(http.post(ROUTE, json={**body, "token_ids": PROMPT}, headers={"X-Rollout-Id": rid}))
    assert len(g1) == 5
    _, _, g2, _ = _answer(http.post(ROUTE, json={**body, "token_ids": PROMPT + g1 + TAIL}, headers={"X-Rollout-Id": rid}))
    traj = http.get(f"/v1/rollouts/{rid}").json()
    assert traj["turns"] == 2 and traj["segments"][0]["token_ids"] == PROMPT + g1 + TAIL + g2
    r = http.post(ROUTE, json={**body, "token_ids": PROMPT, "sampling_params": {**sampling, "bad_words": ["x"]}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "sampling_params.bad_words"


def test_continuous_usage_and_the_request_id_header_as_vllm_sends_them(http):
    body = {"model": MODEL, "token_ids": PROMPT, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            "sampling_params": {"max_tokens": 6, "seed": 2, "ignore_eos": True}}
    with http.stream("POST", ROUTE, json=body, headers={"X-Request-Id": "my-req-1"}) as r:
        assert r.status_code == 200
        frames = [json.loads(line[6:]) for line in r.iter_lines() if line and line != "data: [DONE]"]
    assert all(f["request_id"] == "generate-tokens-my-req-1" for f in frames)
    done = 0
    for f in frames[:-1]:
        done += len(f["choices"][0]["token_ids"])
        usage = {k: v for k, v in f["usage"].items() if v is not None}
        assert usage == {"prompt_tokens": len(PROMPT), "completion_tokens": done, "total_tokens": len(PROMPT) + done}
    assert frames[-1]["choices"] == [] and frames[-1]["usage"]["completion_tokens"] == 6


def test_a_body_that_is_not_json_is_a_400(http):
    r = http.post(ROUTE, content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text


def test_prime_rls_token_in_client_records_each_rollout_as_one_exact_segment(service, tiny_model_dir):
    """renderers 0.1.12's generate (what verifiers 0.4's train client calls) with bridged turns,
    X-Session-ID per rollout, 4 rollouts x 3 calls with a tool result between them: every rollout is
    one segment, every call continued it, and the ids and logprobs the client got are the stored ones."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    rend = Path(__file__).resolve().parents[1] / ".venv" / "renderers-0.1.12"  # scripts/setup_test_clients.sh installs it
    if not (rend / ".installed").exists():
        pytest.fail(f"renderers 0.1.12 is not installed in {rend}: run scripts/setup_test_clients.sh")
    driver = Path(__file__).with_name("renderers_tito_driver.py")
    proc = subprocess.run([sys.executable, str(driver), service.url, str(tiny_model_dir), MODEL, "4", "3"],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(rend)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    import httpx

    for r in json.loads(proc.stdout.strip().splitlines()[-1]):
        calls = r["calls"]
        assert len(calls) == 3 and [c["bridged"] for c in calls] == [False, True, True], calls
        traj = httpx.get(f"{service.url}/v1/rollouts/{r['session_id']}", timeout=60).json()
        assert traj["turns"] == 3 and len(traj["segments"]) == 1, traj["segments"]
        seg = traj["segments"][0]
        for call, turn in zip(calls, seg["turns"]):
            assert turn["monotonic"]
            ids = call["prompt_ids"] + call["completion_ids"]
            assert seg["token_ids"][: len(ids)] == ids
            assert seg["logprobs"][turn["gen_start"]:turn["gen_end"]] == call["completion_logprobs"]
        generated = [t for c in calls for t in c["completion_ids"]]
        assert [t for t, m in zip(seg["token_ids"], seg["loss_mask"]) if m] == generated
