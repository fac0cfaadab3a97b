"""A trainer aborts a rollout through the Ray handle (``TrainerClient.abort``), as an HTTP client does
with ``POST /v1/rollouts/{id}/abort``: the rollout's status in the store first (every replica
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
            fresh = await store.mark(rollout_id, "aborted", reason or "")
            if fresh is None:
                return None
            aborted = await abort_rollout_on((await self._view()).members, rollout_id)
            state = await store.load(rollout_id)
        finally:
            await store.close()
        return {"id": rollout_id, "object": "rollout.abort", "status": "aborted",
                "reason": state.status_reason if state is not None else reason, "already_aborted": not fresh,
                "aborted_calls": aborted}
