"""Sampling options: validated here, with the parameter's name in every error.

The engine would reject most bad values too, but deep inside a Ray actor and with a message the
client cannot map to a field. Validating at the edge gives the HTTP layer a 400 naming ``param``
and keeps bad requests away from the engine. Importable without vLLM.
"""

from __future__ import annotations

import math
from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class SamplingParamsError(ValueError):
    """A sampling parameter is invalid; ``param`` names it (OpenAI error envelope's ``param``)."""

    def __init__(self, param: str, message: str):
        super().__init__(f"{param}: {message}")
        self.param = param
        self.message = message


class SamplingOptions(BaseModel):
    """What one generation call may ask of the sampler (OpenAI names, vLLM meanings)."""

    model_config = ConfigDict(extra="forbid")

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 / 0: off
    min_p: float = 0.0
    max_tokens: int | None = None
    stop: list[str] = Field(default_factory=list)
    stop_token_ids: list[int] = Field(default_factory=list)
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    top_logprobs: int = 0  # alternatives per position, besides the sampled token's own logprob
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # vLLM structured outputs (json schema, regex, grammar...) e.g. for a forced tool call.
    structured_outputs: dict[str, Any] | None = None

    @classmethod
    def validated(cls, max_top_logprobs: int = 20, **kwargs: Any) -> "SamplingOptions":
        """Build and check; raise SamplingParamsError naming the first bad parameter."""
        stop = kwargs.get("stop")
        if isinstance(stop, str):
            kwargs["stop"] = [stop]
        elif stop is None:
            kwargs.pop("stop", None)
        for k in [k for k, v in kwargs.items() if v is None and k not in ("max_tokens", "seed", "structured_outputs")]:
            kwargs.pop(k)
        unknown = set(kwargs) - set(cls.model_fields)
        if unknown:
            name = sorted(unknown)[0]
            raise SamplingParamsError(name, "unknown sampling parameter")
        try:
            opts = cls.model_validate(kwargs)
        except Exception as exc:  # pydantic.ValidationError: report its first location
            errors = getattr(exc, "errors", lambda: [])()
            param = str(errors[0]["loc"][0]) if errors and errors[0].get("loc") else "sampling"
            msg = errors[0]["msg"] if errors else str(exc)
            raise SamplingParamsError(param, msg) from None
        opts.check(max_top_logprobs)
        return opts

    def check(self, max_top_logprobs: int = 20) -> None:
        if self.n != 1:
            raise SamplingParamsError(
                "n", f"only n=1 is supported (got {self.n}); each sample of a rollout is its own rollout id"
            )
        _finite_range("temperature", self.temperature, 0.0, 2.0)
        if not (0.0 < self.top_p <= 1.0) or not math.isfinite(self.top_p):
            raise SamplingParamsError("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise SamplingParamsError("top_k", f"must be -1 (off), 0 (off) or positive, got {self.top_k}")
        _finite_range("min_p", self.min_p, 0.0, 1.0)
        if self.max_tokens is not None and self.max_tokens < 1:
            raise SamplingParamsError("max_tokens", f"must be at least 1, got {self.max_tokens}")
        if len(self.stop) > 16:
            raise SamplingParamsError("stop", "at most 16 stop strings")
        if any(not isinstance(s, str) or s == "" for s in self.stop):
            raise SamplingParamsError("stop", "stop strings must be non-empty strings")
        if any(t < 0 for t in self.stop_token_ids):
            raise SamplingParamsError("stop_token_ids", "token ids must be non-negative")
        if self.seed is not None and not (-(2**63) <= self.seed < 2**63):
            raise SamplingParamsError("seed", "must fit in a signed 64-bit integer")
        _finite_range("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _finite_range("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            raise SamplingParamsError("repetition_penalty", f"must be > 0, got {self.repetition_penalty}")
        if not (0 <= self.top_logprobs <= max_top_logprobs):
            raise SamplingParamsError("top_logprobs", f"must be in [0, {max_top_logprobs}], got {self.top_logprobs}")

    def to_vllm(self, *, max_tokens: int, cache_salt: str | None = None):
        """vLLM ``SamplingParams``. ``logprobs`` is at least 0 so the sampled token's logprob comes back."""
        from vllm import SamplingParams

        extra: dict[str, Any] = {}
        if self.structured_outputs:
            from vllm.sampling_params import StructuredOutputsParams

            extra["structured_outputs"] = StructuredOutputsParams(**self.structured_outputs)
        return SamplingParams(
            n=1,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k if self.top_k > 0 else 0,
            min_p=self.min_p,
            max_tokens=max_tokens,
            stop=list(self.stop) or None,
            stop_token_ids=list(self.stop_token_ids) or None,
            seed=self.seed,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            logprobs=self.top_logprobs,
            ignore_eos=self.ignore_eos,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            **extra,
        )


def _finite_range(name: str, value: float, lo: float, hi: float) -> None:
    if not math.isfinite(value) or not (lo <= value <= hi):
        raise SamplingParamsError(name, f"must be in [{lo}, {hi}], got {value}")
