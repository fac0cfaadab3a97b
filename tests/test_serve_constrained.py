"""Turns sampled under a grammar: forced tool calls in the model's own format (or the JSON form by
config), ``response_format`` / ``text.format``; each marked constrained, on the answer and in the
trajectory."""

from __future__ import annotations

import json
import uuid

import pytest

from serve_helpers import MODEL, WEATHER_TOOL



def test_forced_tool_turns_are_marked_constrained_and_free_turns_are_not(http):
    rid = f"constrained-{uuid.uuid4().hex[:8]}"
    messages = [{"role": "user", "content": "weather in Paris?"}]
    forced = {"model": MODEL, "messages": messages, "tools": [WEATHER_TOOL], "max_tokens": 48, "seed": 1,
              "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    first = http.post("/v1/chat/completions", json=forced, headers={"X-Rollout-Id": rid}).json()["choices"][0]["message"]
    assert first["tool_calls"] and first["rollout"]["constrained"] is True
    call = first["tool_calls"][0]
    messages = messages + [{"role": "assistant", "content": "", "tool_calls": [call]},
                           {"role": "tool", "tool_call_id": call["id"], "content": "sunny"}]
    free = {"model": MODEL, "messages": messages, "tools": [WEATHER_TOOL], "max_tokens": 4, "seed": 2, "ignore_eos": True}
    second = http.post("/v1/chat/completions", json=free, headers={"X-Rollout-Id": rid}).json()["choices"][0]["message"]
    assert second["rollout"]["constrained"] is False and second["rollout"]["turn"] == 2
    turns = http.get(f"/v1/rollouts/{rid}").json()["segments"][0]["turns"]
    assert [t["constrained"] for t in turns] == [True, False]
    replay = http.post("/v1/chat/completions", json=free, headers={"X-Rollout-Id": rid}).json()["choices"][0]["message"]
    assert replay["rollout"]["replayed"] is True and replay["rollout"]["constrained"] is False


# ----------------------------------------------------------------------------- native forced tool calls
NAMED = {"type": "function", "function": {"name": "get_weather"}}
TIME_TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}


def _decoded(tokenizer, ids):
    return tokenizer.decode(ids, skip_special_tokens=False)


@pytest.mark.parametrize("tool_choice", [NAMED, "required"], ids=["named", "required"])
def test_a_forced_tool_call_is_generated_in_the_models_own_format_and_parsed_by_its_tool_parser(
    http, tiny_tokenizer, tool_choice
):
    rid = f"native-{uuid.uuid4().hex[:8]}"
    # One call (parallel_tool_calls false): a random policy under "required" otherwise calls until max_tokens.
    body = {"model": MODEL, "messages": [{"role": "user", "content": "weather in Paris, time in CET?"}],
            "tools": [WEATHER_TOOL, TIME_TOOL], "tool_choice": tool_choice, "max_tokens": 96, "seed": 3,
            "parallel_tool_calls": False}
    r = http.post("/v1/chat/completions", json=body, headers={"X-Rollout-Id": rid})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    msg = choice["message"]
    text = _decoded(tiny_tokenizer, msg["generation_token_ids"])
    # Hermes / Qwen's format, not bare JSON: what the model emits when it calls a tool unforced.
    assert text.startswith("<tool_call>"), text
    # vLLM's rule: a named call ends "stop" (as OpenAI's), a required one "tool_calls"
    assert choice["finish_reason"] == ("stop" if tool_choice == NAMED else "tool_calls") and msg["tool_calls"], (
        choice["finish_reason"], text)
    names = {"get_weather": ("city", {"Paris", "London", "Tokyo"}), "get_time": ("zone", {"UTC", "CET"})}
    for call in msg["tool_calls"]:
        key, allowed = names[call["function"]["name"]]
        assert json.loads(call["function"]["arguments"])[key] in allowed  # arguments follow the schema
    if tool_choice == NAMED:
        assert [c["function"]["name"] for c in msg["tool_calls"]] == ["get_weather"]
    assert text.count("<tool_call>") == len(msg["tool_calls"])  # every generated call was parsed
    assert msg["rollout"]["constrained"] is True
    # The stored turn replays the same parse (the tool parser), with the same ids.
    seg = http.get(f"/v1/rollouts/{rid}").json()["segments"][0]
    turn = seg["turns"][0]
    assert turn["constrained"] is True
    assert seg["token_ids"][turn["gen_start"]:turn["gen_end"]] == msg["generation_token_ids"]


