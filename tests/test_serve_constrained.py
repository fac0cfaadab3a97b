"""A turn sampled under a grammar (forced tool_choice) is marked constrained, on the answer and in the trajectory."""

from __future__ import annotations

import uuid

import pytest

from serve_helpers import MODEL, WEATHER_TOOL

pytestmark = pytest.mark.serve


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
