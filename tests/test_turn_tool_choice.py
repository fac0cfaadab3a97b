"""``tool_choice`` decides whether a generated tool call is parsed as one, streamed or not.

The tiny model's random weights never write a ``<tool_call>`` on their own, so the runner is given
a stand-in fleet that answers with ids that are one (the real tokenizer's ids, the real parsers,
the real turn runner): with ``auto`` they come back as ``tool_calls``; with ``none`` as text.
"""

from __future__ import annotations

import asyncio

import pytest

from rollout_service.config import RolloutServiceConfig
from rollout_service.engine.types import GenerationChunk
from rollout_service.serve.turn_types import TokenDelta, ToolChoice, TurnRequest, TurnResult
from rollout_service.serve.turns import TurnRunner
from serve_helpers import IM_END, WEATHER_TOOL

CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


class CannedFleet:
    """The fleet client's generation interface, answering every call with the same ids."""

    def __init__(self, ids: list[int]):
        self.ids = ids

    def members(self):
        return ()

    async def generate_with_failover(self, rollout_id, request, stream, routed=None, group=None):
        yield GenerationChunk(token_ids=list(self.ids), logprobs=[-0.5] * len(self.ids), finish_reason="stop",
                              weight_versions=[("0", 0, len(self.ids))])


@pytest.fixture(scope="module")
def runner(tiny_model_dir, tiny_tokenizer):
    cfg = RolloutServiceConfig.model_validate({"engine": {"model": str(tiny_model_dir)}, "chat": {"reasoning_parser": None}})
    ids = tiny_tokenizer.encode(CALL_TEXT, add_special_tokens=False) + [IM_END]
    return TurnRunner(cfg, CannedFleet(ids), None, tiny_tokenizer)


def call(runner: TurnRunner, mode: str, stream: bool) -> list:
    req = TurnRequest(messages=[{"role": "user", "content": "weather in Paris?"}], tools=[WEATHER_TOOL],
                      tool_choice=ToolChoice(mode=mode), max_tokens=64, stream=stream)

    async def run():
        return [event async for event in runner.run_turn(req)]

    return asyncio.run(run())


@pytest.mark.parametrize("stream", [False, True])
def test_tool_choice_auto_parses_the_generated_call(runner, stream):
    result = call(runner, "auto", stream)[-1]
    assert isinstance(result, TurnResult) and result.finish_reason == "tool_calls"
    (tool_call,) = result.message["tool_calls"]
    assert tool_call["function"]["name"] == "get_weather"
    assert "<tool_call>" not in result.message["content"]


@pytest.mark.parametrize("stream", [False, True])
def test_tool_choice_none_leaves_a_generated_call_as_text(runner, stream):
    events = call(runner, "none", stream)
    result = events[-1]
    assert isinstance(result, TurnResult) and result.finish_reason == "stop"
    assert not result.message.get("tool_calls")
    assert CALL_TEXT in result.message["content"]
    if stream:  # streamed as text, not held back as a call
        streamed = "".join(e.content for e in events if isinstance(e, TokenDelta))
        assert CALL_TEXT in streamed
