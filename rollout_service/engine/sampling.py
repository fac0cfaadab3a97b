"""Sampling options: validated at the edge, with the parameter's name in every error.

The engine would reject bad values too, but deep inside a Ray actor and with a message the client
cannot map to a field — and some it would not reject at all before they fail on the way in (an
integer too large for the engine's MessagePack transport). Validating at the edge gives the HTTP
layer a 400 naming ``param`` and keeps bad requests away from the engine. Two layers: a strict JSON
type layer of our own (a JSON ``true`` is not the integer 1, ``"0.5"`` is not a number), then
vLLM's own ``SamplingParams`` checks on the values, plus the few rules vLLM checks only inside the
engine (stop token ids in the vocabulary, ``top_logprobs`` within its ``max_logprobs``) or not at
all (``n`` is 1, 64-bit integers). Importable without vLLM.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

_INT64 = (-(2**63), 2**63)  # the engine's MessagePack transport carries at most 64-bit integers
_NULLABLE = ("max_tokens", "seed", "structured_outputs")  # ``None`` here is a value, not "default"


class SamplingParamsError(ValueError):
    """A sampling parameter is invalid; ``param`` names it (OpenAI error envelope's ``param``)."""

    def __init__(self, param: str, message: str):
        super().__init__(f"{param}: {message}")
        self.param = param
        self.message = message

    def __reduce__(self):  # crosses process boundaries (Ray) with its parameter
        return type(self), (self.param, self.message)


class SamplingOptions(BaseModel):
    """What one generation call may ask of the sampler (OpenAI names, vLLM meanings).

    Strict types: integers are JSON integers (not bools, floats or strings), numbers are JSON
    numbers (not bools or strings), flags are JSON booleans.
    """

    model_config = ConfigDict(extra="forbid", strict=True)

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
    # vLLM's logprob_token_ids: these ids' logprobs at every position (instead of the top ones)
    logprob_token_ids: list[int] | None = None
    # vLLM's prompt logprobs: per prompt position (the first has none) the prompt token's raw logprob
    # and the top ``prompt_logprobs`` alternatives (-1: the whole vocabulary); None: not asked.
    prompt_logprobs: int | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # vLLM structured outputs (json schema, regex, grammar...) e.g. for a forced tool call.
    structured_outputs: dict[str, Any] | None = None

    @classmethod
    def validated(
        cls,
        params: Mapping[str, Any] | None = None,
        /,
        max_top_logprobs: int = 20,
        vocab_size: int | None = None,
        **kwargs: Any,
    ) -> "SamplingOptions":
        """Build and check; raise SamplingParamsError naming the first bad parameter.

        The client's parameters come as ``params`` (a mapping: any key in it, even one named like
        the arguments below, is a sampling parameter) and/or as keyword arguments.
        ``max_top_logprobs`` bounds ``top_logprobs`` (the engine's ``max_logprobs``);
        ``vocab_size`` bounds ``stop_token_ids`` — pass the engine's vocabulary size (vLLM checks
        against the model's, which may be larger than the tokenizer's); ``None`` checks only
        that ids are non-negative. ``None`` values mean "default" (except for ``max_tokens``,
        ``seed`` and ``structured_outputs``, whose default is ``None``).
        """
        if params is not None and not isinstance(params, Mapping):
            raise SamplingParamsError("sampling", f"sampling parameters must be a mapping, got {type(params).__name__}")
        kwargs = {**(params or {}), **kwargs}
        for name in kwargs:
            if not isinstance(name, str):
                raise SamplingParamsError(str(name), "unknown sampling parameter")
        stop = kwargs.get("stop")
        if isinstance(stop, str):
            kwargs["stop"] = [stop]
        for k in [k for k, v in kwargs.items() if v is None and k not in _NULLABLE]:
            kwargs.pop(k)
        unknown = set(kwargs) - set(cls.model_fields)
        if unknown:
            name = sorted(unknown)[0]
            raise SamplingParamsError(name, "unknown sampling parameter")
        try:
            opts = cls.model_validate(kwargs)
        except ValidationError as exc:  # report its first location, e.g. stop_token_ids[2]
            err = exc.errors()[0]
            loc = err.get("loc") or ("sampling",)
            msg = f"{err['msg']}, got {type(err.get('input')).__name__}"
            if len(loc) > 1:
                msg += " at " + str(loc[0]) + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc[1:])
            raise SamplingParamsError(str(loc[0]), msg) from None
        opts.check(max_top_logprobs, vocab_size=vocab_size)
        return opts

    def check(self, max_top_logprobs: int = 20, *, vocab_size: int | None = None) -> None:
        """This service's own rules, then vLLM's: the values are built into a real ``SamplingParams``
        (its ``_verify_args``), and a ``VLLMValidationError`` is reported under the parameter it
        names (or that its message starts with). Skipped without vLLM (the types are still checked)."""
        if self.n != 1:
            raise SamplingParamsError(
                "n", f"only n=1 is supported (got {self.n}); each sample of a rollout is its own rollout id"
            )
        for name in ("top_k", "max_tokens", "seed"):  # what the engine's MessagePack transport carries
            value = getattr(self, name)
            if value is not None:
                _int64(name, value)
        if len(self.stop) > 16:
            raise SamplingParamsError("stop", "at most 16 stop strings")
        for j, t in enumerate(self.stop_token_ids):  # vLLM checks these only inside the engine
            if t < 0:
                raise SamplingParamsError("stop_token_ids", f"stop_token_ids[{j}] = {t}: token ids are non-negative")
            if vocab_size is not None and t >= vocab_size:
                raise SamplingParamsError(
                    "stop_token_ids", f"stop_token_ids[{j}] = {t} is outside the vocabulary [0, {vocab_size})"
                )
        if not (0 <= self.top_logprobs <= max_top_logprobs):  # the engine's max_logprobs
            raise SamplingParamsError("top_logprobs", f"must be in [0, {max_top_logprobs}], got {self.top_logprobs}")
        if self.prompt_logprobs is not None:  # vLLM's words (the engine checks the maximum)
            if self.prompt_logprobs < -1:
                raise SamplingParamsError("prompt_logprobs", "`prompt_logprobs` must be a positive value or -1.")
            asked = vocab_size if self.prompt_logprobs == -1 and vocab_size is not None else self.prompt_logprobs
            if max_top_logprobs != -1 and asked > max_top_logprobs:
                raise SamplingParamsError("prompt_logprobs", f"Requested prompt logprobs of {asked}, which is greater "
                                                             f"than max allowed: {max_top_logprobs}")
        if self.logprob_token_ids is not None:  # vLLM's bounds and words (it checks the vocabulary in the engine)
            if len(self.logprob_token_ids) > 128:
                raise SamplingParamsError("logprob_token_ids", f"Requested logprob_token_ids of length "
                                                               f"{len(self.logprob_token_ids)}, which is greater than "
                                                               "max allowed: 128")
            bad = [t for t in self.logprob_token_ids if t < 0 or (vocab_size is not None and t >= vocab_size)]
            if bad:
                raise SamplingParamsError("logprob_token_ids", f"token_id(s) {bad} in logprob_token_ids contain "
                                                               f"out-of-vocab token ids. Vocabulary size: {vocab_size}")
        if self.structured_outputs is not None:
            _check_structured_outputs(self.structured_outputs)
        _check_with_vllm(self)

    def to_vllm(self, *, max_tokens: int, cache_salt: str | None = None):
        """vLLM ``SamplingParams``. ``logprobs`` is at least 0 so the sampled token's logprob comes back.

        ``detokenize`` only when there are stop strings (vLLM matches them on text): nothing reads
        the engine's text — the data plane parses the ids itself — so the engine's front-end skips
        its incremental detokenizer and the decoding of every logprob's token string."""
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
            logprobs=None if self.logprob_token_ids else self.top_logprobs,
            logprob_token_ids=list(self.logprob_token_ids) if self.logprob_token_ids else None,
            prompt_logprobs=self.prompt_logprobs,
            ignore_eos=self.ignore_eos,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            detokenize=bool(self.stop),
            **extra,
        )


