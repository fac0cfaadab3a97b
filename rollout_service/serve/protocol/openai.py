"""OpenAI wire models (chat, responses, completions, tokenize, models, errors) and our extensions.

Requests are validated here, at the edge, so a client mistake becomes a 400 naming the field
before anything touches a rollout. Unknown extra fields are accepted (agents send vendor extras);
fields we do read are typed strictly.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, Strict, StrictBool, StrictInt, StrictStr, WithJsonSchema, field_validator, model_validator

# The fields we read are typed strictly: a JSON ``true`` is not the integer 1, ``"0.5"`` is not a
# number, ``1.0`` is not a token id (pydantic's lax mode would coerce each of them silently).
Number = Annotated[float, Strict()]  # a JSON number (an integer is one too), never a bool or a string


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True)


# ----------------------------------------------------------------------------- errors
class ServiceError(Exception):
    """An error with its HTTP status, rendered as the OpenAI error envelope."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def envelope(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def to_result(self) -> dict[str, Any]:
        """Tagged form that crosses a Serve handle without exception wrapping."""
        return {"__error__": self.status, **self.envelope()}

    @classmethod
    def from_result(cls, result: dict[str, Any]) -> "ServiceError":
        e = result["error"]
        return cls(result["__error__"], e["message"], type=e.get("type") or "", param=e.get("param"), code=e.get("code"))


class ErrorObject(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """The envelope every error answer carries (:meth:`ServiceError.envelope`), as the OpenAPI schema
    documents it (OpenAI's error object)."""

    error: ErrorObject


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ServiceError:
    return ServiceError(400, message, param=param, code=code)


# ----------------------------------------------------------------------------- chat
class FunctionCall(_Lenient):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCall(_Lenient):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


# The JSON Schema of what the validators below accept (the OpenAPI schema; a fuzzer generating from
# it sends what is served): text parts only, and content required except on assistant messages.
_TEXT_PART = {"type": "object", "required": ["type", "text"],
              "properties": {"type": {"enum": ["text", "input_text", "output_text"]}, "text": {"type": "string"}}}
_CONTENT = {"anyOf": [{"type": "string"}, {"type": "array", "items": _TEXT_PART}, {"type": "null"}]}
_CONTENT_UNLESS_ASSISTANT = {"anyOf": [{"properties": {"role": {"const": "assistant"}}},
                                       {"required": ["content"], "properties": {"content": {"not": {"type": "null"}}}}]}


class ChatMessage(_Lenient):
    model_config = ConfigDict(json_schema_extra=_CONTENT_UNLESS_ASSISTANT)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Annotated[str | list[dict[str, Any]] | None, WithJsonSchema(_CONTENT)] = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    # NeMo Gym echo fields (stateless mode)
    prompt_token_ids: list[StrictInt] | None = None
    generation_token_ids: list[StrictInt] | None = None
    generation_log_probs: list[Number] | None = None

    @field_validator("content")
    @classmethod
    def _parts_are_text(cls, v):
        if isinstance(v, list):
            for i, part in enumerate(v):
                if not isinstance(part, dict) or part.get("type") not in ("text", "input_text", "output_text"):
                    raise ValueError(f"content part {i}: only text parts are supported")
                if not isinstance(part.get("text"), str):
                    raise ValueError(f"content part {i}: 'text' must be a string")
        return v

    @model_validator(mode="after")
    def _role_rules(self):
        if self.role == "tool" and self.content is None:
            raise ValueError("a tool message needs content")
        if self.role in ("user", "system", "developer") and self.content is None:
            raise ValueError(f"a {self.role} message needs content")
        return self

    def to_plain(self) -> dict[str, Any]:
        """A plain dict for the on-policy core: text content, developer -> system, OpenAI tool-call shape."""
        d: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role}
        d["content"] = content_text(self.content)
        if self.name is not None:
            d["name"] = self.name
        if self.tool_calls:
            d["tool_calls"] = [tc.model_dump(exclude_none=True) for tc in self.tool_calls]
        if self.tool_call_id is not None:
            d["tool_call_id"] = self.tool_call_id
        reasoning = self.reasoning_content if self.reasoning_content is not None else self.reasoning
        if reasoning is not None:
            d["reasoning_content"] = reasoning
        for k in ("prompt_token_ids", "generation_token_ids", "generation_log_probs"):
            v = getattr(self, k)
            if v is not None:
                d[k] = v
        return d


