"""The reads of the data plane: a rollout's trajectory, its page, the store's count, a delete,
``/tokenize`` (the prompt ids a rollout's next call would use) and ``/detokenize``. Nothing is
generated or stored.

A mixin of :class:`~rollout_service.serve.turns.TurnRunner`, whose store, tokenizer, template and
prompt planning it uses.
"""

from __future__ import annotations

import asyncio
from typing import Any

from rollout_service.onpolicy.trajectory import trajectory_export
from rollout_service.onpolicy.types import RolloutState, Segment
from rollout_service.serve.dialects.common import optional_rollout_id
from rollout_service.serve.errors import http_error
from rollout_service.serve.protocol.envelope import ServiceError, bad_request
from rollout_service.serve.turn_types import TurnRequest
from rollout_service.serve.index_page import render_index_html
from rollout_service.serve.viewer import render_trajectory_html
from rollout_service.store.recent import MAX_PAGE, InvalidCursor
from rollout_service.store.base import StoreError, validate_rollout_id

_STORE_OPS = {"load": "read", "delete": "delete"}  # RolloutStore method -> metrics op of a rollout read / delete


class RolloutReads:
    async def tokenize(self, *, rollout_id: str | None, prompt: str | None, messages: list[dict] | None,
                       tools: list[dict] | None, chat_template_kwargs: dict | None, add_special_tokens: bool,
                       return_token_strs: bool, required_prefix_token_ids: Any = None,
                       add_generation_prompt: bool = True, continue_final_message: bool = False) -> dict[str, Any]:
        """The prompt ids the next call of this rollout would use (nothing generated or stored); without
        a rollout id, also vLLM's other forms (no generation prompt, a continued final message, the
        tokenizer's special tokens around the template's ids)."""
        if prompt is not None:
            if self._required_prefix(required_prefix_token_ids):  # malformed: its own 400, never ignored
                raise bad_request("required_prefix_token_ids applies to the messages form of /tokenize (a prompt is "
                                  "tokenized as given)", param="required_prefix_token_ids")
            ids = self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        else:
            req = TurnRequest(messages=messages or [], tools=tools, chat_template_kwargs=chat_template_kwargs,
                              rollout_id=optional_rollout_id(rollout_id), required_prefix_token_ids=required_prefix_token_ids,
                              add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message)
            prefix = self._required_prefix(req.required_prefix_token_ids)
            if not add_generation_prompt:  # stateless only (the request model refuses it otherwise)
                ids = self._open_plan(req.messages, req).prompt_ids
            elif req.rollout_id is None and prefix is None:
                state, msgs = self._echo_state(req)
            elif req.rollout_id is None:
                state, msgs = None, req.messages
            else:
                state, msgs = await self._load(req.rollout_id), req.messages
            if add_generation_prompt:
                ids = self._plan(state, msgs, req, prefix).prompt_ids
            if add_special_tokens:  # stateless only: what the tokenizer adds around a text, around the template's ids
                head, tail = self._special_tokens_around()
                ids = head + ids + tail
        return {"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids,
                "token_strs": self.tokenizer.convert_ids_to_tokens(ids) if return_token_strs else None}

    async def detokenize(self, *, tokens: list[int]) -> dict[str, Any]:
        """vLLM's ``/detokenize``: the tokenizer's text of ``tokens`` (special tokens kept; an id the
        tokenizer does not know adds nothing, as in vLLM's server; one past the tokenizer's 32-bit id
        range, which its decoder cannot take, is a 400 naming it)."""
        for i, t in enumerate(tokens):
            if t > 2**32 - 1:
                raise bad_request(f"tokens[{i}]: {t} is past the tokenizer's id range (at most 2**32 - 1)",
                                  param=f"tokens[{i}]")
        return {"prompt": self.tokenizer.decode(tokens)}

    def _special_tokens_around(self) -> tuple[list[int], list[int]]:
        """The ids the tokenizer adds before and after a text's own with ``add_special_tokens`` (a BOS,
        say; none for Qwen's)."""
        bare = self.tokenizer.encode("a", add_special_tokens=False)
        full = self.tokenizer.encode("a", add_special_tokens=True)
        at = next((i for i in range(len(full) - len(bare) + 1) if full[i:i + len(bare)] == bare), None)
        if at is None:  # a tokenizer that rewrites the text's own ids: no ids to put around the template's
            raise ServiceError(400, "add_special_tokens is not supported with this model's tokenizer on the messages "
                               "form", param="add_special_tokens", code="unsupported_parameter")
        return full[:at], full[at + len(bare):]

    async def get_rollout(self, rollout_id: str) -> dict[str, Any]:
        return trajectory_export(await self._stored(rollout_id, self.store.load))

    async def view_rollout(self, rollout_id: str) -> str:
        """The rollout as one self-contained HTML page (``serve/viewer.py``), rendered off the event
        loop: a long rollout is tens of thousands of token spans and must not stall the turns. The
        thread gets a copy: the state cache advances its states in place when a turn is appended."""
        state = await self._stored(rollout_id, self.store.load)
        snapshot = RolloutState(state.rollout_id, state.turn, [
            Segment(list(s.token_ids), list(s.loss_mask), list(s.logprobs), list(s.turns), list(s.messages),
                    dict(s.render_context)) for s in state.segments])
        return await asyncio.to_thread(render_trajectory_html, snapshot, self.tokenizer,
                                       reasoning_policy=self.config.service.reasoning_policy,
                                       whitespace_policy=self.config.service.whitespace_policy)

    async def count_rollouts(self) -> int | None:
        """Rollouts in the durable store under our key prefix (None: the store cannot count)."""
        store = getattr(self.store, "inner", self.store)  # past the replica's state cache
        count = getattr(store, "count_rollouts", None)
        if count is None:
            return None
        try:
            return await count()
        except StoreError as exc:
            raise http_error(exc) from None

    async def list_rollouts(self, limit: int = 100, cursor: str | None = None) -> dict[str, Any]:
        """A page of the recent-rollouts index, newest first (``GET /v1/rollouts``)."""
        store = getattr(self.store, "inner", self.store)  # past the replica's state cache
        if not 1 <= limit <= MAX_PAGE:
            raise bad_request(f"limit must be 1 to {MAX_PAGE}, got {limit}", param="limit")
        if getattr(store, "list_recent", None) is None:  # a store without the index: nothing to list
            return {"object": "list", "data": [], "next_cursor": None, "has_more": False, "indexed": 0}
        try:
            rows, next_cursor, indexed = await self._store_op("list", store.list_recent(limit, cursor))
        except InvalidCursor as exc:
            raise http_error(exc) from None
        except StoreError as exc:
            raise http_error(exc) from None
        return {"object": "list", "data": rows, "next_cursor": next_cursor, "has_more": next_cursor is not None,
                "indexed": indexed}

    async def rollouts_page(self, limit: int = 50, cursor: str | None = None) -> str:
        """The recent rollouts as one HTML page (``GET /rollouts``), each linking to its view."""
        page = await self.list_rollouts(limit, cursor)
        return render_index_html(page["data"], page["next_cursor"], limit, indexed=page["indexed"])

    async def delete_rollout(self, rollout_id: str) -> dict[str, Any]:
        await self._stored(rollout_id, self.store.delete)
        return {"id": rollout_id, "object": "rollout.deleted", "deleted": True}

    async def _stored(self, rollout_id: str, op):
        try:
            validate_rollout_id(rollout_id)
            result = await self._store_op(_STORE_OPS.get(op.__name__, op.__name__), op(rollout_id))
        except StoreError as exc:  # an invalid rollout id is one too (400)
            raise http_error(exc) from None
        if not result:
            raise ServiceError(404, f"rollout {rollout_id!r} not found", type="not_found_error", code="rollout_not_found")
        return result
