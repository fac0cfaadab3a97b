"""Invalid sampling parameters raise the project's own error, naming the parameter.

Each rule mirrors vLLM's (``SamplingParams._verify_args`` / ``verify``) or is stricter, so no
client value reaches the engine to fail there: every valid case below is also built into a real
vLLM ``SamplingParams`` (which runs vLLM's checks) and checked against the engine's vocabulary.
"""

from __future__ import annotations

import math

import pytest

from onpolicy_fixtures import tokenizer
from rollout_service.engine.sampling import SamplingOptions, SamplingParamsError

VOCAB = len(tokenizer())  # the real Qwen tokenizer the service serves with: 151669
DEEP: dict = {}
for _ in range(100):
    DEEP = {"type": "object", "properties": {"a": DEEP}}

BAD = [
    # n: only 1
    ({"n": 2}, "n"),
    ({"n": 0}, "n"),
    ({"n": -1}, "n"),
    ({"n": True}, "n"),
    ({"n": 1.0}, "n"),
    ({"n": "1"}, "n"),
    # temperature: finite, [0, 2]
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": 2.5}, "temperature"),
    ({"temperature": math.nan}, "temperature"),
    ({"temperature": math.inf}, "temperature"),
    ({"temperature": 10**400}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"temperature": "0.5"}, "temperature"),
    ({"temperature": True}, "temperature"),
    # top_p: (0, 1]
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_p": -0.1}, "top_p"),
    ({"top_p": math.nan}, "top_p"),
    ({"top_p": False}, "top_p"),
    # top_k: -1 / 0 off, else positive; an integer that fits the engine's transport
    ({"top_k": -2}, "top_k"),
    ({"top_k": 2**64}, "top_k"),
    ({"top_k": 1.5}, "top_k"),
    ({"top_k": 5.0}, "top_k"),
    ({"top_k": True}, "top_k"),
    ({"top_k": "5"}, "top_k"),
    # min_p: [0, 1]
    ({"min_p": -0.1}, "min_p"),
    ({"min_p": 1.1}, "min_p"),
    ({"min_p": math.nan}, "min_p"),
    ({"min_p": True}, "min_p"),
    # max_tokens: an integer >= 1
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": -5}, "max_tokens"),
    ({"max_tokens": 2**64}, "max_tokens"),
    ({"max_tokens": 1.5}, "max_tokens"),
    ({"max_tokens": 16.0}, "max_tokens"),
    ({"max_tokens": True}, "max_tokens"),
    ({"max_tokens": "16"}, "max_tokens"),
    # stop: a string or a list of at most 16 non-empty strings
    ({"stop": [""]}, "stop"),
    ({"stop": ""}, "stop"),
    ({"stop": ["x"] * 17}, "stop"),
    ({"stop": [1]}, "stop"),
    ({"stop": ["a", None]}, "stop"),
    ({"stop": 5}, "stop"),
    ({"stop": {"a": 1}}, "stop"),
    # stop_token_ids: integers in [0, vocabulary size)
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"stop_token_ids": [VOCAB]}, "stop_token_ids"),
    ({"stop_token_ids": [0, 2**70]}, "stop_token_ids"),
    ({"stop_token_ids": [True]}, "stop_token_ids"),
    ({"stop_token_ids": [1.0]}, "stop_token_ids"),
    ({"stop_token_ids": ["5"]}, "stop_token_ids"),
    ({"stop_token_ids": 5}, "stop_token_ids"),
    ({"stop_token_ids": "5"}, "stop_token_ids"),
    # seed: a signed 64-bit integer
    ({"seed": 2**64}, "seed"),
    ({"seed": 2**63}, "seed"),
    ({"seed": -(2**63) - 1}, "seed"),
    ({"seed": 1.5}, "seed"),
    ({"seed": True}, "seed"),
    ({"seed": "3"}, "seed"),
    # penalties: presence / frequency in [-2, 2], repetition finite > 0
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"presence_penalty": -2.5}, "presence_penalty"),
    ({"presence_penalty": math.nan}, "presence_penalty"),
    ({"presence_penalty": True}, "presence_penalty"),
    ({"frequency_penalty": 2.01}, "frequency_penalty"),
    ({"frequency_penalty": -math.inf}, "frequency_penalty"),
    ({"frequency_penalty": "0"}, "frequency_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"repetition_penalty": -1.0}, "repetition_penalty"),
    ({"repetition_penalty": math.inf}, "repetition_penalty"),
    ({"repetition_penalty": math.nan}, "repetition_penalty"),
    ({"repetition_penalty": True}, "repetition_penalty"),
    # top_logprobs: an integer in [0, max_top_logprobs]
    ({"top_logprobs": 50}, "top_logprobs"),
    ({"top_logprobs": 21}, "top_logprobs"),
    ({"top_logprobs": -1}, "top_logprobs"),
    ({"top_logprobs": 2.0}, "top_logprobs"),
    ({"top_logprobs": True}, "top_logprobs"),
    # flags are booleans
    ({"ignore_eos": 1}, "ignore_eos"),
    ({"ignore_eos": "true"}, "ignore_eos"),
    ({"skip_special_tokens": 0}, "skip_special_tokens"),
    ({"include_stop_str_in_output": "false"}, "include_stop_str_in_output"),
    # structured outputs: exactly one known constraint, sane nesting
    ({"structured_outputs": {"json": {}, "regex": "a"}}, "structured_outputs"),
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"structured_outputs": {"bogus": 1}}, "structured_outputs"),
    ({"structured_outputs": {"json": 5}}, "structured_outputs"),
    ({"structured_outputs": {"json": DEEP}}, "structured_outputs"),
    ({"structured_outputs": "json"}, "structured_outputs"),
    # anything else is not a sampling parameter here
    ({"bogus": 1}, "bogus"),
    ({"logit_bias": {"5": 1.0}}, "logit_bias"),
    ({"best_of": 2}, "best_of"),
    ({"min_tokens": 2}, "min_tokens"),
]