def test_a_streamed_forced_tool_call_sends_the_call_not_its_markup(openai_client, tiny_tokenizer):
    stream = openai_client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "weather?"}], tools=[WEATHER_TOOL], tool_choice=NAMED,
        max_tokens=64, seed=5, stream=True, extra_headers={"X-Rollout-Id": f"native-s-{uuid.uuid4().hex[:8]}"})
    content, calls, last = "", [], None
    for chunk in stream:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        calls += delta.tool_calls or []
        last = chunk.choices[0]
    assert last.finish_reason == "stop"  # a named call, as vLLM (and OpenAI) end it
    assert "<tool_call>" not in content and content.strip() == ""
    assert [c.function.name for c in calls] == ["get_weather"]
    assert json.loads(calls[0].function.arguments)["city"] in {"Paris", "London", "Tokyo"}
    extra = last.delta.model_extra
    assert _decoded(tiny_tokenizer, extra["generation_token_ids"]).startswith("<tool_call>")
    assert extra["rollout"]["constrained"] is True


def test_a_tool_marked_strict_false_keeps_free_arguments_but_the_call_envelope():
    from rollout_service.onpolicy.parsing import structured_outputs_for
    from rollout_service.models.tiny_model import ensure_tiny_model
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(ensure_tiny_model()))
    loose = {"type": "function", "function": {**WEATHER_TOOL["function"], "strict": False}}
    kw = dict(tokenizer=tok, reasoning_parser="qwen3", tool_parser="hermes")
    forced = json.loads(structured_outputs_for(tools=[loose], tool_choice=NAMED, **kw)["structural_tag"])
    tags = forced["format"]["tags"]
    assert tags and all(t["content"]["json_schema"] is True and t["begin"].startswith("<tool_call>") for t in tags)
    pinned = json.loads(structured_outputs_for(tools=[WEATHER_TOOL], tool_choice=NAMED, **kw)["structural_tag"])
    assert all(t["content"]["json_schema"] == WEATHER_TOOL["function"]["parameters"] for t in pinned["format"]["tags"])
    # tool_choice auto: no grammar unless a tool is strict, parallel_tool_calls is false or a level is raised.
    assert structured_outputs_for(tools=[WEATHER_TOOL], tool_choice="auto", **kw) is None
    strict = {"type": "function", "function": {**WEATHER_TOOL["function"], "strict": True}}
    auto = json.loads(structured_outputs_for(tools=[strict], tool_choice="auto", **kw)["structural_tag"])
    assert auto["format"]["type"] == "triggered_tags" and auto["format"]["triggers"] == ["<tool_call>"]
    single = json.loads(structured_outputs_for(tools=[WEATHER_TOOL], tool_choice="auto", parallel_tool_calls=False,
                                               **kw)["structural_tag"])
    assert single["format"]["stop_after_first"] is True
    raised = structured_outputs_for(tools=[WEATHER_TOOL], tool_choice="auto", strict_level="function", **kw)
    assert raised is not None and "structural_tag" in raised
    assert structured_outputs_for(tools=None, response_format={"type": "json_object"}, **kw) == {"json_object": True}


async def test_the_json_form_stays_available_by_config(fleet_rig, tiny_tokenizer):
    """chat.forced_tool_call_format: json samples the bare-JSON form on the same engines."""
    from rollout_service.serve.turn_types import ToolChoice, TurnRequest
    from rollout_service.serve.turns import TurnRunner

    cfg = fleet_rig.config.model_copy(deep=True)
    cfg.chat.forced_tool_call_format = "json"
    runner = TurnRunner(cfg, fleet_rig.runner.fleet, fleet_rig.store, tiny_tokenizer)
    req = TurnRequest(messages=[{"role": "user", "content": "weather?"}], tools=[WEATHER_TOOL],
                      tool_choice=ToolChoice(mode="named", name="get_weather"), max_tokens=48,
                      sampling={"seed": 1}, rollout_id=f"jsonform-{uuid.uuid4().hex[:8]}")
    result = [e async for e in runner.run_turn(req)][-1]
    text = tiny_tokenizer.decode(result.generation_token_ids, skip_special_tokens=True)
    assert text.lstrip().startswith("{") and "<tool_call>" not in text
    assert json.loads(text)["city"] in {"Paris", "London", "Tokyo"}
    assert result.message["tool_calls"][0]["function"]["name"] == "get_weather"
    assert result.rollout["constrained"] is True


