"""Groups of rollouts on the data plane: what a call under a group records, ``GET /v1/groups/{id}``
and ``POST /v1/groups/{id}/abort`` (the document: :mod:`rollout_service.onpolicy.groups`).

A mixin of :class:`~rollout_service.serve.turns.TurnRunner` (its store and its abort). The group's
record holds each member's last call under it: ``running`` (written by the ``n`` call for all its
members before they start; by an ``X-Rollout-Group`` call beside its generation), then ``finished``
or ``failed`` when a call that got past admission ends. These writes
are bookkeeping, not the turn's acknowledgement (the append is): a failed one is logged and the
call goes on.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from rollout_service.onpolicy.groups import abort_creates, call_entry, group_document, member_order
from rollout_service.serve.errors import http_error
from rollout_service.serve.index_page import render_group_html
from rollout_service.serve.protocol.envelope import ServiceError
from rollout_service.store.base import StoreError, validate_rollout_id

logger = logging.getLogger(__name__)


class RolloutGroups:
    async def note_group(self, group_id: str, rollout_id: str | list[str], call_state: str) -> None:
        """Record the rollout's call (or several rollouts' calls) under ``group_id`` as ``running``,
        ``finished`` or ``failed``, with the time (best effort)."""
        value = call_entry(call_state)
        rids = [rollout_id] if isinstance(rollout_id, str) else rollout_id
        try:
            await self._store_op("group", self.store.set_group_members(group_id, dict.fromkeys(rids, value)))
        except StoreError as exc:
            logger.warning("group %s: could not record %s as %s: %s", group_id, ", ".join(rids), call_state, exc)

    async def end_group_call(self, running: asyncio.Future | None, group_id: str, rollout_id: str,
                             call_state: str) -> None:
        """The call's last record under the group, after its ``running`` record (so never overwritten by it)."""
        if running is not None:
            try:
                await running
            except Exception:  # noqa: BLE001 - note_group logs its own failure; this one is the record that counts
                pass
        await self.note_group(group_id, rollout_id, call_state)

    async def _group_calls(self, group_id: str, param: str = "group_id") -> dict[str, str]:
        """The group's members -> their last call's record; 404 for a group nobody named."""
        try:
            validate_rollout_id(group_id)
        except StoreError as exc:
            raise http_error(exc, param=param) from None
        try:
            calls = await self._store_op("group", self.store.group_members(group_id))
        except StoreError as exc:
            raise http_error(exc) from None
        if not calls:
            raise ServiceError(404, f"group {group_id!r} not found", type="not_found_error", code="group_not_found")
        return calls

    async def get_group(self, group_id: str, trajectories: bool = False, param: str = "group_id") -> dict[str, Any]:
        """The group's document (``GET /v1/groups/{id}``)."""
        calls = await self._group_calls(group_id, param)
        try:
            loaded = await asyncio.gather(*(self._store_op("read", self.store.load(rid)) for rid in calls))
        except StoreError as exc:
            raise http_error(exc) from None
        return group_document(group_id, calls, dict(zip(calls, loaded)), trajectories=trajectories)

    async def group_page(self, group_id: str, param: str = "group") -> str:
        """The group as one HTML page for people (``GET /rollouts?group={id}``)."""
        return render_group_html(await self.get_group(group_id, param=param))

    async def abort_group(self, group_id: str, reason: Any = None) -> dict[str, Any]:
        """Abort every member of the group (``POST /v1/groups/{id}/abort``), each as
        ``POST /v1/rollouts/{id}/abort`` does, a member still on its first call included (its call
        ends with ``finish_reason: "abort"``, its tokens so far stored). Idempotent."""
        calls = await self._group_calls(group_id)

        async def abort(rid: str) -> dict[str, Any]:
            try:
                return await self.abort_rollout(rid, reason, create=abort_creates(calls[rid]))
            except ServiceError as exc:
                if exc.status != 404:
                    raise
                return {"id": rid, "object": "rollout.abort", "status": "missing", "aborted_calls": 0}

        results = await asyncio.gather(*(abort(rid) for rid in sorted(calls, key=member_order)))
        return {"id": group_id, "object": "rollout.group.abort", "members": results,
                "aborted_calls": sum(r.get("aborted_calls") or 0 for r in results)}
