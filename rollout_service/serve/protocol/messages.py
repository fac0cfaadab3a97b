"""What the OpenAI requests are made of: messages, tools and response formats.

Chat messages (text content parts only, tool calls, NeMo Gym's echo fields) and their plain form for
the on-policy core; function tool definitions and the tool choices that name them; chat's
``response_format`` and Responses' ``text.format``, each in the chat-completions form the turn runner
takes. Also what every wire model here and in :mod:`.openai` is built on: the strict number type and
the lenient base model (unknown fields accepted).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, Strict, StrictBool, StrictInt, WithJsonSchema, field_validator, model_validator

from rollout_service.onpolicy.messages import message_text

# The fields we read are typed strictly: a JSON ``true`` is not the integer 1, ``"0.5"`` is not a
# number, ``1.0`` is not a token id (pydantic's lax mode would coerce each of them silently).
Number = Annotated[float, Strict()]  # a JSON number (an integer is one too), never a bool or a string


# The base of the wire models that accept unknown fields (agents send vendor extras).
class Lenient(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True)


class FunctionCall(Lenient):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCall(Lenient):
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


class ChatMessage(Lenient):
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
        d["content"] = message_text(self.content)  # the on-policy core's join (text parts one per line, as vLLM)
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




class FunctionDef(Lenient):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class ToolDef(Lenient):
    type: Literal["function"] = "function"
    function: FunctionDef


class NamedFunction(Lenient):
    name: str


class NamedToolChoice(Lenient):
    type: Literal["function"] = "function"
    function: NamedFunction


class AllowedTools(Lenient):
    mode: Literal["auto", "required"] = "auto"
    tools: list[dict[str, Any]] = Field(min_length=1)


class AllowedToolsChoice(Lenient):
    """OpenAI's ``allowed_tools``: the model may only call these (the prompt lists only them)."""

    type: Literal["allowed_tools"]
    allowed_tools: AllowedTools


class _JSONSchemaSpec(Lenient):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: StrictBool | None = None


class TextFormat(Lenient):
    type: Literal["text"]


class JSONObjectFormat(Lenient):
    type: Literal["json_object"]


class JSONSchemaFormat(Lenient):
    type: Literal["json_schema"]
    json_schema: _JSONSchemaSpec


ResponseFormat = Annotated[TextFormat | JSONObjectFormat | JSONSchemaFormat, Field(discriminator="type")]


class ResponsesJSONSchemaFormat(_JSONSchemaSpec):
    type: Literal["json_schema"]


class ResponsesTextConfig(Lenient):
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
