"""Multi-turn rollouts through the real Serve app, engine and Redis, driven by the `openai` SDK.

Every turn's prompt must be the previous prompt + previous generation + the template's tail, and
the stored trajectory must be exactly what was generated, with logprobs that a transformers float32
forward of the final sequence reproduces.
"""

from __future__ import annotations

import json
import uuid

import pytest

from engine_helpers import load_hf_model
from serve_helpers import IM_END, MODEL, WEATHER_TOOL, echo_assistant, expected_tail_text, parse_sse, tool_result



def _msg(completion) -> dict:
    return completion.choices[0].message.model_dump()


def _check_continuity(tok, prev: dict | None, msg: dict, new_messages: list[dict]):
    if prev is None:
        return
    base = prev["prompt_token_ids"] + prev["generation_token_ids"]
    assert msg["prompt_token_ids"][: len(base)] == base, "previous prompt + generation is not a prefix"
    tail = msg["prompt_token_ids"][len(base):]
    ended = bool(prev["generation_token_ids"]) and prev["generation_token_ids"][-1] == IM_END
    assert tail == tok.encode(expected_tail_text(new_messages, ended), add_special_tokens=False)


def _trajectory_logprob_parity(http, model_dir, rollout_id, calls, forced_turns, temperatures=None):
    """Loss-masked ids == generated ids in order; logprobs match a transformers recompute."""
    import torch

    traj = http.get(f"/v1/rollouts/{rollout_id}").json()
    assert len(traj["segments"]) == 1
    seg = traj["segments"][0]
    masked = [t for t, m in zip(seg["token_ids"], seg["loss_mask"]) if m]
    assert masked == [t for c in calls for t in c["generation_token_ids"]]
    assert [lp for lp, m in zip(seg["logprobs"], seg["loss_mask"]) if m] == pytest.approx(
        [lp for c in calls for lp in c["generation_log_probs"]], abs=0, rel=1e-7)
    assert seg["token_ids"][: len(calls[-1]["prompt_token_ids"])] == calls[-1]["prompt_token_ids"]

    model = load_hf_model(str(model_dir))
    with torch.no_grad():
        logits = model(torch.tensor([seg["token_ids"]])).logits[0].float()
    free, forced = [], []
    for turn in seg["turns"]:
        temp = (temperatures or {}).get(turn["turn"], 1.0)
        logp = torch.log_softmax(logits / temp, dim=-1)
        for pos in range(turn["gen_start"], turn["gen_end"]):
            ref = logp[pos - 1, seg["token_ids"][pos]].item()
            (forced if turn["turn"] in forced_turns else free).append((seg["logprobs"][pos], ref))
    assert free, "no free-running turn to compare"
    worst = max(abs(a - b) for a, b in free)
    print(f"trajectory parity: {len(free)} tokens, max |Δ| = {worst:.3g}")
    assert worst <= 1e-4
    # Structured outputs sample from the grammar-masked distribution, renormalized over the allowed
    # tokens: the behaviour logprob can only be >= the unconstrained one.
    assert all(a >= b - 1e-4 for a, b in forced)
    return seg


