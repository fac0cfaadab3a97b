"""Invalid sampling parameters raise the project's own error, naming the parameter."""

from __future__ import annotations

import pytest

from rollout_service.engine.sampling import SamplingOptions, SamplingParamsError


@pytest.mark.parametrize(
    "kwargs, param",
    [
        ({"n": 2}, "n"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": 2.5}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"stop": [""]}, "stop"),
        ({"stop": ["x"] * 17}, "stop"),
        ({"seed": 2**64}, "seed"),
        ({"temperature": "hot"}, "temperature"),
        ({"top_logprobs": 50}, "top_logprobs"),
        ({"bogus": 1}, "bogus"),
    ],
)
def test_invalid_parameter_is_named(kwargs, param):
    with pytest.raises(SamplingParamsError) as err:
        SamplingOptions.validated(**kwargs)
    assert err.value.param == param
    assert param in str(err.value)


def test_valid_parameters_convert_to_vllm():
    opts = SamplingOptions.validated(temperature=0.7, top_p=0.9, top_k=20, max_tokens=5, stop="END", seed=3, top_logprobs=2)
    sp = opts.to_vllm(max_tokens=5)
    assert (sp.temperature, sp.top_p, sp.top_k, sp.max_tokens, sp.seed, sp.logprobs) == (0.7, 0.9, 20, 5, 3, 2)
    assert sp.stop == ["END"]