def _check_with_vllm(opts: SamplingOptions) -> None:
    """vLLM's own checks (``SamplingParams._verify_args``) on the values as the client sent them."""
    try:
        from vllm import SamplingParams
        from vllm.exceptions import VLLMValidationError
    except ImportError:  # pragma: no cover - the ingress of a deployment always has vLLM
        return
    try:
        SamplingParams(
            n=1, temperature=opts.temperature, top_p=opts.top_p, top_k=opts.top_k, min_p=opts.min_p,
            max_tokens=opts.max_tokens, stop=list(opts.stop) or None, stop_token_ids=list(opts.stop_token_ids) or None,
            seed=opts.seed, presence_penalty=opts.presence_penalty, frequency_penalty=opts.frequency_penalty,
            repetition_penalty=opts.repetition_penalty, logprobs=opts.top_logprobs, detokenize=True,
        )
    except VLLMValidationError as exc:
        message = " ".join(str(exc.args[0] if exc.args else exc).split())
        first = message.split(" ", 1)[0]
        param = exc.parameter or (first if first in SamplingOptions.model_fields else "sampling")
        if param == "logprobs":
            param = "top_logprobs"
        raise SamplingParamsError(param, message) from None


def _int64(name: str, value: int) -> None:
    if not (_INT64[0] <= value < _INT64[1]):
        raise SamplingParamsError(name, "must fit in a signed 64-bit integer")


def _check_structured_outputs(spec: dict[str, Any]) -> None:
    """What ``to_vllm`` and the engine's first checks would refuse: unknown keys, not exactly one
    constraint, a schema nested too deeply. A schema its grammar backend cannot compile is still
    found only by the engine (that needs the backend and the tokenizer). Skipped without vLLM."""
    try:
        from vllm import sampling_params as vsp
    except ImportError:  # pragma: no cover - the ingress of a deployment always has vLLM
        return
    import dataclasses

    known = {f.name for f in dataclasses.fields(vsp.StructuredOutputsParams) if f.init}
    unknown = sorted(str(k) for k in spec if k not in known)
    if unknown:
        raise SamplingParamsError("structured_outputs", f"unknown key {unknown[0]!r} (known: {', '.join(sorted(known))})")
    try:
        vsp.StructuredOutputsParams(**spec)
        check = getattr(vsp, "check_json_nesting", None)
        if check is not None:
            check(spec.get("json"))
            check(spec.get("structural_tag"), structural_tag=True)
    except ValidationError as exc:  # vLLM's params are a pydantic dataclass: wrong value types
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err.get("loc") or ())
        raise SamplingParamsError("structured_outputs", f"{where}: {err['msg']}") from None
    except Exception as exc:  # noqa: BLE001 - TypeError (unknown key) or vLLM's own validation error
        raise SamplingParamsError("structured_outputs", " ".join(str(exc).split())[:300]) from None
