"""`rollout-service demo` against the running service: a tool-using rollout that checks itself."""

from __future__ import annotations

import pytest

from rollout_service.ops.cli import build_parser
from rollout_service.ops.demo import run_demo



def test_demo_rollout_passes_its_on_policy_checks(service, capsys):
    assert run_demo(service.url, turns=4) == 0
    out = capsys.readouterr().out
    assert "prompt continuity (prompt_k == prompt_k-1 + gen_k-1 + tail): True" in out
    assert "loss-masked ids == generated ids, in order: True" in out
    # the demo's forced (named) call: parsed, and ended "stop" as vLLM and OpenAI end a named call
    assert "(OK)" in out and 'finish=stop, output={"arguments"' in out and '"name": "get_weather"' in out


def test_cli_parses_the_documented_commands():
    p = build_parser()
    assert p.parse_args(["up"]).port == 8000 and p.parse_args(["up"]).host == "127.0.0.1"
    assert p.parse_args(["demo", "--url", "http://127.0.0.1:9"]).url == "http://127.0.0.1:9"
    assert p.parse_args(["build-tiny-model", "/tmp/x"]).dir == "/tmp/x"