def test_multi_turn_tool_rollout_is_exactly_on_policy(openai_client, http, tiny_tokenizer, tiny_model_dir):
    rid = f"chat-{uuid.uuid4().hex[:8]}"
    headers = {"X-Rollout-Id": rid}
    tools = [WEATHER_TOOL]
    messages = [{"role": "system", "content": "You are a weather agent."},
                {"role": "user", "content": "What's the weather in Paris? Skinny jeans weather?"}]
    plan = [
        # Forced calls come in the model's own <tool_call> format (~19 tokens + what whitespace a random
        # policy puts between JSON tokens); "required" limited to one call (a random policy calls on).
        ({"tool_choice": {"type": "function", "function": {"name": "get_weather"}}, "max_tokens": 64}, "forced"),
        ({"max_tokens": 24}, "free"),            # stops on max_tokens: no end-of-turn token
        ({"tool_choice": "required", "parallel_tool_calls": False, "max_tokens": 64}, "forced"),
        ({"max_tokens": 20}, "free"),
        ({"max_tokens": 16, "temperature": 0.7}, "free"),
    ]
    calls, prev, new = [], None, messages[:]
    forced_turns, temperatures = set(), {}
    for turn, (kwargs, kind) in enumerate(plan, start=1):
        temp = temperatures[turn] = kwargs.pop("temperature", 1.0)
        out = openai_client.chat.completions.create(
            model=MODEL, messages=messages, tools=tools, seed=turn, temperature=temp, extra_headers=headers, **kwargs
        )
        msg = _msg(out)
        assert (msg["rollout"]["id"], msg["rollout"]["turn"], msg["rollout"]["segment"]) == (rid, turn, 0)
        if turn > 1:
            assert msg["rollout"]["monotonic"] is True
        _check_continuity(tiny_tokenizer, prev, msg, new)
        if kind == "forced":
            forced_turns.add(turn)
            assert msg["tool_calls"], "forced tool call missing"
            for tc in msg["tool_calls"]:
                assert tc["function"]["name"] == "get_weather"
                assert json.loads(tc["function"]["arguments"])["city"] in ("Paris", "London", "Tokyo")
            named = isinstance(kwargs.get("tool_choice"), dict)  # vLLM's rule: a named call ends "stop" (as OpenAI's)
            assert out.choices[0].finish_reason == ("stop" if named else "tool_calls")
        calls.append(msg)
        prev = msg
        new = [echo_assistant(msg)]
        messages.append(new[0])
        if msg.get("tool_calls"):
            results = [tool_result(tc, f"sunny, {20 + i} C") for i, tc in enumerate(msg["tool_calls"])]
            messages += results
            new = results
        else:
            messages.append({"role": "user", "content": f"ok, turn {turn} done. next?"})
            new = messages[-1:]
    assert any(c["generation_token_ids"][-1] != IM_END for c in calls), "no turn exercised the missing end-of-turn path"
    seg = _trajectory_logprob_parity(http, tiny_model_dir, rid, calls, forced_turns, temperatures)
    # the first turn's call is named: vLLM's (and OpenAI's) finish reason for it is "stop"
    assert [t["finish_reason"] for t in seg["turns"]][:3:2] == ["stop", "tool_calls"]
    assert len({w["version"] for w in seg["weight_versions"]}) == 1  # no refit ran during this rollout


def test_responses_api_rollout_is_exactly_on_policy(openai_client, http, tiny_tokenizer, tiny_model_dir):
    rid = f"resp-{uuid.uuid4().hex[:8]}"
    headers = {"X-Rollout-Id": rid}
    tool = {"type": "function", "name": "get_weather", "parameters": WEATHER_TOOL["function"]["parameters"]}
    items: list[dict] = [{"role": "user", "content": "Weather in Tokyo?"}]
    calls, prev, new_msgs = [], None, None
    for turn in range(1, 4):
        kwargs = {"tool_choice": {"type": "function", "name": "get_weather"}} if turn == 1 else {}
        resp = openai_client.responses.create(model=MODEL, input=items, tools=[tool],
                                              max_output_tokens=64 if turn == 1 else 24,
                                              temperature=1.0, extra_headers=headers, extra_body={"seed": turn}, **kwargs)
        out = [o.model_dump() for o in resp.output]
        last = out[-1]
        msg = {k: last[k] for k in ("prompt_token_ids", "generation_token_ids", "generation_log_probs")}
        assert last["rollout"]["turn"] == turn and last["rollout"]["segment"] == 0
        if prev is not None:
            _check_continuity(tiny_tokenizer, prev, msg, new_msgs)
        calls.append(msg)
        prev = msg
        # The agent sends back the model's items (function calls, message) and the new input.
        for o in out:
            if o["type"] == "function_call":
                items.append({"type": "function_call", "call_id": o["call_id"], "name": o["name"], "arguments": o["arguments"]})
            elif o["type"] == "message":
                items.append({"role": "assistant", "content": o["content"][0]["text"]})
        calls_made = [o for o in out if o["type"] == "function_call"]
        if turn == 1:
            assert calls_made and calls_made[0]["name"] == "get_weather"
        if calls_made:
            items += [{"type": "function_call_output", "call_id": c["call_id"], "output": "rainy"} for c in calls_made]
            new_msgs = [{"role": "tool", "content": "rainy"} for _ in calls_made]
        else:
            items.append({"role": "user", "content": "and tomorrow?"})
            new_msgs = [{"role": "user", "content": "and tomorrow?"}]
    _trajectory_logprob_parity(http, tiny_model_dir, rid, calls, forced_turns={1})


