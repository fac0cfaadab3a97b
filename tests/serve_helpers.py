"""Independent expectations for the service tests (our ChatML template, computed by hand)."""

from __future__ import annotations

import json

IM_END = 151645
MODEL = "tiny-qwen3"

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": ["Paris", "London", "Tokyo"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}


def expected_tail_text(new_messages: list[dict], prev_gen_ended_with_eot: bool) -> str:
    """What our ChatML template puts between the end of a generation and the next generation prompt."""
    text = "\n" if prev_gen_ended_with_eot else "<|im_end|>\n"
    i = 0
    while i < len(new_messages):
        m = new_messages[i]
        if m["role"] == "user":
            text += f"<|im_start|>user\n{m['content']}<|im_end|>\n"
            i += 1
        elif m["role"] == "tool":
            text += "<|im_start|>user"
            while i < len(new_messages) and new_messages[i]["role"] == "tool":
                text += f"\n<tool_response>\n{new_messages[i]['content']}\n</tool_response>"
                i += 1
            text += "<|im_end|>\n"
        else:
            raise AssertionError(f"unexpected role in tail: {m['role']}")
    return text + "<|im_start|>assistant\n"


def echo_assistant(message: dict) -> dict:
    """What an agent sends back for an assistant turn: content and tool calls (no reasoning)."""
    out = {"role": "assistant", "content": message.get("content") or ""}
    if message.get("tool_calls"):
        out["tool_calls"] = [
            {"id": tc["id"], "type": "function",
             "function": {"name": tc["function"]["name"], "arguments": tc["function"]["arguments"]}}
            for tc in message["tool_calls"]
        ]
    return out


def tool_result(call: dict, content: str) -> dict:
    return {"role": "tool", "tool_call_id": call["id"], "content": content}


def parse_sse(lines) -> list[dict]:
    events = []
    for line in lines:
        if line.startswith("data: ") and line != "data: [DONE]":
            events.append(json.loads(line[len("data: "):]))
    return events


def wait_healthy(url: str, timeout: float = 300) -> None:
    """Poll ``url`` (an app's /health) until it answers 200; AssertionError after ``timeout`` s."""
    import time

    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=30).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"{url} not healthy after {timeout}s")


def load_example(relative: str, name: str):
    """An example script (path relative to the repository) as a module, without running its main."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parents[1] / relative)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