def content_text(content: str | list[dict[str, Any]] | None) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(p["text"] for p in content)


class FunctionDef(_Lenient):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class ToolDef(_Lenient):
    type: Literal["function"] = "function"
    function: FunctionDef


class NamedFunction(_Lenient):
    name: str


class NamedToolChoice(_Lenient):
    type: Literal["function"] = "function"
    function: NamedFunction


class AllowedTools(_Lenient):
    mode: Literal["auto", "required"] = "auto"
    tools: list[dict[str, Any]] = Field(min_length=1)


class AllowedToolsChoice(_Lenient):
    """OpenAI's ``allowed_tools``: the model may only call these (the prompt lists only them)."""

    type: Literal["allowed_tools"]
    allowed_tools: AllowedTools


class _JSONSchemaSpec(_Lenient):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: StrictBool | None = None


class TextFormat(_Lenient):
    type: Literal["text"]


class JSONObjectFormat(_Lenient):
    type: Literal["json_object"]


class JSONSchemaFormat(_Lenient):
    type: Literal["json_schema"]
    json_schema: _JSONSchemaSpec


ResponseFormat = Annotated[TextFormat | JSONObjectFormat | JSONSchemaFormat, Field(discriminator="type")]


class ResponsesJSONSchemaFormat(_JSONSchemaSpec):
    type: Literal["json_schema"]


class ResponsesTextConfig(_Lenient):
    """Responses' ``text``: its ``format`` is chat's ``response_format`` with the schema fields inlined."""

    format: Annotated[TextFormat | JSONObjectFormat | ResponsesJSONSchemaFormat, Field(discriminator="type")] | None = None
    verbosity: Literal["low", "medium", "high"] | None = None

    def response_format(self) -> dict[str, Any] | None:
        """In chat-completions form (what the turn runner takes), ``None`` for plain text."""
        f = self.format
        if f is None or f.type == "text":
            return None
        if f.type == "json_object":
            return {"type": "json_object"}
        spec = f.model_dump(by_alias=True, exclude_none=True, exclude={"type"})
        return {"type": "json_schema", "json_schema": spec}


def response_format_dict(fmt: TextFormat | JSONObjectFormat | JSONSchemaFormat | None) -> dict[str, Any] | None:
    """Chat's ``response_format`` as the turn runner takes it (``None`` for plain text)."""
    if fmt is None or fmt.type == "text":
        return None
    return fmt.model_dump(by_alias=True, exclude_none=True)


# ----------------------------------------------------------------------------- fields not honoured
# Fields of OpenAI's or vLLM's request models that this service does not honour. Unknown fields are
# accepted (agents send vendor extras), but one of these with a value other than its inert default
# would be answered as if it had not been sent: another distribution, prompt or output than the one
# asked for. That is a 400 naming the field (``unsupported_parameter``), before anything is stored.
_SAMPLER = "changes the sampling distribution, so the returned logprobs would not be the policy's own"
_PROMPT = "the prompt is the rollout's own tokens, built by the service's chat template from the messages"
_OUTPUT = "the service does not return it"
_ENGINE = "the service schedules and caches engine requests itself"
_STRUCTURED = ("use structured_outputs or response_format (chat) / text.format (Responses) or tool_choice for "
               "constrained output")


def _rule(why: str, *inert: Any) -> tuple[tuple[Any, ...], str]:
    return inert, why


_COMMON_UNHONOURED: dict[str, tuple[tuple[Any, ...], str]] = {
    "logit_bias": _rule(_SAMPLER, {}),
    "min_tokens": _rule(_SAMPLER, 0),
    "allowed_token_ids": _rule(_SAMPLER),
    "bad_words": _rule(_SAMPLER, []),
    "thinking_token_budget": _rule(_SAMPLER),
    "logits_processors": _rule(_SAMPLER, []),
    "vllm_xargs": _rule(_SAMPLER, {}),
    "repetition_detection": _rule("it stops generations early, unlike the policy"),
    "watermarking": _rule(_SAMPLER, False),
    "best_of": _rule("one sample per call (each sample of a rollout is its own rollout id)", 1),
    "use_beam_search": _rule("beam search is not sampling from the policy", False),
    "length_penalty": _rule("beam search is not sampling from the policy", 1, 1.0),
    "guided_json": _rule(_STRUCTURED),
    "guided_regex": _rule(_STRUCTURED),
    "guided_choice": _rule(_STRUCTURED),
    "guided_grammar": _rule(_STRUCTURED),
    "structural_tag": _rule(_STRUCTURED),
    "return_token_offsets": _rule(_OUTPUT, False),
    "return_prompt_text": _rule(_OUTPUT, False),
    "return_mm_kwargs": _rule(_OUTPUT, False),
    "spaces_between_special_tokens": _rule("the service detokenizes with the tokenizer's own spacing", True),
    "include_reasoning": _rule("the reasoning is part of the rollout and always returned", True),
    "mm_processor_kwargs": _rule("only text is served", {}),
    "media_io_kwargs": _rule("only text is served", {}),
    "prompt_embeds": _rule("only token ids or text are served"),
    "priority": _rule(_ENGINE, 0),
    "cache_salt": _rule(_ENGINE + " (prefix caching is salted per weight version)"),
    "kv_transfer_params": _rule(_ENGINE, {}),
    "ec_transfer_params": _rule(_ENGINE, {}),
}

