"""A call's claim on its rollout that every replica sees, for calls that may land on any replica.

A replica's own in-flight claim (``serve/turns.py``) dedupes the retries that reach that replica:
a retry of the call still running waits for it and is answered from the store. Under HAProxy, a
call that names its rollout only by ``X-Session-ID`` or ``metadata.rollout_id`` is balanced over the
replicas (HAProxy hashes only ``X-Rollout-Id``), so its retry can reach another replica while the
first attempt runs. For those calls the claim also lives in the store (``claim_call``: one key per
rollout, ``SET NX`` with an expiry the holder renews while it runs): a retry of the same call (same
``Idempotency-Key``, or the same request under ``retry_policy: replay``) waits for the holder and is
then answered from the store; another call is a 409 ``concurrent_turn``, as on one replica. A
holder that dies leaves its claim to expire (``CLAIM_TTL_S``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid

from rollout_service.serve.errors import http_error, key_reused
from rollout_service.serve.protocol.envelope import ServiceError
from rollout_service.serve.turn_types import TurnRequest
from rollout_service.store.base import StoreError

logger = logging.getLogger(__name__)

CLAIM_TTL_S = 15.0  # a claim its holder stopped renewing (the replica died) ends after this
RENEW_EVERY_S = CLAIM_TTL_S / 3
POLL_S = 0.1  # how often a waiting retry looks whether the holder is done


class SharedClaim:
    """A held claim, renewed in the background until :meth:`release`."""

    def __init__(self, store, rollout_id: str, token: str):
        self.store, self.rollout_id, self.token = store, rollout_id, token
        self._renewing = asyncio.ensure_future(self._renew())
        self._released = False

    async def _renew(self) -> None:
        while True:
            await asyncio.sleep(RENEW_EVERY_S)
            try:
                if not await self.store.renew_call(self.rollout_id, self.token, int(CLAIM_TTL_S * 1000)):
                    logger.warning("rollout %s: the call's shared claim was lost (expired)", self.rollout_id)
                    return
            except Exception as exc:  # noqa: BLE001 - the next renewal tries again; it may expire meanwhile
                logger.warning("rollout %s: the call's shared claim not renewed: %s", self.rollout_id, exc)

    async def release(self) -> None:
        """End the claim (once; an error is logged: the claim then expires by itself)."""
        if self._released:
            return
        self._released = True
        self._renewing.cancel()
        try:
            await self.store.release_call(self.rollout_id, self.token)
        except Exception as exc:  # noqa: BLE001
            logger.warning("rollout %s: the call's shared claim not released (it expires in %.0f s): %s",
                           self.rollout_id, CLAIM_TTL_S, exc)


def _same_call(held: str, req: TurnRequest, digest: str, replay_policy: bool) -> bool:
    _, _, rest = held.partition("|")
    held_digest, _, held_key = rest.partition("|")
    if req.idempotency_key is not None:
        if held_key != req.idempotency_key:
            return False
        if held_digest != digest:
            raise key_reused(req.idempotency_key)
        return True
    return held_digest == digest and replay_policy  # as a replica's own claim decides


async def claim_across_replicas(store, rollout_id: str, req: TurnRequest, digest: str, *, replay_policy: bool,
                                wait_s: float) -> SharedClaim:
    """Hold the rollout for this call in the store. A retry of the call that holds it waits for it (at
    most ``wait_s``); any other call is a 409 ``concurrent_turn``; a store error its status."""
    token = f"{uuid.uuid4().hex}|{digest}|{req.idempotency_key or ''}"
    deadline = time.monotonic() + wait_s
    poll = POLL_S
    while True:
        try:
            held = await store.claim_call(rollout_id, token, int(CLAIM_TTL_S * 1000))
        except BaseException as exc:
            # The SET may have landed before the error (a timeout, a cancelled call): end it, so the
            # rollout's next call does not wait for its expiry.
            asyncio.ensure_future(_release_quietly(store, rollout_id, token))
            if isinstance(exc, StoreError):
                raise http_error(exc) from None
            raise
        if held is None:
            return SharedClaim(store, rollout_id, token)
        if held and not _same_call(held, req, digest, replay_policy):
            raise ServiceError(409, f"rollout {rollout_id!r} already has a call in flight (on another replica)",
                               type="conflict_error", code="concurrent_turn")
        if time.monotonic() > deadline:
            raise ServiceError(409, f"rollout {rollout_id!r}: the call this request repeats is still running",
                               type="conflict_error", code="concurrent_turn")
        await asyncio.sleep(poll)
        poll = min(1.0, poll * 1.5)  # a long call's retry polls less often


async def _release_quietly(store, rollout_id: str, token: str) -> None:
    try:
        await store.release_call(rollout_id, token)
    except Exception:  # noqa: BLE001 - it expires by itself
        pass


__all__ = ["CLAIM_TTL_S", "SharedClaim", "claim_across_replicas"]
