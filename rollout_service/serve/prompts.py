"""The prompt a call sends, planned on the data plane: a stateless call's state rebuilt from the
ids its messages echo back, a required prefix checked, the prompt ids built from a rollout's stored
tokens and its new messages (or continued from the prefix), and a token-in call's ids checked against
the vocabulary, continued or forked. Nothing is generated or stored; an on-policy core refusal
becomes its HTTP error.

A mixin of :class:`~rollout_service.serve.turns.TurnRunner` (its config, template, vocabulary size and
chat template kwargs); its reads (``/tokenize``) plan with it too.
"""

from __future__ import annotations

from typing import Any

from rollout_service.config import RolloutServiceConfig
from rollout_service.onpolicy import (
    ChatTemplate,
    HistoryConflict,
    UnsupportedConversation,
    build_prompt,
    state_from_echo,
)
from rollout_service.onpolicy.echo import checked_echo
from rollout_service.onpolicy.errors import InvalidEcho, InvalidPrefix, PrefixNotContinuable
from rollout_service.onpolicy.prefix import checked_prefix, plan_on_prefix
from rollout_service.onpolicy.tokens import plan_on_tokens
from rollout_service.onpolicy.turn import build_open_prompt
from rollout_service.onpolicy.types import RolloutState
from rollout_service.serve.errors import http_error
from rollout_service.serve.protocol.envelope import ServiceError, bad_request
from rollout_service.serve.turn_types import TurnRequest

_CLIENT_ERRORS = (HistoryConflict, UnsupportedConversation, InvalidEcho, InvalidPrefix, PrefixNotContinuable)


class PromptPlans:
    config: RolloutServiceConfig  # the TurnRunner's
    template: ChatTemplate
    vocab_size: int

    def _echo_state(self, req: TurnRequest) -> tuple[RolloutState | None, list[dict]]:
        try:
            return state_from_echo(req.messages, template=self.template, tools=req.tools, vocab_size=self.vocab_size,
                                   chat_template_kwargs=self._template_kwargs(req),
                                   reasoning_policy=self.config.service.reasoning_policy,
                                   whitespace_policy=self.config.service.whitespace_policy)
        except _CLIENT_ERRORS as exc:
            raise http_error(exc) from None

    def _required_prefix(self, value: Any) -> list[int] | None:
        try:
            return checked_prefix(value, self.vocab_size)
        except InvalidPrefix as exc:
            raise http_error(exc) from None

    def _open_plan(self, messages, req: TurnRequest):
        """A stateless prompt without the generation prompt, or continuing its final message."""
        try:
            checked_echo(messages, self.vocab_size)  # echoed ids are not used here, but malformed ones are a client bug
            return build_open_prompt(messages, tools=req.tools, chat_template_kwargs=self._template_kwargs(req),
                                     template=self.template, continue_final_message=req.continue_final_message)
        except _CLIENT_ERRORS as exc:
            raise http_error(exc) from None

    def _plan(self, state, messages, req: TurnRequest, prefix: list[int] | None = None):
        """The prompt plan; with a required prefix (docs/data-plane.md): a stateless call, or a rollout's
        first call, continues the prefix (``plan_on_prefix``); a stored rollout's prompt comes from its
        own ids as always and must start with the prefix (409 ``prefix_mismatch`` otherwise)."""
        try:
            if req.rollout_id is not None or prefix is not None:
                # A stored rollout (or a required prefix) does not use echoed ids, but malformed
                # ones are still a client bug: the same 400 as in stateless mode.
                checked_echo(messages, self.vocab_size)
            if prefix is not None and (state is None or not state.turn):
                return plan_on_prefix(prefix, messages, template=self.template, tools=req.tools,
                                      chat_template_kwargs=self._template_kwargs(req),
                                      reasoning_policy=self.config.service.reasoning_policy,
                                      segment_index=len(state.segments) if state is not None else 0,
                                      base_turn=state.turn if state is not None else 0)
            plan = build_prompt(state, messages, tools=req.tools, chat_template_kwargs=self._template_kwargs(req),
                                template=self.template,
                                history_policy=req.history_policy or self.config.service.history_policy,
                                reasoning_policy=self.config.service.reasoning_policy,
                                whitespace_policy=self.config.service.whitespace_policy)
        except _CLIENT_ERRORS as exc:
            raise http_error(exc) from None
        if prefix is not None and plan.prompt_ids[: len(prefix)] != prefix:
            ids = plan.prompt_ids
            at = next((j for j, (a, b) in enumerate(zip(ids, prefix)) if a != b), min(len(ids), len(prefix)))
            raise ServiceError(409, f"required_prefix_token_ids ({len(prefix)} ids) differ at position {at} from the "
                               f"{len(ids)}-id prompt rollout {req.rollout_id!r} continues from its stored tokens "
                               "(normally the prefix is the previous call's prompt + generation)",
                               type="conflict_error", param="required_prefix_token_ids", code="prefix_mismatch")
        return plan

    def _token_plan(self, state, req: TurnRequest):
        """The plan of a token-in call: the ids checked against the vocabulary, then continued or forked."""
        ids = req.prompt_token_ids
        bad = next((t for t in ids if not (0 <= t < self.vocab_size)), None)
        if bad is not None:
            raise bad_request(f"token id {bad} is out of range (vocabulary size {self.vocab_size})", param="token_ids")
        try:
            return plan_on_tokens(state if req.rollout_id is not None else None, ids,
                                  history_policy=req.history_policy or self.config.service.history_policy)
        except HistoryConflict as exc:
            raise http_error(exc) from None