CHAT_UNHONOURED = {
    **_COMMON_UNHONOURED,
    "chat_template": _rule(_PROMPT),
    "add_generation_prompt": _rule(_PROMPT, True),
    "continue_final_message": _rule(_PROMPT, False),
    "add_special_tokens": _rule(_PROMPT, False),
    "documents": _rule(_PROMPT, []),
    "echo": _rule(_OUTPUT, False),
    "functions": _rule("use tools (the legacy functions field is not read)", []),
    "function_call": _rule("use tool_choice (the legacy function_call field is not read)"),
    "audio": _rule("only text is served"),
    "modalities": _rule("only text is served", ["text"]),
    "prediction": _rule("predicted outputs are not served"),
    "web_search_options": _rule("hosted tools are not served (function tools only)"),
}

COMPLETION_UNHONOURED = {
    **_COMMON_UNHONOURED,
    "suffix": _rule("insertion (suffix) is not served"),
    "response_format": _rule(_STRUCTURED),
}

TOKENIZE_UNHONOURED = {
    "chat_template": _rule(_PROMPT),
    "continue_final_message": _rule(_PROMPT, False),
    "documents": _rule(_PROMPT, []),
    "mm_processor_kwargs": _rule("only text is served", {}),
    "media_io_kwargs": _rule("only text is served", {}),
}

RESPONSES_UNHONOURED = {
    **_COMMON_UNHONOURED,
    "background": _rule("background responses are not served (nothing is kept by response id)", False),
    "conversation": _rule("conversations are not kept by the service: send the full input"),
    "prompt": _rule("stored prompt templates are not served: send the input"),
    "truncation": _rule("the input is never truncated: it is the rollout's history", "disabled"),
    "max_tool_calls": _rule("hosted tools are not served (function tools only)"),
    "enable_response_messages": _rule(_OUTPUT, False),
    "previous_input_messages": _rule("send the full input", []),
    "prompt_logprobs": _rule(_OUTPUT + " (chat completions and completions return it)"),
    "structured_outputs": _rule("use text.format (chat completions and completions take structured_outputs)"),
    "truncate_prompt_tokens": _rule(_PROMPT),
    "logprob_token_ids": _rule(_OUTPUT + " (chat completions and completions return it)"),
}
# Responses' include: what the service has of each output is already in it; these ask for more.
# reasoning.encrypted_content: reasoning is returned as plain text anyway;
# message.output_text.logprobs: the generation's logprobs on the message's output_text (as vLLM).
OUTPUT_LOGPROBS = "message.output_text.logprobs"
RESPONSES_INCLUDE_HONOURED = ("reasoning.encrypted_content", OUTPUT_LOGPROBS)


def _inert(value: Any, inert: tuple[Any, ...]) -> bool:
    """``None``, or equal to an inert default of the same kind (``false`` is not ``0``)."""
    if value is None:
        return True
    return any(value == v and isinstance(value, bool) == isinstance(v, bool) for v in inert)


def refuse_unhonoured(req: BaseModel, table: dict[str, tuple[tuple[Any, ...], str]]) -> None:
    """A 400 ``unsupported_parameter`` for the first field of ``table`` sent with a live value."""
    for name, value in (req.model_extra or {}).items():
        rule = table.get(name)
        if rule is not None and not _inert(value, rule[0]):
            raise bad_request(f"{name} is not supported: {rule[1]}", param=name, code="unsupported_parameter")