# ----------------------------------------------------------------------------- response_format / text.format
ANSWER_SCHEMA = {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
                 "required": ["answer"], "additionalProperties": False}


def test_response_format_json_schema_constrains_the_answer_and_marks_the_turn(http):
    rid = f"rf-{uuid.uuid4().hex[:8]}"
    body = {"model": MODEL, "messages": [{"role": "user", "content": "yes or no?"}], "max_tokens": 48, "seed": 2,
            "response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER_SCHEMA,
                                                                       "strict": True}}}
    r = http.post("/v1/chat/completions", json=body, headers={"X-Rollout-Id": rid})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert json.loads(choice["message"]["content"])["answer"] in {"yes", "no"}
    assert choice["message"]["rollout"]["constrained"] is True
    assert http.get(f"/v1/rollouts/{rid}").json()["segments"][0]["turns"][0]["constrained"] is True
    # Plain text format is no constraint.
    body2 = {**body, "response_format": {"type": "text"}, "max_tokens": 4, "ignore_eos": True,
             "messages": [{"role": "user", "content": "free text"}]}
    free = http.post("/v1/chat/completions", json=body2, headers={"X-Rollout-Id": f"rf-{uuid.uuid4().hex[:8]}"}).json()
    assert free["choices"][0]["message"]["rollout"]["constrained"] is False


def test_response_format_json_object_starts_an_object(http, tiny_tokenizer):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "json please"}], "max_tokens": 16, "seed": 4,
            "response_format": {"type": "json_object"}}
    r = http.post("/v1/chat/completions", json=body, headers={"X-Rollout-Id": f"rf-{uuid.uuid4().hex[:8]}"})
    assert r.status_code == 200, r.text
    msg = r.json()["choices"][0]["message"]
    assert tiny_tokenizer.decode(msg["generation_token_ids"]).lstrip().startswith("{")
    assert msg["rollout"]["constrained"] is True


def test_responses_text_format_json_schema_is_honoured_and_echoed(openai_client):
    rid = f"rf-resp-{uuid.uuid4().hex[:8]}"
    fmt = {"type": "json_schema", "name": "answer", "schema": ANSWER_SCHEMA, "strict": True}
    resp = openai_client.responses.create(model=MODEL, input="yes or no?", text={"format": fmt}, max_output_tokens=48,
                                          extra_body={"seed": 2}, extra_headers={"X-Rollout-Id": rid})
    assert resp.status == "completed"
    assert json.loads(resp.output_text)["answer"] in {"yes", "no"}
    assert resp.text.format.type == "json_schema" and resp.text.format.name == "answer"
    assert resp.output[-1].model_extra["rollout"]["constrained"] is True


@pytest.mark.parametrize("fmt", [
    {"type": "json_schema"},                                             # no json_schema
    {"type": "json_schema", "json_schema": {"schema": ANSWER_SCHEMA}},   # no name
    {"type": "bogus"},
    {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": 5}}},
], ids=["missing-spec", "missing-name", "unknown-type", "invalid-schema"])
def test_a_bad_response_format_is_a_400_and_stores_nothing(http, fmt):
    rid = f"rf-bad-{uuid.uuid4().hex[:8]}"
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 4, "response_format": fmt}
    r = http.post("/v1/chat/completions", json=body, headers={"X-Rollout-Id": rid})
    assert r.status_code == 400, r.text
    assert (r.json()["error"]["param"] or "").startswith("response_format"), r.text
    assert http.get(f"/v1/rollouts/{rid}").status_code == 404


def test_a_responses_json_schema_format_without_a_schema_is_a_400_and_stores_nothing(http):
    """Found by the schema fuzzer: vLLM's own request conversion refuses it (VLLMValidationError,
    "none are specified"), which was a 500."""
    rid = f"rf-noschema-{uuid.uuid4().hex[:8]}"
    body = {"model": MODEL, "input": "0", "max_output_tokens": 4, "text": {"format": {"name": "0", "type": "json_schema"}}}
    r = http.post("/v1/responses", json=body, headers={"X-Rollout-Id": rid})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "invalid_response_format" and (err["param"] or "").startswith("response_format"), r.text
    assert http.get(f"/v1/rollouts/{rid}").status_code == 404
