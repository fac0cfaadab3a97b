"""Streaming text: chunk by chunk, the same reasoning / content as the one-shot parse of the whole answer."""

from __future__ import annotations

import random
import time

import pytest

from onpolicy_fixtures import encode, tokenizer
from rollout_service.onpolicy import parse_output
from rollout_service.serve.streaming import StreamParser

ANSWERS = [
    "<think>\nThe user wants weather. Café ☕ first.\n</think>\n\nIt is sunny in Paris, 22°C.",
    "<think>\nshort</think>Plain answer with émojis 🎉 and\nnewlines\n\n",
    "<think>\nneed a tool\n</think>\n\nLet me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>",
    "No reasoning at all, just text <tool_ and more",
]


def _stream(ids, *, chunking, hold, thinking=True):
    kwargs = {"enable_thinking": thinking}
    parser = StreamParser(tokenizer(), reasoning_parser="qwen3", chat_template_kwargs=kwargs, prompt_ids=encode(
        "<|im_start|>assistant\n"), hold_tool_calls=hold)
    reasoning = content = ""
    i = 0
    while i < len(ids):
        n = chunking()
        chunk = ids[i:i + n]
        i += n
        r, c = parser.push(chunk, finished=i >= len(ids))
        reasoning += r
        content += c
    return reasoning, content


@pytest.mark.parametrize("answer", ANSWERS)
@pytest.mark.parametrize("chunk", [1, 3, "random"])
def test_streamed_text_equals_the_one_shot_parse(answer, chunk):
    ids = encode(answer) + [151645]  # <|im_end|>
    rng = random.Random(7)
    chunking = (lambda: rng.randint(1, 6)) if chunk == "random" else (lambda: chunk)
    hold = "<tool_call>" in answer
    reasoning, content = _stream(ids, chunking=chunking, hold=hold)
    full = parse_output(ids, tokenizer=tokenizer(), reasoning_parser="qwen3", tool_parser="hermes" if hold else None,
                        tools=[{"type": "function", "function": {"name": "get_weather", "parameters": {}}}] if hold else None,
                        chat_template_kwargs={"enable_thinking": True}, prompt_ids=encode("<|im_start|>assistant\n"))
    assert reasoning == (full.reasoning_content or "")
    if hold:  # tool-call text is held back; the calls arrive parsed with the final event
        assert "<tool_call>" not in content and full.tool_calls
        assert content == (full.content or "").rstrip("\n")
    else:
        assert content == (full.content or "")


def test_a_partial_marker_is_held_back_and_released_when_it_is_not_a_tool_call():
    ids = encode("text <tool_ but not a call")
    reasoning, content = _stream(ids, chunking=lambda: 1, hold=True, thinking=False)
    assert content == "text <tool_ but not a call" and reasoning == ""


def test_cost_per_chunk_does_not_grow_with_the_answer():
    """Incremental: the 2,000th token costs what the 20th does (the old path re-parsed everything per chunk)."""
    ids = encode("word " * 2200)[:2200]
    parser = StreamParser(tokenizer(), reasoning_parser="qwen3", chat_template_kwargs={"enable_thinking": False},
                          prompt_ids=[1, 2], hold_tool_calls=True)
    times = []
    for t in ids:
        t0 = time.perf_counter()
        parser.push([t])
        times.append(time.perf_counter() - t0)
    early, late = sorted(times[100:300])[100], sorted(times[1900:2100])[100]
    assert late < 3 * early + 20e-6, (early, late)


WARM_CHECK = """
import sys
from transformers import AutoTokenizer
from rollout_service.config import RolloutServiceConfig
from rollout_service.serve.turns import TurnRunner
from rollout_service.onpolicy import parsing

config = RolloutServiceConfig()
tok = AutoTokenizer.from_pretrained(config.engine.resolved_model())
runner = TurnRunner(config, None, None, tok)
before = "vllm.parser.parser_manager" in sys.modules, parsing.parser_class.cache_info().currsize
runner.warm()
after = "vllm.parser.parser_manager" in sys.modules, parsing.parser_class.cache_info().currsize
print(before, after, parsing.CACHED_TOKENIZERS.get(id(tok), (None,))[0] is tok)
"""


def test_the_runners_warm_up_pays_the_first_calls_one_time_costs(tiny_model_dir):
    """``TurnRunner.warm`` (run by each replica as it starts) imports vLLM's parser modules, builds the
    cached tokenizer view and the configured reasoning and tool parsers: the 2.3-4 s the first call
    of each replica paid (docs/benchmarks.md). In a fresh interpreter, where nothing else did it."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "ROLLOUT_SERVICE_TINY_MODEL": str(tiny_model_dir)}
    out = subprocess.run([sys.executable, "-c", WARM_CHECK], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split("\n")[-2] == "(False, 0) (True, 2) True", out.stdout


@pytest.mark.parametrize("include", [False, True])
def test_stop_strings_stream_as_vllms_detokenizer_cuts_them(include):
    """With stop strings the streamed text never shows what could begin one until the call ends, and
    ends where the one-shot text ends: before the stop string (after it when included), cut inside
    the token that completed it."""
    from rollout_service.onpolicy.parsing import generation_text

    ids = encode("Speedway racing is fun in Paris")
    texts = [tokenizer().decode([t]) for t in ids]
    # a stop string ending inside a token: the tail of one token and the start of the next
    k = next(i for i in range(1, len(ids) - 1) if len(texts[i + 1]) >= 2)
    stop = texts[k][-2:] + texts[k + 1][0]
    ended = ids[:k + 2]  # the engine stops at the token that completed the stop string
    parser = StreamParser(tokenizer(), reasoning_parser=None, chat_template_kwargs=None, prompt_ids=[],
                          hold_tool_calls=False, stop=[stop, "zzzzzz"], include_stop=include)
    streamed, shown = "", []
    for i, tid in enumerate(ended):
        last = i == len(ended) - 1
        _, c = parser.push([tid], finished=last, stop_reason=stop if last else None)
        streamed += c
        if not last and not include:  # held back: the last (longest - 1) characters
            assert len(tokenizer().decode(ended[:i + 1])) - len(streamed) == min(5, len(tokenizer().decode(ended[:i + 1])))
    assert streamed == generation_text(tokenizer(), ended, True, (stop, include))
    assert streamed.endswith(stop) if include else (stop not in streamed and tokenizer().decode(ended).startswith(streamed))


def test_a_stop_string_ending_on_a_character_split_across_tokens_is_cut():
    """The last token completes a character its predecessor began: the text before it ends at the
    whole character (the detokenizer holds the half back), so the stop string is found and cut."""
    from rollout_service.onpolicy.parsing import generation_text

    ids = encode("X🧌 after")
    k = next(i for i in range(1, len(ids)) if tokenizer().decode(ids[:i]).endswith("\ufffd"))
    ended = ids[:k + 1]
    assert tokenizer().decode(ended).endswith("🧌")
    assert generation_text(tokenizer(), ended, True, ("X🧌", False)) == ""
    assert generation_text(tokenizer(), ended, True, ("X🧌", True)) == "X🧌"
    parser = StreamParser(tokenizer(), reasoning_parser=None, chat_template_kwargs=None, prompt_ids=[],
                          hold_tool_calls=False, stop=["X🧌"])
    streamed = "".join(parser.push([t], finished=i == len(ended) - 1, stop_reason="X🧌" if i == len(ended) - 1 else None)[1]
                       for i, t in enumerate(ended))
    assert streamed == ""
