"""Durable per-rollout history: the ``RolloutStore`` interface and its Redis implementation (the
in-memory double for unit tests is ``tests/memory_store.py``)."""

from rollout_service.store.base import (
    InvalidRolloutId,
    InvalidTurnDelta,
    RolloutAborted,
    RolloutStore,
    StoreError,
    StoreUnavailable,
    TurnConflict,
    validate_rollout_id,
)
from rollout_service.store.embedded import EmbeddedRedis, EmbeddedRedisError
from rollout_service.store.redis_store import RedisRolloutStore
from rollout_service.store.urls import parse_redis_url

__all__ = [
    "EmbeddedRedis",
    "EmbeddedRedisError",
    "InvalidRolloutId",
    "InvalidTurnDelta",
    "RedisRolloutStore",
    "RolloutAborted",
    "RolloutStore",
    "StoreError",
    "StoreUnavailable",
    "TurnConflict",
    "parse_redis_url",
    "validate_rollout_id",
]