@pytest.mark.parametrize("kwargs, param", BAD, ids=[f"{k}={v!r:.30}" for kw, _ in BAD for k, v in kw.items()])
def test_invalid_parameter_is_named(kwargs, param):
    with pytest.raises(SamplingParamsError) as err:
        SamplingOptions.validated(kwargs, vocab_size=VOCAB)
    assert err.value.param == param
    assert str(err.value).startswith(f"{param}: ")
    with pytest.raises(SamplingParamsError) as err:  # the keyword form is checked the same way
        SamplingOptions.validated(vocab_size=VOCAB, **kwargs)
    assert err.value.param == param


@pytest.mark.parametrize("name", ["vocab_size", "max_top_logprobs", "params"])
def test_client_keys_named_like_arguments_are_unknown_parameters(name):
    with pytest.raises(SamplingParamsError) as err:
        SamplingOptions.validated({name: 5}, vocab_size=VOCAB)
    assert err.value.param == name


def test_max_top_logprobs_is_the_bound():
    assert SamplingOptions.validated({"top_logprobs": 5}, max_top_logprobs=5).top_logprobs == 5
    with pytest.raises(SamplingParamsError) as err:
        SamplingOptions.validated({"top_logprobs": 6}, max_top_logprobs=5)
    assert err.value.param == "top_logprobs"


def test_without_a_vocabulary_size_only_negative_stop_ids_are_refused():
    assert SamplingOptions.validated({"stop_token_ids": [VOCAB]}).stop_token_ids == [VOCAB]
    with pytest.raises(SamplingParamsError):
        SamplingOptions.validated({"stop_token_ids": [-1]})