# vLLM's reasoning_effort values; as vLLM's server does, the effort reaches the chat template as
# ``reasoning_effort``, and ``enable_thinking`` is ``effort != "none"`` unless the call sets it.
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]


class ResponsesReasoning(_Lenient):
    """Responses' ``reasoning``: ``effort`` as chat's ``reasoning_effort``. A ``summary`` is not
    generated: the reasoning itself is returned (a ``reasoning`` item with its text)."""

    effort: ReasoningEffort | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


def template_kwargs(kwargs: dict[str, Any] | None, effort: str | None) -> dict[str, Any] | None:
    """A call's chat-template kwargs with its reasoning effort merged in, as vLLM's server does."""
    if effort is None:
        return kwargs
    merged = dict(kwargs or {})
    merged.setdefault("reasoning_effort", effort)
    merged.setdefault("enable_thinking", effort != "none")
    return merged


INT64_MAX, INT64_MIN = 2**63 - 1, -(2**63)
MAX_PROMPTS = 1024  # prompts in one completions request (vLLM's VLLM_MAX_COMPLETION_PROMPTS default)


def stream_options_need_stream(stream_options: dict[str, Any] | None, stream: bool) -> None:
    """vLLM's rule: ``stream_options`` (any non-empty value) only with ``stream: true``."""
    if stream_options and not stream:
        raise bad_request("Stream options can only be defined when `stream=True`.", param="stream_options")


def prompt_logprobs_not_streamed(prompt_logprobs: int | None, stream: bool) -> None:
    """vLLM's rule: no prompt logprobs on a stream (0 asks for none, so it passes)."""
    if stream and prompt_logprobs is not None and (prompt_logprobs > 0 or prompt_logprobs == -1):
        raise bad_request("`prompt_logprobs` are not available when `stream=True`.", param="prompt_logprobs")


class SamplingFields(_Lenient):
    """Sampling fields shared by chat, responses and completions (OpenAI + vLLM extras)."""

    n: StrictInt | None = None
    temperature: Number | None = None
    top_p: Number | None = None
    top_k: StrictInt | None = None
    min_p: Number | None = None
    max_tokens: StrictInt | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[StrictInt] | None = None
    seed: StrictInt | None = None
    presence_penalty: Number | None = None
    frequency_penalty: Number | None = None
    repetition_penalty: Number | None = None
    ignore_eos: StrictBool | None = None
    skip_special_tokens: StrictBool | None = None
    include_stop_str_in_output: StrictBool | None = None

    @field_validator("seed")
    @classmethod
    def _seed_in_range(cls, v):
        # vLLM's bound and answer (a pydantic range error on body.seed); -1 is vLLM's "no seed".
        if v is None:
            return v
        for bound, kind, word in ((INT64_MAX, "less_than_equal", "less"), (INT64_MIN, "greater_than_equal", "greater")):
            if (v > bound) if word == "less" else (v < bound):
                key = "le" if word == "less" else "ge"
                raise bad_request(f"1 validation error:\n  {{'type': '{kind}', 'loc': 'body.seed', 'msg': 'Input should be "
                                  f"{word} than or equal to {bound}', 'input': '{v}', 'ctx': {{'{key}': {bound}}}}}",
                                  param="body.seed")
        return v

    def sampling_kwargs(self) -> dict[str, Any]:
        keys = ("n", "temperature", "top_p", "top_k", "min_p", "stop", "stop_token_ids", "seed",
                "presence_penalty", "frequency_penalty", "repetition_penalty", "ignore_eos",
                "skip_special_tokens", "include_stop_str_in_output")
        return {k: getattr(self, k) for k in keys if getattr(self, k) is not None}


# NeMo Gym 0.7's exact-prefix extension: the prompt must start with these ids (docs/data-plane.md).
# Typed loosely here so that every mistake (not a list, a bool, an id outside the vocabulary) gets
# the same 400 from the on-policy core (``invalid_required_prefix``); the schema says what is meant.
RequiredPrefix = Annotated[Any, WithJsonSchema({"anyOf": [{"type": "array", "items": {"type": "integer", "minimum": 0}},
                                                          {"type": "null"}]})]


