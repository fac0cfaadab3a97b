"""The fields of OpenAI's and vLLM's request models that the service refuses, and the refusal.

One table per route (chat completions, completions, Responses, tokenize) names each field the service
does not honour, the inert values it may still be sent with, and why any other value is refused;
:func:`refuse_unhonoured` answers the first one sent with a live value as a 400
``unsupported_parameter``. Also the Responses ``include`` values that are honoured.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from rollout_service.serve.protocol.envelope import bad_request


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
    "add_special_tokens": _rule(_PROMPT, False),
    "documents": _rule(_PROMPT, []),
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
