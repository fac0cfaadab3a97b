"""Forwarding a turn to the replica that owns its rollout, and the deadlines on that hop.

A turn whose rollout the ingress did not route on (``X-Session-ID``, ``metadata.rollout_id`` in the
body, or a proxy started without the header setting) is forwarded once, through the deployment's
own handle with the rollout id as session id. The owner answers with :class:`TurnAccepted` first,
then the turn's events, with a :class:`TurnHeartbeat` whenever the turn is quiet; the sender gives
up a call that is not accepted, or whose stream goes silent, at its deadline and runs the turn
itself from the store (:mod:`rollout_service.serve.app`).
"""

from __future__ import annotations

import asyncio
import logging
import contextlib
import dataclasses
import time
from typing import AsyncIterator

from fastapi import Request
from ray import serve

from rollout_service.config import RolloutServiceConfig
from rollout_service.serve.http import unexpected_error
from rollout_service.serve.routing import DEPLOYMENT_NAME, ROLLOUT_HEADER, SESSION_HEADER_ENV
from rollout_service.serve.protocol.envelope import ServiceError
from rollout_service.serve.turn_types import TokenDelta, TurnAccepted, TurnError, TurnHeartbeat, TurnRequest, TurnResult

logger = logging.getLogger(__name__)


async def with_heartbeats(events: AsyncIterator, every_s: float) -> AsyncIterator:
    """``events``, with a :class:`TurnHeartbeat` whenever ``every_s`` seconds pass without one."""
    pending: asyncio.Future | None = None
    try:
        while True:
            pending = asyncio.ensure_future(events.__anext__())
            while not (await asyncio.wait({pending}, timeout=every_s))[0]:
                yield TurnHeartbeat()
            done, pending = pending, None
            try:
                event = done.result()
            except StopAsyncIteration:
                return
            yield event
    finally:
        if pending is not None:  # closed or cancelled while waiting: stop the turn (its finally blocks run)
            pending.cancel()
            await asyncio.gather(pending, return_exceptions=True)
        await events.aclose()


async def next_within(events: AsyncIterator, timeout: float):
    """The next event of a forwarded call, or ``asyncio.TimeoutError`` after ``timeout`` seconds.
    Unlike ``asyncio.wait_for`` it does not wait for the abandoned read to finish cancelling: a read
    of Serve's handle generator is not promised to give up promptly, and the sender's deadline is
    the point of the timeout."""
    read = asyncio.ensure_future(events.__anext__())
    try:
        done, _ = await asyncio.wait({read}, timeout=timeout)
    except asyncio.CancelledError:
        read.cancel()
        raise
    if not done:
        read.cancel()
        read.add_done_callback(lambda t: t.cancelled() or t.exception())  # its late outcome, unheard
        raise asyncio.TimeoutError
    return read.result()


def abandon(events) -> None:
    """Cancel a forwarded call without blocking this replica's loop: Serve's
    ``DeploymentResponseGenerator.cancel`` resolves the replica synchronously and calls ``ray.cancel``,
    so it runs on a worker thread (the handle's router lives in its own loop: thread-safe)."""

    def cancel() -> None:
        try:
            events.cancel()
        except Exception as exc:  # already finished, or the owner is gone
            logger.debug("cancelling a forwarded call: %s", exc)

    asyncio.get_running_loop().run_in_executor(None, cancel)


