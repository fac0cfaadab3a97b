"""A trainer aborts a rollout or a group through the Ray handle (``TrainerClient.abort``,
``TrainerClient.abort_group``), as an HTTP client does with ``POST /v1/rollouts/{id}/abort`` and
``POST /v1/groups/{id}/abort``: the rollout's status in the store first (every replica
refuses its next call, 409 ``rollout_aborted``), then its running request on every engine serving
now (the call ends at the engine's next step with ``finish_reason`` abort, its tokens so far
stored). A mixin of :class:`~rollout_service.refit.controller.RefitController`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rollout_service.fleet.types import abort_rollout_on

if TYPE_CHECKING:
    from rollout_service.config import RolloutServiceConfig

class RolloutAborts:
    config: RolloutServiceConfig

    async def abort_rollout(self, rollout_id: str, reason: str | None = None) -> dict[str, Any] | None:
        """Abort ``rollout_id`` (idempotent: the first reason stands); None if the store does not know it."""
        from rollout_service.config import StoreConfig
        from rollout_service.store.redis_store import RedisRolloutStore

        store = RedisRolloutStore.from_config(StoreConfig.model_validate(self.store_config()))
        try:
            return await self._abort(store, rollout_id, reason)
        finally:
            await store.close()

    async def abort_group(self, group_id: str, reason: str | None = None) -> dict[str, Any] | None:
        """Abort every member of ``group_id``, a member still on its first call included (as
        ``POST /v1/groups/{id}/abort``); None if no call named the group."""
        import asyncio

        from rollout_service.config import StoreConfig
        from rollout_service.onpolicy.groups import abort_creates, member_order
        from rollout_service.store.redis_store import RedisRolloutStore

        store = RedisRolloutStore.from_config(StoreConfig.model_validate(self.store_config()))
        try:
            calls = await store.group_members(group_id)
            if not calls:
                return None
            order = sorted(calls, key=member_order)  # a finished member gone since is not brought back
            results = await asyncio.gather(*(self._abort(store, rid, reason,
                                                         create=abort_creates(calls[rid]))
                                             for rid in order))
        finally:
            await store.close()
        members = [r if r is not None else {"id": rid, "object": "rollout.abort", "status": "missing", "aborted_calls": 0}
                   for rid, r in zip(order, results)]
        return {"id": group_id, "object": "rollout.group.abort", "members": members,
                "aborted_calls": sum(r["aborted_calls"] for r in members)}

    async def _abort(self, store, rollout_id: str, reason: str | None, create: bool = False) -> dict[str, Any] | None:
        fresh = await store.mark(rollout_id, "aborted", reason or "", create=create)
        if fresh is None:
            return None
        aborted = await abort_rollout_on((await self._view()).members, rollout_id)
        state = await store.load(rollout_id)
        return {"id": rollout_id, "object": "rollout.abort", "status": "aborted",
                "reason": state.status_reason if state is not None else reason, "already_aborted": not fresh,
                "aborted_calls": aborted}