class GenerationFields(SamplingFields):
    """vLLM's fields chat completions and completions share beyond sampling, and their rules."""

    stream: StrictBool = False
    stream_options: dict[str, Any] | None = None
    return_token_ids: StrictBool | None = None
    prompt_logprobs: StrictInt | None = None
    # vLLM's logprob_token_ids: these ids' logprobs at every generated position, instead of the top ones
    logprob_token_ids: list[StrictInt] | None = None
    # vLLM's prompt truncation (serve/truncation.py): not under a rollout id
    truncate_prompt_tokens: StrictInt | None = None
    truncation_side: str | None = None
    # vLLM's StructuredOutputsParams fields (json, regex, choice, grammar, json_object, structural_tag,
    # whitespace options); checked by vLLM's own request model where the dialect builds the grammar.
    structured_outputs: dict[str, Any] | None = None

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _truncation_in_range(cls, v):
        if v is not None and not -1 <= v <= INT64_MAX:  # vLLM's bounds, named as its server names them
            bound = "greater than or equal to -1" if v < -1 else f"less than or equal to {INT64_MAX}"
            raise bad_request(f"truncate_prompt_tokens: Input should be {bound} (got {v})",
                              param="body.truncate_prompt_tokens")
        return v

    @field_validator("truncation_side")
    @classmethod
    def _truncation_side(cls, v):
        if v is not None and v not in ("left", "right"):
            raise bad_request(f"truncation_side: Input should be 'left' or 'right' (got {v!r})",
                              param="body.truncation_side")
        return v

    @model_validator(mode="after")
    def _stream_rules(self):
        stream_options_need_stream(self.stream_options, self.stream)
        prompt_logprobs_not_streamed(self.prompt_logprobs, self.stream)
        return self

    def sampling_kwargs(self) -> dict[str, Any]:
        kwargs = super().sampling_kwargs()
        if self.prompt_logprobs is not None:
            kwargs["prompt_logprobs"] = self.prompt_logprobs
        if self.logprob_token_ids:
            kwargs["logprob_token_ids"] = list(self.logprob_token_ids)
        return kwargs


class ChatCompletionRequest(GenerationFields):
    model: str
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[ToolDef] | None = None
    # Any other object (a hosted tool's type, a malformed allowed_tools) reaches the one tool_choice
    # path (serve/dialects/common.tool_choice_of), which names what is wrong: 400 either way.
    tool_choice: Literal["auto", "none", "required"] | NamedToolChoice | AllowedToolsChoice | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool | None = None
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_tokens_as_token_ids: StrictBool | None = None
    include_reasoning: StrictBool = True
    required_prefix_token_ids: RequiredPrefix = None
    response_format: ResponseFormat | None = None
    reasoning_effort: ReasoningEffort | None = None
    metadata: dict[str, Any] | None = None
    user: str | None = None

    @model_validator(mode="after")
    def _checks(self):
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs=true")
        if self.logprob_token_ids and not self.logprobs:  # vLLM's rule and words
            raise bad_request("when using `logprob_token_ids`, `logprobs` must be set to true.",
                              param="logprob_token_ids")
        return self


# ----------------------------------------------------------------------------- completions
class CompletionRequest(GenerationFields):
    model: str
    prompt: Annotated[str | list[StrictInt] | list[str] | list[list[StrictInt]], WithJsonSchema({"anyOf": [
        {"type": "string", "minLength": 1},
        {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1},
        {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1, "maxItems": MAX_PROMPTS},
        {"type": "array", "items": {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1},
         "minItems": 1, "maxItems": MAX_PROMPTS},
    ]})]
    logprobs: StrictInt | None = None
    echo: StrictBool | None = None

    @model_validator(mode="after")
    def _checks(self):
        if self.echo and (self.model_extra or {}).get("suffix"):
            raise bad_request("Echo is unsupported with suffix.", param="suffix")
        if self.echo and self.stream and self.logprobs is not None:
            raise bad_request("echo with logprobs is not supported on a stream (the prompt's logprobs are not "
                              "streamed): send stream: false", param="echo", code="unsupported_parameter")
        if self.logprob_token_ids and self.echo and self.max_tokens == 0:  # vLLM's rules and words
            raise bad_request("`logprob_token_ids` is not supported when `echo=True` and `max_tokens=0` because no "
                              "output tokens are generated.", param="logprob_token_ids")
        if self.logprob_token_ids and self.logprobs is None:
            raise bad_request("when using `logprob_token_ids`, `logprobs` must be set.", param="logprob_token_ids")
        return self

    @field_validator("prompt")
    @classmethod
    def _prompts(cls, v):
        several = isinstance(v, list) and bool(v) and isinstance(v[0], (list, str))
        if several and len(v) > MAX_PROMPTS:  # vLLM's bound and words
            raise bad_request(f"prompt list length {len(v)} exceeds the maximum allowed count of {MAX_PROMPTS}.",
                              param="prompt")
        for one in (v if several else [v]):
            if isinstance(one, list):
                if not one:
                    raise ValueError("prompt token list is empty")
                if any((not isinstance(t, int)) or t < 0 for t in one):
                    raise ValueError("prompt token ids must be non-negative integers")
            elif one == "":
                raise ValueError("prompt is empty")
        return v[0] if several and len(v) == 1 else v

    def prompts(self) -> list[str | list[int]]:
        """The request's prompts (one, or several: vLLM answers each with its own choices)."""
        several = isinstance(self.prompt, list) and bool(self.prompt) and isinstance(self.prompt[0], (list, str))
        return list(self.prompt) if several else [self.prompt]


