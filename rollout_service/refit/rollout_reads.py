"""How a trainer reads its rollouts: straight from the service's rollout store (a data read, not
the control plane's business). The refit controller only says where the store is
(:meth:`RolloutReads.store_config`, a mixin of
:class:`~rollout_service.refit.controller.RefitController`); the trainer's client reads the
trajectory there (:func:`read_trajectory`, behind ``TrainerClient.get_rollout``; a group's:
:func:`read_group`, behind ``TrainerClient.group``). Imports neither vLLM nor Ray.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the trainer's client imports this module: no config (pydantic) at import time
    from rollout_service.config import RolloutServiceConfig


class RolloutReads:
    config: RolloutServiceConfig

    def store_config(self) -> dict[str, Any]:
        """Where rollouts are stored (trainers read trajectories there: ``TrainerClient.get_rollout``)."""
        store = self.config.store.model_copy()
        store.redis_url = os.environ.get("ROLLOUT_SERVICE_REDIS_URL") or store.redis_url
        if not store.redis_url:
            raise RuntimeError("store.redis_url is not configured")
        return store.model_dump()


async def read_trajectory(store_config: dict, rollout_id: str) -> dict[str, Any] | None:
    """The ``GET /v1/rollouts/{id}`` document of one rollout, read from the store ``store_config``
    names (:meth:`RolloutReads.store_config`); None if it is unknown."""
    from rollout_service.config import StoreConfig
    from rollout_service.onpolicy.trajectory import trajectory_export
    from rollout_service.store.base import validate_rollout_id
    from rollout_service.store.redis_store import RedisRolloutStore

    validate_rollout_id(rollout_id)
    store = RedisRolloutStore.from_config(StoreConfig.model_validate(store_config))
    try:
        state = await store.load(rollout_id)
    finally:
        await store.close()
    return None if state is None else trajectory_export(state)


async def read_group(store_config: dict, group_id: str) -> dict[str, Any] | None:
    """The ``GET /v1/groups/{id}?trajectories=true`` document of one group, read from the store
    ``store_config`` names; None if no call named the group."""
    import asyncio

    from rollout_service.config import StoreConfig
    from rollout_service.onpolicy.groups import group_document
    from rollout_service.store.base import validate_rollout_id
    from rollout_service.store.redis_store import RedisRolloutStore

    validate_rollout_id(group_id)
    store = RedisRolloutStore.from_config(StoreConfig.model_validate(store_config))
    try:
        calls = await store.group_members(group_id)
        states = await asyncio.gather(*(store.load(rid) for rid in calls))
    finally:
        await store.close()
    if not calls:
        return None
    return group_document(group_id, calls, dict(zip(calls, states)), trajectories=True)
