"""The fleet's durable record: what a new incarnation of the fleet actor must know that no engine
can tell it.

- the committed weight version, and the checkpoint directory it came from (if any): engines carry
  only a *label*, which a refit sets before it commits, so labels alone cannot tell a committed
  version from one a dead controller left half-loaded;
- the Serve apps the fleet serves: it stops once every one of them is deleted, also when that
  happened while it was down;
- the refit bracket while one is open (its lease's end in wall-clock time), so a new incarnation
  neither lets replacements join nor resumes paused engines in the middle of a refit's load;
- the last refit and the refit counters, for operators.

It lives in Ray's GCS key-value store (namespace ``rollout-service``, key ``<fleet name>/ledger``,
JSON), as Ray Serve keeps its own controller's checkpoint: it lasts as long as the Ray cluster does
(and across a head restart where the GCS is made fault tolerant with an external Redis), which is as
long as the engines it describes can live. Every write is the whole record, made under one lock so
that writes land in the order they were made, each with ``fleet.ledger_timeout_s``. A write that
fails is logged and counted (``stats()["ledger"]``) and made again by the fleet's monitor (every
``fleet.probe_interval_s``) until one lands; the fleet keeps serving meanwhile. A new incarnation
that finds no record falls back to the engines' labels.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any

from rollout_service.fleet.current_weights import short_error

logger = logging.getLogger(__name__)

NAMESPACE = b"rollout-service"


class FleetLedger:
    def __init__(self, fleet_name: str | None, timeout_s: float):
        self.enabled = fleet_name is not None  # an anonymous fleet has no successor to tell anything
        self._key = f"{fleet_name}/ledger".encode()
        self.timeout_s = timeout_s
        self._lock = asyncio.Lock()
        self.writes = 0
        self.failures = 0
        self.last_error: str | None = None
        self.dirty = False  # the last write failed: the fleet's monitor writes the record again

    @staticmethod
    def _gcs():
        from ray.experimental.internal_kv import internal_kv_get_gcs_client

        gcs = internal_kv_get_gcs_client()
        if gcs is None:
            raise RuntimeError("not connected to a Ray cluster")
        return gcs

    async def read(self) -> dict[str, Any] | None:
        """The record of the previous incarnation, or None (none written, unreadable: logged)."""
        if not self.enabled:
            return None
        try:
            raw = await asyncio.to_thread(lambda: self._gcs().internal_kv_get(self._key, NAMESPACE,
                                                                              timeout=self.timeout_s))
            return json.loads(raw) if raw else None
        except Exception as exc:
            self.last_error = short_error(exc)
            logger.warning("fleet ledger not readable (falling back to the engines' labels): %s", self.last_error)
            return None

    async def write(self, record: dict[str, Any]) -> bool:
        if not self.enabled:
            return True
        async with self._lock:
            raw = json.dumps({**record, "written_at": time.time()}).encode()
            try:
                await asyncio.to_thread(lambda: self._gcs().internal_kv_put(self._key, raw, True, NAMESPACE,
                                                                            timeout=self.timeout_s))
            except Exception as exc:
                self.failures += 1
                self.dirty = True
                self.last_error = short_error(exc)
                logger.warning("fleet ledger write failed (written again by the fleet's monitor): %s", self.last_error)
                return False
            self.writes += 1
            self.dirty = False
            return True

    async def clear(self) -> None:
        """The fleet stops for good (its apps were deleted): a later fleet of this name starts afresh."""
        if not self.enabled:
            return
        async with self._lock:
            try:
                await asyncio.to_thread(lambda: self._gcs().internal_kv_del(self._key, False, NAMESPACE,
                                                                            timeout=self.timeout_s))
            except Exception as exc:
                logger.warning("fleet ledger not cleared: %s", short_error(exc))

    def status(self) -> dict[str, Any]:
        return {"enabled": self.enabled, "writes": self.writes, "failures": self.failures,
                "last_error": self.last_error, "dirty": self.dirty}
