"""Shared helpers for the on-policy core tests: the real Qwen tokenizer, the shared real-world chat
templates (read from ../shared/chat-templates, never copied), and a driver that plays a rollout
through build_prompt / finish_turn the way the Serve shell does, minus the engine."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rollout_service.onpolicy import (
    ChatTemplate,
    PromptPlan,
    RolloutState,
    build_prompt,
    finish_turn,
    parse_output,
    render_message,
)

SHARED_TEMPLATES = Path(__file__).resolve().parents[2] / "shared" / "chat-templates"
IM_END = 151645
ENDOFTEXT = 151643
THINK, END_THINK = 151667, 151668
TOOL_CALL, END_TOOL_CALL = 151657, 151658

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather of a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "City name."}, "days": {"type": "integer", "description": "Days."}},
            "required": ["city"],
        },
    },
}
SEARCH_TOOL = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Search the web.",
        "parameters": {"type": "object", "properties": {"q": {"type": "string", "description": "Query."}}, "required": ["q"]},
    },
}
TOOLS = [WEATHER_TOOL, SEARCH_TOOL]


@functools.cache
def tokenizer():
    from rollout_service.models.tiny_model import build_tokenizer

    return build_tokenizer()


def shared_template_names() -> list[str]:
    return sorted(p.stem for p in SHARED_TEMPLATES.glob("*.jinja"))


def all_template_names() -> list[str]:
    return ["ours"] + shared_template_names()


@functools.cache
def template(name: str = "ours", check_window: bool = True) -> ChatTemplate:
    tok = tokenizer()
    if name == "ours":
        return ChatTemplate(tok, check_window=check_window, name="chatml_rollout")
    source = (SHARED_TEMPLATES / f"{name}.jinja").read_text()
    # The Qwen tokenizer has no bos token; templates that concatenate it need one given.
    extra = {"bos_token": "<|endoftext|>"} if name == "mistral-instruct" else None
    return ChatTemplate(tok, source, check_window=check_window, name=name, template_vars=extra)


def encode(text: str) -> list[int]:
    return tokenizer().encode(text, add_special_tokens=False)


def decode(ids: list[int]) -> str:
    return tokenizer().decode(ids, skip_special_tokens=False)


@dataclass
class Call:
    plan: PromptPlan
    gen_ids: list[int]
    assistant: dict[str, Any]


@dataclass
class Rollout:
    """Plays a rollout: append client messages, call, append the returned assistant message."""

    tmpl: ChatTemplate
    tools: list[dict] | None = None
    kwargs: dict[str, Any] | None = None
    parsers: tuple[str | None, str | None] = (None, None)
    history_policy: str = "fork"
    state: RolloutState = field(default_factory=lambda: RolloutState("r"))
    messages: list[dict[str, Any]] = field(default_factory=list)
    calls: list[Call] = field(default_factory=list)

    def call(self, gen_ids: list[int], *, finish_reason: str | None = None, messages=None, assistant=None) -> Call:
        plan = build_prompt(
            self.state,
            self.messages if messages is None else messages,
            tools=self.tools,
            chat_template_kwargs=self.kwargs,
            template=self.tmpl,
            history_policy=self.history_policy,
        )
        if messages is not None:
            self.messages = list(messages)
        if assistant is None:
            assistant = self.parse(gen_ids)
        delta = finish_turn(
            self.state,
            plan,
            gen_ids=gen_ids,
            logprobs=[-0.5] * len(gen_ids),
            finish_reason=finish_reason or ("stop" if gen_ids and gen_ids[-1] == IM_END else "length"),
            assistant_message=assistant,
        )
        delta.apply(self.state)
        self.messages.append(assistant)
        c = Call(plan, list(gen_ids), assistant)
        self.calls.append(c)
        return c

    def parse(self, gen_ids):
        rp, tp = self.parsers
        if rp is None and tp is None:
            text = tokenizer().decode(gen_ids, skip_special_tokens=True)
            return {"role": "assistant", "content": text}
        return parse_output(
            gen_ids, tokenizer=tokenizer(), reasoning_parser=rp, tool_parser=tp, tools=self.tools,
            chat_template_kwargs=self.kwargs,
        ).to_message()


def naive_prompt_ids(tmpl: ChatTemplate, messages, tools=None, kwargs=None) -> list[int]:
    """The baseline the service replaces: re-render and re-tokenize the whole history each call."""
    from rollout_service.onpolicy import render_message

    return tmpl.encode(
        tmpl.render([render_message(m) for m in messages], tools=tools, add_generation_prompt=True, chat_template_kwargs=kwargs)
    )


def assert_spliced(r: Rollout, prev: Call, cur: Call) -> None:
    """``cur``'s prompt is ``prev``'s prompt + generation, exactly, then a tail that is checked against
    an oracle independent of how the core builds it: a fresh render of the whole conversation. The
    tail's text ends that render (what the template puts after the previous assistant message: its
    end of turn where the model did not emit it, the new messages, the generation prompt), right
    after the end of turn the model generated when it did, and every new message's text is in it."""
    base = prev.plan.prompt_ids + prev.gen_ids
    assert cur.plan.monotonic and not cur.plan.new_segment
    assert cur.plan.prompt_ids[: len(base)] == base, "the previous prompt and generation, re-tokenized"
    tail = decode(cur.plan.prompt_ids[len(base):])
    sent = r.messages[: len(cur.plan.messages)]  # the conversation as the client sent it for this call
    fresh = r.tmpl.render([render_message(m) for m in sent], tools=r.tools, add_generation_prompt=True,
                          chat_template_kwargs=r.kwargs)
    assert tail and fresh.endswith(tail), f"tail {tail!r} does not end the fresh render {fresh[-300:]!r}"
    eot = decode([IM_END])
    if prev.gen_ids and prev.gen_ids[-1] == IM_END and eot in fresh:
        # The model ended its turn with the template's own end of turn: the tail does not end it again.
        assert fresh.endswith(eot + tail), f"tail {tail!r} repeats the generated end of turn"
    for m in cur.plan.new_messages:
        content = m.get("content")
        if isinstance(content, str) and content:
            assert content in tail, f"new message {content!r} not in the tail {tail!r}"