GOOD = [
    {},
    {"n": 1},
    {"temperature": 0},
    {"temperature": 0.0},
    {"temperature": 2},
    {"temperature": 0.005},  # vLLM raises it to 0.01, it does not refuse it
    {"top_p": 1},
    {"top_p": 1e-6},
    {"top_k": -1},
    {"top_k": 0},
    {"top_k": 1},
    {"top_k": 10**9},  # the engine caps it at the vocabulary
    {"min_p": 0},
    {"min_p": 1.0},
    {"max_tokens": 1},
    {"max_tokens": None},
    {"stop": "END"},
    {"stop": ["a", "b"] * 8},
    {"stop": None},
    {"stop_token_ids": [0, VOCAB - 1]},
    {"stop_token_ids": []},
    {"seed": -1},
    {"seed": 0},
    {"seed": 2**63 - 1},
    {"seed": -(2**63)},
    {"seed": None},
    {"presence_penalty": -2, "frequency_penalty": 2},
    {"repetition_penalty": 0.01},
    {"repetition_penalty": 3},
    {"top_logprobs": 0},
    {"top_logprobs": 20},
    {"ignore_eos": True, "skip_special_tokens": False, "include_stop_str_in_output": True},
    {"temperature": None, "top_p": None, "top_k": None},  # null means "default"
    {"structured_outputs": {"json": {"type": "object", "properties": {"city": {"type": "string"}}}}},
    {"structured_outputs": {"regex": "[a-z]+"}},
    {"structured_outputs": {"choice": ["yes", "no"]}},
    {"structured_outputs": None},
]


@pytest.mark.parametrize("kwargs", GOOD, ids=[repr(g)[:40] for g in GOOD])
def test_valid_parameters_pass_and_vllm_accepts_them(kwargs):
    opts = SamplingOptions.validated(kwargs, vocab_size=VOCAB)
    sp = opts.to_vllm(max_tokens=opts.max_tokens or 16)  # vLLM's own _verify_args runs here
    assert sp.n == 1
    assert all(0 <= t < VOCAB for t in sp.stop_token_ids)


def test_valid_parameters_convert_to_vllm():
    opts = SamplingOptions.validated(temperature=0.7, top_p=0.9, top_k=20, max_tokens=5, stop="END", seed=3, top_logprobs=2)
    sp = opts.to_vllm(max_tokens=5)
    assert (sp.temperature, sp.top_p, sp.top_k, sp.max_tokens, sp.seed, sp.logprobs) == (0.7, 0.9, 20, 5, 3, 2)
    assert sp.stop == ["END"]


def test_engine_detokenizes_only_for_stop_strings():
    """Nothing reads the engine's text (the data plane parses ids): vLLM skips its detokenizer and the
    logprob token strings, except when stop strings need text to match on."""
    assert SamplingOptions.validated(temperature=1.0).to_vllm(max_tokens=5).detokenize is False
    assert SamplingOptions.validated(stop=["END"]).to_vllm(max_tokens=5).detokenize is True


@pytest.mark.parametrize("body, param", [
    ({"seed": 2**64}, "body.seed"),
    ({"seed": -(2**63) - 1}, "body.seed"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"stream": True, "prompt_logprobs": 1}, "prompt_logprobs"),
    ({"stream": True, "prompt_logprobs": -1}, "prompt_logprobs"),
])
def test_request_fields_vllm_refuses_are_refused_naming_them_as_vllm_does(body, param):
    from rollout_service.serve.protocol.envelope import ServiceError
    from rollout_service.serve.protocol.openai import ChatCompletionRequest, CompletionRequest

    for model, base in ((CompletionRequest, {"prompt": "hi"}), (ChatCompletionRequest, {"messages": [{"role": "user", "content": "hi"}]})):
        with pytest.raises(ServiceError) as info:
            model(model="m", **base, **body)
        assert info.value.status == 400 and info.value.param == param


@pytest.mark.parametrize("body", [{"seed": None}, {"seed": -1}, {"seed": 2**63 - 1}, {"stream_options": {}},
                                  {"stream": True, "prompt_logprobs": 0}, {"stream_options": None}])
def test_what_vllm_accepts_is_accepted(body):
    from rollout_service.serve.protocol.openai import ChatCompletionRequest, CompletionRequest

    CompletionRequest(model="m", prompt="hi", **body)
    ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], **body)


def test_prompt_logprobs_within_the_engines_bound():
    assert SamplingOptions.validated(prompt_logprobs=3, max_top_logprobs=20).prompt_logprobs == 3
    for bad in (-2, 21, -1):
        with pytest.raises(SamplingParamsError) as info:
            SamplingOptions.validated(prompt_logprobs=bad, max_top_logprobs=20, vocab_size=VOCAB)
        assert info.value.param == "prompt_logprobs"
