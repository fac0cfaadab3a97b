"""The model's own chat template, used only for what it must decide: the text *between* turns.

Why the tail is rendered, not diffed: many real templates are not prefix-stable (Qwen3's drops
past reasoning, some close the last assistant turn differently from earlier ones, some merge the
system prompt into the first user turn), so ``render(M_k)[len(render(M_{k-1})):]`` is not
well-defined. Instead the previous assistant turn is replaced by a *sentinel* assistant message
(plain content, no reasoning, no tool calls) and the template renders the sentinel followed by
the new messages and the generation prompt. Everything after the sentinel is, by construction,
what the template puts after an assistant turn's content up to the next generation prompt: the
turn's closing (end-of-turn token and separator), the new messages, the generation prompt.
If the model already emitted the end-of-turn token the template closes with, that part is not
repeated; if it stopped without it (``max_tokens``, a stop string), the tail closes the turn
exactly as the template would.

Cost: the sentinel is rendered inside a bounded *window* — the leading system message, the user
message the previous assistant turn answered, the sentinel, the new messages — so building turn
k's prompt does not grow with k. The window keeps the global context templates depend on (a
system/tools header at the top, user/assistant parity for alternation checks, the last user index
and last assistant index Qwen3-style templates compute); ``check_window=True`` also renders the
full history and raises if the two tails differ (the tests run with it on every template).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from rollout_service.onpolicy.errors import UnsupportedConversation

SENTINEL = "ROLLOUTSERVICEPREVIOUSASSISTANTTURNENDS"
_MARKER = "ROLLOUTSERVICEMESSAGEMARKER"
_SYSTEM_ROLES = ("system", "developer")


class WindowMismatch(AssertionError):
    """The bounded window rendered a different tail than the full history (a core bug or a
    template whose tail depends on context the window drops)."""


# transformers' marker for the end of the final message's text (continue_final_message)
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


class ChatTemplate:
    """A HF chat template bound to its tokenizer, rendered exactly as ``apply_chat_template`` does.

    ``template`` overrides the tokenizer's template (a string, or a path-like read as text).
    ``template_vars`` adds or overrides variables the template sees (by default the tokenizer's
    special tokens, as transformers passes them). ``check_window`` makes every tail derivation also
    render the full history and compare (tests, debugging; quadratic — never in production).
    """

    def __init__(
        self,
        tokenizer: Any,
        template: str | os.PathLike | None = None,
        *,
        template_vars: dict[str, Any] | None = None,
        check_window: bool = False,
        name: str | None = None,
    ):
        from transformers.utils.chat_template_utils import _compile_jinja_template

        if isinstance(template, os.PathLike):
            template = Path(template).read_text()
        source = template if template is not None else tokenizer.chat_template
        if isinstance(source, dict):
            source = source.get("default") or next(iter(source.values()))
        if not source:
            raise UnsupportedConversation("the tokenizer has no chat template and none was given")
        self.tokenizer = tokenizer
        self.source: str = source
        self.name = name or "tokenizer"
        self.check_window = check_window
        self._compiled = _compile_jinja_template(source)
        self._vars = {**getattr(tokenizer, "special_tokens_map", {}), **(template_vars or {})}
        self._renders_tools = "tools" in source
        backend = getattr(tokenizer, "_tokenizer", None)
        self._fast_encode = (lambda t: backend.encode(t, add_special_tokens=False).ids) if backend else None
        special = set(getattr(tokenizer, "all_special_ids", []) or [])
        for tid, added in (getattr(tokenizer, "added_tokens_decoder", {}) or {}).items():
            if getattr(added, "special", False):
                special.add(int(tid))
        self.end_of_turn_ids = frozenset(special)

    # -- rendering -----------------------------------------------------------------------------

    def render(
        self,
        messages: list[dict[str, Any]],
        *,
        tools: list[dict] | None,
        add_generation_prompt: bool,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        """Render as transformers would; template errors become :class:`UnsupportedConversation`."""
        import jinja2

        if tools and not self._renders_tools:
            raise UnsupportedConversation(
                f"chat template {self.name!r} does not render tools; the request's tools would be "
                "silently dropped from the prompt"
            )
        kwargs = {**self._vars, **(chat_template_kwargs or {})}
        try:
            return self._compiled.render(
                messages=messages,
                tools=tools or None,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **kwargs,
            )
        except jinja2.TemplateError as exc:
            raise UnsupportedConversation(f"chat template {self.name!r} cannot express this conversation: {exc}") from exc
        except (TypeError, KeyError, AttributeError, IndexError) as exc:
            raise UnsupportedConversation(
                f"chat template {self.name!r} failed to render this conversation ({type(exc).__name__}: {exc})"
            ) from exc

    def encode(self, text: str) -> list[int]:
        """Tokenize rendered template text; special-token strings map to their ids."""
        if self._fast_encode is not None:
            return self._fast_encode(text)
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    # -- fresh prompts -------------------------------------------------------------------------

    def render_prompt(
        self, messages: list[dict[str, Any]], *, tools: list[dict] | None, chat_template_kwargs: dict | None
    ) -> str:
        """A whole prompt rendered fresh (first call of a segment); every message must show."""
        text = self.render(messages, tools=tools, add_generation_prompt=True, chat_template_kwargs=chat_template_kwargs)
        self._check_expressed(text, messages, range(len(messages)), tools, chat_template_kwargs, add_generation_prompt=True)
        return text

    def render_open_prompt(
        self, messages: list[dict[str, Any]], *, tools: list[dict] | None, chat_template_kwargs: dict | None,
        continue_final_message: bool,
    ) -> str:
        """A whole prompt without the generation prompt (``add_generation_prompt: false``); with
        ``continue_final_message`` it ends inside the final message, right after its text, found as
        transformers' ``apply_chat_template`` finds it (a marker after the text of its content, or
        of the last text part of a list content; the spacing the template trims, trimmed)."""
        if continue_final_message:
            messages = [*messages[:-1], self._marked(messages[-1], len(messages) - 1)]
        text = self.render(messages, tools=tools, add_generation_prompt=False, chat_template_kwargs=chat_template_kwargs)
        self._check_expressed(text, messages, range(len(messages)), tools, chat_template_kwargs, add_generation_prompt=False)
        if not continue_final_message:
            return text
        final = self._final_text(messages[-1])[: -len(_CONTINUE_TAG)]
        if final.strip() not in text or _CONTINUE_TAG.strip() not in text:
            raise UnsupportedConversation(
                "continue_final_message is set but the final message does not appear in the chat after applying the "
                "chat template! This can happen if the chat template deletes portions of the final message. Please "
                "verify the chat template and final message in your chat to ensure they are compatible.",
                len(messages) - 1)
        at = text.rindex(_CONTINUE_TAG.strip())
        return text[:at] if text[at:at + len(_CONTINUE_TAG)] == _CONTINUE_TAG else text[:at].rstrip()

    def _marked(self, message: dict[str, Any], index: int) -> dict[str, Any]:
        content = message.get("content")
        if content is None:
            raise UnsupportedConversation('continue_final_message is set but the final message has no "content" to '
                                          "continue!", index)
        if "content" not in self.source:
            raise UnsupportedConversation('continue_final_message is set to "content" but this is not an accepted '
                                          "field in the chat_template", index)
        if isinstance(content, (list, tuple)):
            parts = [dict(p) if isinstance(p, dict) else p for p in content]
            for part in reversed(parts):
                if isinstance(part, dict) and "text" in part:
                    part["text"] = part["text"] + _CONTINUE_TAG
                    return {**message, "content": parts}
            raise UnsupportedConversation("continue_final_message is set but we could not find any text to continue "
                                          "in the final message!", index)
        return {**message, "content": content + _CONTINUE_TAG}

    @staticmethod
    def _final_text(message: dict[str, Any]) -> str:
        content = message["content"]
        if isinstance(content, (list, tuple)):
            return next(p["text"] for p in reversed(content) if isinstance(p, dict) and "text" in p)
        return content

    def prompt_ids(
        self, messages: list[dict[str, Any]], *, tools: list[dict] | None, chat_template_kwargs: dict | None
    ) -> list[int]:
        return self.encode(self.render_prompt(messages, tools=tools, chat_template_kwargs=chat_template_kwargs))

    # -- the tail ------------------------------------------------------------------------------

    def window_indices(self, messages: list[dict[str, Any]], assistant_index: int) -> list[int]:
        """Messages before the previous assistant turn that its tail may depend on (bounded)."""
        keep: list[int] = []
        if messages and messages[0].get("role") in _SYSTEM_ROLES and assistant_index > 0:
            keep.append(0)
        for j in range(assistant_index - 1, -1, -1):
            role = messages[j].get("role")
            if role == "user":
                if j not in keep:
                    keep.append(j)
                break
            if role in _SYSTEM_ROLES and j == 0:
                break
        return keep

    def tail_text(
        self,
        messages: list[dict[str, Any]],
        n_prev: int,
        *,
        tools: list[dict] | None,
        chat_template_kwargs: dict | None,
        last_generated_id: int | None,
    ) -> str:
        """Text the template puts after the assistant turn ``messages[n_prev-1]`` up to the next
        generation prompt, minus the end-of-turn token if the model already generated it."""
        a = n_prev - 1
        if a < 0 or messages[a].get("role") != "assistant":
            raise ValueError("the stored history must end with the assistant output of the previous call")
        sentinel = {"role": "assistant", "content": SENTINEL}
        new = messages[n_prev:]
        window = [messages[j] for j in self.window_indices(messages, a)] + [sentinel] + new
        tail = self._after_sentinel(window, tools, chat_template_kwargs)
        if self.check_window:
            full = self._after_sentinel(messages[:a] + [sentinel] + new, tools, chat_template_kwargs)
            if full != tail:
                raise WindowMismatch(f"window tail {tail!r} != full-render tail {full!r} ({self.name})")
        offset = len(window) - len(new)
        self._check_expressed(
            tail, window, range(offset, len(window)), tools, chat_template_kwargs, add_generation_prompt=True,
            index_base=n_prev - offset,
        )
        return self._strip_generated_end(tail, last_generated_id)

    def _after_sentinel(self, msgs: list[dict[str, Any]], tools, chat_template_kwargs) -> str:
        text = self.render(msgs, tools=tools, add_generation_prompt=True, chat_template_kwargs=chat_template_kwargs)
        first = text.find(SENTINEL)
        if first < 0 or text.find(SENTINEL, first + 1) >= 0:
            raise UnsupportedConversation(
                f"chat template {self.name!r} does not render assistant content verbatim exactly once, so the "
                "end of the previous assistant turn cannot be located"
            )
        return text[first + len(SENTINEL):]

    def _strip_generated_end(self, tail: str, last_generated_id: int | None) -> str:
        """Drop the template's end-of-turn marker if the model generated that very token.

        Only a special token counts (an ordinary last token such as a newline, cut by
        ``max_tokens``, is content: the template's own closing follows it in full). Whitespace the
        template would put before the marker is dropped with it: the model's sequence is what
        the trainer sees.
        """
        if last_generated_id is None or last_generated_id not in self.end_of_turn_ids:
            return tail
        marker = self.tokenizer.convert_ids_to_tokens(int(last_generated_id))
        pos = tail.find(marker) if marker else -1
        if pos >= 0 and not tail[:pos].strip():
            return tail[pos + len(marker):]
        return tail

    # -- expressibility ------------------------------------------------------------------------

    def _check_expressed(
        self,
        text: str,
        msgs: list[dict[str, Any]],
        indices,
        tools,
        chat_template_kwargs,
        *,
        add_generation_prompt: bool,
        index_base: int = 0,
    ) -> None:
        """Refuse a rendering that silently drops a message or a tool call.

        A message's text passes if it appears verbatim (or JSON-escaped). Text that does not, and
        every tool call name (a name also appears in the tools header, so verbatim proves
        nothing), is replaced by a unique marker and the messages are rendered once more: a
        template that transforms content (escaping, trimming) still shows the marker; one that
        drops the message (e.g. an unknown ``tool`` role) or its tool calls does not.
        """
        probe = list(msgs)
        wanted: list[tuple[str, int, str]] = []
        for i in indices:
            m = msgs[i]
            content = (m.get("content") or "").strip()
            changed = dict(m)
            if content and content not in text and json.dumps(content, ensure_ascii=False)[1:-1] not in text:
                marker = f"{_MARKER}C{i}X"
                changed["content"] = marker
                wanted.append((marker, i, "message"))
            if m.get("tool_calls"):
                calls = []
                for j, tc in enumerate(m["tool_calls"]):
                    marker = f"{_MARKER}T{i}N{j}X"
                    if "function" in tc:
                        calls.append({**tc, "function": {**tc["function"], "name": marker}})
                    else:
                        calls.append({**tc, "name": marker})
                    wanted.append((marker, i, "tool calls of message"))
                changed["tool_calls"] = calls
            probe[i] = changed
        if not wanted:
            return
        rendered = self.render(
            probe, tools=tools, add_generation_prompt=add_generation_prompt, chat_template_kwargs=chat_template_kwargs
        )
        for marker, i, what in wanted:
            if marker not in rendered:
                role = msgs[i].get("role")
                desc = f"drops message {index_base + i} (role {role!r})" if what == "message" else f"drops the tool calls of message {index_base + i}"
                raise UnsupportedConversation(f"chat template {self.name!r} {desc} from the prompt", index=index_base + i)