def test_stateless_nemo_gym_echo_matches_the_stateful_path(http, tiny_tokenizer):
    """No rollout id: the echoed ids drive the same algorithm and give the same prompt ids."""
    base = {"model": MODEL, "max_tokens": 20, "temperature": 1.0}
    msgs = [{"role": "user", "content": "Count to three, skinny."}]
    rid = f"sl-{uuid.uuid4().hex[:8]}"
    stateful = []
    stateless = []
    echo_msgs = list(msgs)
    plain_msgs = list(msgs)
    for turn in range(1, 4):
        a = http.post("/v1/chat/completions", json={**base, "messages": plain_msgs, "seed": turn},
                      headers={"X-Rollout-Id": rid}).json()["choices"][0]["message"]
        b = http.post("/v1/chat/completions", json={**base, "messages": echo_msgs, "seed": turn}).json()["choices"][0]["message"]
        assert b["rollout"] is None
        assert a["prompt_token_ids"] == b["prompt_token_ids"]
        assert a["generation_token_ids"] == b["generation_token_ids"]
        stateful.append(a)
        stateless.append(b)
        user = {"role": "user", "content": f"again {turn}"}
        plain_msgs = plain_msgs + [echo_assistant(a), user]
        echo_msgs = echo_msgs + [{**echo_assistant(b), "prompt_token_ids": b["prompt_token_ids"],
                                  "generation_token_ids": b["generation_token_ids"],
                                  "generation_log_probs": b["generation_log_probs"]}, user]
    for prev, cur in zip(stateless, stateless[1:]):
        base_ids = prev["prompt_token_ids"] + prev["generation_token_ids"]
        assert cur["prompt_token_ids"][: len(base_ids)] == base_ids


def test_stream_and_non_stream_give_identical_ids(http):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Stream me a story"}], "max_tokens": 40,
            "seed": 1234, "temperature": 1.0}
    plain = http.post("/v1/chat/completions", json=body).json()["choices"][0]
    with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True, "return_token_ids": True}) as r:
        assert r.status_code == 200
        chunks = parse_sse(r.iter_lines())
    final = chunks[-1]["choices"][0]
    streamed_ids = [t for c in chunks for t in c["choices"][0].get("token_ids", [])]
    assert final["delta"]["generation_token_ids"] == plain["message"]["generation_token_ids"]
    assert streamed_ids == plain["message"]["generation_token_ids"]
    assert final["delta"]["prompt_token_ids"] == plain["message"]["prompt_token_ids"]
    assert final["finish_reason"] == plain["finish_reason"]
    text = "".join((c["choices"][0]["delta"].get("content") or "") + (c["choices"][0]["delta"].get("reasoning_content") or "")
                   for c in chunks)
    assert text == (plain["message"].get("content") or "") + (plain["message"].get("reasoning_content") or "")


def test_openai_sdk_streaming_with_rollout(openai_client):
    rid = f"st-{uuid.uuid4().hex[:8]}"
    stream = openai_client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=12, seed=3, stream=True,
        extra_headers={"X-Rollout-Id": rid}, stream_options={"include_usage": True})
    chunks = list(stream)
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1
    delta = finals[0].choices[0].delta.model_dump()
    assert delta["rollout"]["id"] == rid and len(delta["generation_token_ids"]) == 12
    assert chunks[-1].usage.completion_tokens == 12