# ----------------------------------------------------------------------------- responses
class ResponsesRequest(SamplingFields):
    model: str
    input: Annotated[str | list[dict[str, Any]], WithJsonSchema({"anyOf": [
        {"type": "string", "minLength": 1}, {"type": "array", "items": {"type": "object"}, "minItems": 1}]})]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    # "auto" | "none" | "required" | {"type": "function", "name"} | {"type": "allowed_tools", "mode", "tools"};
    # hosted tool types are refused with a 400 (serve/dialects/common.tool_choice_of).
    tool_choice: Literal["auto", "none", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool | None = None
    max_output_tokens: StrictInt | None = None
    stream: StrictBool = False
    reasoning: ResponsesReasoning | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    previous_response_id: str | None = None
    store: StrictBool | None = None
    required_prefix_token_ids: RequiredPrefix = None
    text: ResponsesTextConfig | None = None
    # With include ["message.output_text.logprobs"]: alternatives per token (0 to engine.max_logprobs).
    top_logprobs: StrictInt | None = None

    def wants_logprobs(self) -> bool:
        include = (self.model_extra or {}).get("include")
        return isinstance(include, list) and OUTPUT_LOGPROBS in include

    @field_validator("input")
    @classmethod
    def _non_empty(cls, v):
        if (isinstance(v, str) and not v) or (isinstance(v, list) and not v):
            raise ValueError("input is empty")
        return v


# ----------------------------------------------------------------------------- tokenize
_NOTHING = {"anyOf": [{"type": "null"}, {"type": "array", "maxItems": 0}]}


class TokenizeRequest(_Lenient):
    # The forms as JSON Schema (the OpenAPI schema), as _one_of and refuse_unhonoured check them.
    model_config = ConfigDict(json_schema_extra={"oneOf": [
        {"required": ["prompt"], "properties": {"prompt": {"type": "string"}, "messages": {"type": "null"},
                                                "required_prefix_token_ids": _NOTHING}},
        {"required": ["messages"], "properties": {"messages": {"type": "array", "minItems": 1},
                                                  "prompt": {"type": "null"}, "add_generation_prompt": {"const": True},
                                                  "add_special_tokens": {"const": False}}},
    ]})

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[ToolDef] | None = None
    add_generation_prompt: StrictBool = True
    add_special_tokens: StrictBool = False
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: StrictBool = False
    required_prefix_token_ids: RequiredPrefix = None
    metadata: dict[str, Any] | None = None

    def refuse_unhonoured(self) -> None:
        """The messages form gives the next call's prompt ids, which always end with the generation
        prompt and never start with special tokens the template does not write: 400 otherwise."""
        refuse_unhonoured(self, TOKENIZE_UNHONOURED)
        if self.messages is not None and not self.add_generation_prompt:
            raise bad_request("add_generation_prompt: false is not supported: the ids are the next call's prompt, "
                              "which ends with the generation prompt", param="add_generation_prompt",
                              code="unsupported_parameter")
        if self.messages is not None and self.add_special_tokens:
            raise bad_request("add_special_tokens applies to the prompt form: the messages form gives the chat "
                              "template's ids", param="add_special_tokens", code="unsupported_parameter")

    @model_validator(mode="after")
    def _one_of(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of 'prompt' or 'messages'")
        if self.messages is not None and not self.messages:
            raise ValueError("messages is empty")
        return self


class AbortRequest(BaseModel):
    """``POST /v1/rollouts/{id}/abort``'s optional body."""

    model_config = ConfigDict(extra="forbid")
    reason: StrictStr | None = Field(None, max_length=512, description="Why (kept with the rollout's status).")
