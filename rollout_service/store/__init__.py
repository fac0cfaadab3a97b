"""Durable per-rollout history: the ``RolloutStore`` interface, Redis and in-memory implementations."""

from rollout_service.store.base import (
    InvalidRolloutId,
    InvalidTurnDelta,
    RolloutStore,
    StoreError,
    StoreUnavailable,
    TurnConflict,
    validate_rollout_id,
)
from rollout_service.store.embedded import EmbeddedRedis, EmbeddedRedisError
from rollout_service.store.memory import MemoryRolloutStore
from rollout_service.store.redis_store import RedisRolloutStore, parse_redis_url

__all__ = [
    "EmbeddedRedis",
    "EmbeddedRedisError",
    "InvalidRolloutId",
    "InvalidTurnDelta",
    "MemoryRolloutStore",
    "RedisRolloutStore",
    "RolloutStore",
    "StoreError",
    "StoreUnavailable",
    "TurnConflict",
    "parse_redis_url",
    "validate_rollout_id",
]
