"""OpenAI request models (chat completions, Responses, completions, tokenize) and our extensions.

Requests are validated here, at the edge, so a client mistake becomes a 400 naming the field
before anything touches a rollout. Unknown extra fields are accepted (agents send vendor extras);
fields we do read are typed strictly. What the requests are made of (messages, tools, response
formats) is in :mod:`.messages`, the fields refused in :mod:`.unhonoured`, the error envelope in
:mod:`.envelope`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, WithJsonSchema, field_validator, model_validator

from rollout_service.serve.protocol.envelope import bad_request
from rollout_service.serve.protocol.messages import (
    AllowedToolsChoice,
    ChatMessage,
    Lenient,
    NamedToolChoice,
    Number,
    ResponseFormat,
    ResponsesTextConfig,
    ToolDef,
)
from rollout_service.serve.protocol.unhonoured import OUTPUT_LOGPROBS, TOKENIZE_UNHONOURED, refuse_unhonoured


# ----------------------------------------------------------------------------- shared
# vLLM's reasoning_effort values; as vLLM's server does, the effort reaches the chat template as
# ``reasoning_effort``, and ``enable_thinking`` is ``effort != "none"`` unless the call sets it.
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]


class ResponsesReasoning(Lenient):
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


class SamplingFields(Lenient):
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


def continue_without_generation_prompt(continue_final_message: bool, add_generation_prompt: bool, sent: bool) -> None:
    """vLLM's rule, in its and transformers' words: a continued final message gets no generation prompt."""
    if continue_final_message and add_generation_prompt:
        if sent:
            raise bad_request("Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
        raise bad_request("continue_final_message and add_generation_prompt are not compatible. Use "
                          "continue_final_message when you want the model to continue the final message, and "
                          "add_generation_prompt when you want to add a header that will prompt it to start a new "
                          "assistant message instead.")


# ----------------------------------------------------------------------------- chat
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
    # vLLM's prompt forms (stateless calls only: serve/dialects/chat.turn_request refuses them under a rollout id)
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    echo: StrictBool = False

    @model_validator(mode="after")
    def _checks(self):
        continue_without_generation_prompt(self.continue_final_message, self.add_generation_prompt,
                                           "add_generation_prompt" in self.model_fields_set)
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


class TokenizeRequest(Lenient):
    # The forms as JSON Schema (the OpenAPI schema), as _one_of and refuse_unhonoured check them.
    model_config = ConfigDict(json_schema_extra={"oneOf": [
        {"required": ["prompt"], "properties": {"prompt": {"type": "string"}, "messages": {"type": "null"},
                                                "required_prefix_token_ids": _NOTHING}},
        {"required": ["messages"], "properties": {"messages": {"type": "array", "minItems": 1},
                                                  "prompt": {"type": "null"}}},
    ]})

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[ToolDef] | None = None
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    add_special_tokens: StrictBool = False
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: StrictBool = False
    required_prefix_token_ids: RequiredPrefix = None
    metadata: dict[str, Any] | None = None

    def refuse_unhonoured(self, rollout_id: str | None) -> None:
        """Under a rollout id (or a required prefix) the messages form gives the next call's prompt ids,
        which end with the generation prompt and hold only the special tokens the template writes: 400
        otherwise. Without one, vLLM's forms are served as vLLM serves them."""
        refuse_unhonoured(self, TOKENIZE_UNHONOURED)
        if self.messages is None or (rollout_id is None and self.required_prefix_token_ids is None):
            return
        for name, live in (("continue_final_message", self.continue_final_message),
                           ("add_generation_prompt", not self.add_generation_prompt),
                           ("add_special_tokens", self.add_special_tokens)):
            if live:
                raise bad_request(f"{name} is not supported under a rollout id or a required prefix: the ids are the "
                                  "next call's prompt, which ends with the generation prompt and holds only the "
                                  "template's special tokens (send it without them to use it)", param=name,
                                  code="unsupported_parameter")

    @model_validator(mode="after")
    def _one_of(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of 'prompt' or 'messages'")
        if self.messages is not None:
            continue_without_generation_prompt(self.continue_final_message, self.add_generation_prompt,
                                               "add_generation_prompt" in self.model_fields_set)
        if self.messages is not None and not self.messages:
            raise ValueError("messages is empty")
        return self


class DetokenizeRequest(Lenient):
    """vLLM's ``POST /detokenize``: ids to text, as the tokenizer decodes them (special tokens kept)."""

    model: str | None = None
    tokens: list[Annotated[StrictInt, Field(ge=0, le=2**63 - 1)]]


class AbortRequest(BaseModel):
    """``POST /v1/rollouts/{id}/abort``'s optional body."""

    model_config = ConfigDict(extra="forbid")
    reason: StrictStr | None = Field(None, max_length=512, description="Why (kept with the rollout's status).")