class ForwardingReplica:
    """The forwarding half of the data plane's deployment (:class:`rollout_service.serve.app.RolloutService`).

    The deployment provides ``config``, ``haproxy``, ``app_name``, ``replica_id``, the counters
    ``forwarded`` / ``forward_fallbacks``, and ``_local_events(turn)`` (the turn run on this replica).
    """

    config: RolloutServiceConfig
    _self_handle = None
    _warned_routing = False

    def _owns(self, rollout_id: str) -> bool:
        """True when the router placed this request by its rollout id (we are the owning replica).

        Under HAProxy every replica owns what reaches it: HAProxy's hash is the only placement (a
        handle call could not reach the replica it picked), and the store keeps a call on another
        replica exact."""
        if self.haproxy:
            return True
        try:
            session = serve.context._get_serve_request_context().session_id
        except Exception:
            return False
        return session == rollout_id

    def _owner(self, rollout_id: str, *, stream: bool):
        if self._self_handle is None:
            self._self_handle = serve.get_deployment_handle(DEPLOYMENT_NAME, app_name=self.app_name)
        self.forwarded += 1
        return self._self_handle.options(session_id=rollout_id, stream=stream)

    def _note_forward(self, request: Request, rollout_id: str) -> None:
        if not self._warned_routing and request.headers.get(ROLLOUT_HEADER) == rollout_id:
            self._warned_routing = True
            logger.warning("the Serve proxy did not route X-Rollout-Id to its replica: start Ray with %s=%s (every "
                           "call now takes one extra internal hop)", SESSION_HEADER_ENV, ROLLOUT_HEADER)

    async def _events(self, turn: TurnRequest, request: Request) -> AsyncIterator:
        """The runner's events for a turn, run here or on the replica that owns its rollout."""
        if turn.rollout_id is None or self._owns(turn.rollout_id):
            if turn.rollout_id is not None and self.haproxy and request.headers.get(ROLLOUT_HEADER) != turn.rollout_id:
                # HAProxy hashed no rollout id: the call's retry may reach another replica
                turn = dataclasses.replace(turn, shared_claim=True)
            async for event in self._local_events(turn):
                yield event
            return
        self._note_forward(request, turn.rollout_id)
        timeout = self.config.service.forward_accept_timeout_s
        # The owner starts the turn only before half the timeout has passed, so an acceptance is back
        # here before this side gives up: the turn never runs on both (clocks of one cluster agree to
        # well under that; if they did not, one of the two conditional appends would lose: a 409).
        events = self._owner(turn.rollout_id, stream=True).run_forwarded.remote(
            turn, time.time() + timeout / 2, self.config.service.forward_heartbeat_s)
        try:
            await next_within(events, timeout)  # run_forwarded's TurnAccepted
        except (asyncio.TimeoutError, StopAsyncIteration):
            # No acceptance in time (how often, measured: docs/data-plane.md): forwarded turns
            # whose owner ran and stored the turn but whose streamed events never came back through
            # Serve's handle; or the call was refused there as too late.
            abandon(events)
            async for event in self._fallback_events(turn, "not-accepted",
                                                     f"not accepted by its owner within {timeout:.1f} s"):
                yield event
            return
        streamed = answered = False
        while True:
            # The owner sends a heartbeat whenever the turn is quiet for forward_heartbeat_s, so
            # silence for the whole timeout means the stream is lost, not that the turn is slow.
            try:
                event = await next_within(events, timeout)
            except StopAsyncIteration:
                return
            except asyncio.TimeoutError:
                if answered:  # only the stream's end is missing: the answer is here
                    return
                abandon(events)  # the owner's turn stops there (its engine call is aborted) if it is still running
                if streamed:  # the client has part of the answer: it must retry (answered from the store)
                    self.forward_fallbacks += 1
                    logger.warning("forwarded turn of rollout %s: its owner's stream went silent for %.1f s after "
                                   "deltas were sent: ending the stream with a retryable error", turn.rollout_id,
                                   timeout)
                    raise ServiceError(503, f"the replica owning rollout {turn.rollout_id!r} stopped answering; retry "
                                       "(a turn it stored is answered from the store)", type="service_unavailable",
                                       code="forward_lost")
                async for event in self._fallback_events(turn, "silent", f"its owner's stream silent for {timeout:.1f} s"):
                    yield event
                return
            if isinstance(event, TurnHeartbeat):
                continue
            if isinstance(event, TurnError):
                raise ServiceError.from_result({"__error__": event.status, **event.envelope})
            if isinstance(event, TokenDelta):
                streamed = True
            elif isinstance(event, TurnResult):
                answered = True
            yield event

    async def _fallback_events(self, turn: TurnRequest, reason: str, why: str) -> AsyncIterator:
        """A forwarded turn given up (``reason``: not-accepted | silent) runs here, exact from the
        store: a turn the owner stored is answered from it (replayed), never run twice or forked; one
        the owner is still running (its cancellation lost too) meets the conditional append: one of
        the two is a 409, and a retry is answered from the store."""
        self.forward_fallbacks += 1
        logger.warning("forwarded turn of rollout %s %s: running it here", turn.rollout_id, why)
        async for event in self._local_events(dataclasses.replace(turn, replay_if_stored=True)):
            if isinstance(event, TurnResult):
                event.forward_fallback = reason
            yield event

    async def run_forwarded(self, turn: TurnRequest, accept_by: float | None = None, heartbeat_s: float | None = None):
        """A turn forwarded by another replica (this one owns its rollout); errors travel as data.
        The first event says it was accepted (:class:`TurnAccepted`); after ``accept_by`` (epoch
        seconds) it is refused with no event: the sender runs it itself. Then the turn's events,
        with a :class:`TurnHeartbeat` after every ``heartbeat_s`` without one."""
        if accept_by is not None and time.time() > accept_by:
            logger.warning("forwarded turn of rollout %s arrived %.3f s after its acceptance deadline: left to "
                           "the replica that received it", turn.rollout_id, time.time() - accept_by)
            return
        yield TurnAccepted(self.replica_id)
        try:
            events = self._local_events(turn)
            if heartbeat_s:
                events = with_heartbeats(events, heartbeat_s)
            async with contextlib.aclosing(events):
                async for event in events:
                    yield event
        except ServiceError as exc:
            yield TurnError(exc.status, exc.envelope())
        except Exception as exc:
            yield TurnError(*unexpected_error(exc))
