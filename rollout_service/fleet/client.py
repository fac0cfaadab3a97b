"""The data plane's view of the fleet: live engine handles + epoch + a routing policy.

A :class:`FleetClient` is small and pickle-safe (the fleet handle, the last :class:`FleetView`, the
policy), so it can be shipped to any Ray actor or Serve replica. In a process that routes turns it
keeps the view fresh with a long poll on the fleet (a changed epoch answers at once) and routes
each call by the policy (:mod:`rollout_service.fleet.routing`): pinned to its rollout's engine,
moved off it when that engine left the serving set (or, sticky_least_loaded, carries too much
more than the least loaded). It never pauses, loads or labels anything: that is the control plane's business.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections import OrderedDict
from dataclasses import replace
from typing import Any, AsyncIterator

from rollout_service.engine.channel import EngineChannel
from rollout_service.metrics import get_metrics
from rollout_service.engine.types import GenerateRequest
from rollout_service.fleet.migration import Progress, unmovable
from rollout_service.fleet.routing import Route, RoutingPolicy, Sticky, group_home, least_loaded, load_of
from rollout_service.fleet.types import (
    abort_rollout_on,
    EngineCallDeadline,
    EngineLostDuringCall,
    FleetView,
    Member,
    NoEngineAvailable,
    is_actor_dead,
    is_engine_death,
)

logger = logging.getLogger(__name__)


class FleetClient:
    def __init__(self, fleet, view: FleetView | None = None, policy: RoutingPolicy | None = None,
                 max_pins: int = 100_000, poll_s: float = 2.0, resolve: Any = None,
                 call_deadline_s: float | None = None, call_deadline_s_per_token: float = 0.0,
                 nonstream_progress_s: float = 0.0, load_margin: int = 16):
        self.fleet = fleet
        self.load_margin = load_margin  # routing.load_margin: how far above the least loaded a group's home may be
        # A generation's deadline: call_deadline_s + call_deadline_s_per_token x max_tokens (None: none).
        self.call_deadline_s, self.call_deadline_s_per_token = call_deadline_s, call_deadline_s_per_token
        # > 0: a call whose caller wants one answer is streamed from the engine at this batch window,
        # so the ids generated so far are here if its engine dies (0: one round trip, re-run instead).
        self.nonstream_progress_s = nonstream_progress_s
        self.resolve = resolve  # () -> a fleet handle: called when the fleet actor is dead for good
        self.view = view
        self.policy = policy or Sticky()
        self.max_pins = max_pins
        self.poll_s = poll_s
        self.pins: OrderedDict[str, tuple[int, int]] = OrderedDict()
        self.outstanding: dict[tuple[int, int], int] = {}
        # Members seen failing -> until when this process avoids them: the fleet's view drops a dead
        # one within a probe round; one that was only unreachable for a moment comes back after.
        self.lost: dict[tuple[int, int], float] = {}
        self.avoid_lost_s = 10.0
        self._watch: asyncio.Task | None = None
        self.channels: dict[tuple[int, int], Any] = {}  # member key -> engine.channel.EngineChannel (this process)
        self.pin_moves = 0  # rollouts this process moved off a live engine (routing.policy)
        # The fleet actor as this process last saw it: the error of the last failed refresh (None:
        # the last one answered), and callbacks run when a restarted fleet answers (a new incarnation).
        self.fleet_error: str | None = None
        self.on_fleet_restart: list[Any] = []

    def __getstate__(self):
        return {"fleet": self.fleet, "view": self.view, "policy": self.policy, "max_pins": self.max_pins,
                "poll_s": self.poll_s, "resolve": self.resolve, "call_deadline_s": self.call_deadline_s,
                "call_deadline_s_per_token": self.call_deadline_s_per_token,
                "nonstream_progress_s": self.nonstream_progress_s}

    def __setstate__(self, state):
        self.__init__(**state)

    # ------------------------------------------------------------------ view
    async def refresh(self, wait_s: float = 0.0) -> FleetView:
        known = self.view.epoch if (self.view is not None and wait_s > 0) else None
        view = await self.fleet.view.remote(known, wait_s)
        self._set_view(view)
        return view

    def _set_view(self, view: FleetView) -> None:
        if self.view is not None and view.epoch != self.view.epoch:
            logger.info("fleet epoch %d -> %d: %d engine(s) serving", self.view.epoch, view.epoch, len(view.members))
        restarted = (self.view is not None and self.view.incarnation is not None
                     and view.incarnation not in (None, self.view.incarnation))
        self.view = view
        self.fleet_error = None
        if restarted:
            logger.warning("the fleet actor restarted (incarnation %s): %d engine(s) serving", view.incarnation,
                           len(view.members))
            for callback in self.on_fleet_restart:
                _background(callback())
        live = {m.key for m in view.members}
        now = time.monotonic()
        self.lost = {k: t for k, t in self.lost.items() if k in live and t > now}
        keep = live | set(getattr(view, "draining", ()))  # a draining engine finishes its calls
        for key in [k for k in self.channels if k not in keep]:
            # An engine that left the serving set (dead, replaced, retired): its calls fail now as
            # lost (retried elsewhere if they produced nothing), not whenever its socket notices.
            self.channels.pop(key).close()

    def start_watching(self) -> None:
        """Follow the fleet in the background in this process's event loop: a long poll that
        answers at once when the epoch changes, and every ``poll_s`` anyway (fresh loads)."""
        if self._watch is None or self._watch.done():
            self._watch = asyncio.get_running_loop().create_task(self._watch_loop())

    async def _watch_loop(self) -> None:
        while True:
            try:
                await self.refresh(wait_s=self.poll_s)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the fleet restarting: keep routing on the last view, try again shortly
                self.fleet_error = f"{type(exc).__name__}: {exc}"[:300]
                logger.warning("fleet view unavailable: %s", self.fleet_error)
                if is_actor_dead(exc) and self.resolve is not None:
                    try:  # dead for good (not restarted by Ray): look it up, or create it, by name
                        self.fleet = await asyncio.to_thread(self.resolve)
                    except Exception as again:
                        logger.warning("fleet could not be resolved again: %s", again)
                await asyncio.sleep(1.0)

    def stop_watching(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            self._watch = None

    # ------------------------------------------------------------------ routing
    def members(self) -> tuple[Member, ...]:
        if self.view is None:
            return ()
        now = time.monotonic()
        return tuple(m for m in self.view.members if self.lost.get(m.key, 0.0) <= now)

    def pick(self, rollout_id: str | None) -> Member:
        return self.route(rollout_id).member

    def route(self, rollout_id: str | None, group: str | None = None) -> Route:
        """The policy's choice for the rollout's next call (:mod:`rollout_service.fleet.routing`):
        given its pinned engine if that still serves; the choice is pinned (policies that pin). A
        rollout of ``group`` not pinned yet starts on the group's home engine (within the policy's load
        margin): the caller passes a group only where its rollouts belong together (the turn runner:
        ``routing.group_placement: together``, or the members of one call with ``n > 1``)."""
        members = self.members()
        if not members:
            raise NoEngineAvailable("no engine replica is serving (the fleet is replacing it)")
        pinned = None
        if rollout_id is not None and self.policy.pins:
            key = self.pins.get(rollout_id)
            pinned = next((m for m in members if m.key == key), None) if key is not None else None
            if pinned is None and group is not None:
                home = group_home(members, group)
                best = least_loaded(members, self.outstanding)
                if load_of(home, self.outstanding) <= load_of(best, self.outstanding) + self.load_margin:
                    pinned = home  # as if pinned there: the policy keeps it unless its load says otherwise
        route = self.policy.choose(members, self.outstanding, pinned)
        if rollout_id is not None and self.policy.pins:
            self.pins[rollout_id] = route.member.key
            self.pins.move_to_end(rollout_id)
            if len(self.pins) > self.max_pins:
                self.pins.popitem(last=False)
        if route.moved:
            self.pin_moves += 1
        return route

    def acquire(self, member: Member) -> None:
        self.outstanding[member.key] = self.outstanding.get(member.key, 0) + 1

    def release(self, member: Member) -> None:
        n = self.outstanding.get(member.key, 0) - 1
        if n > 0:
            self.outstanding[member.key] = n
        else:
            self.outstanding.pop(member.key, None)

    # ------------------------------------------------------------------ generation
    async def generate_with_failover(self, rollout_id: str | None, request: GenerateRequest,
                                     stream: bool, routed: list[Route] | None = None,
                                     group: str | None = None) -> AsyncIterator:
        """``request`` on the rollout's pinned engine (pinned at its first call to the least loaded one).

        An engine that dies (killed, crashed, or declared hung and killed by the fleet) is not the
        caller's problem: before the call passed on any token, it runs again on another engine from
        the same prompt ids; after, it continues on another engine from the prompt + the ids passed
        on so far (:mod:`~rollout_service.fleet.migration`), each live engine tried at most once. A
        generation that cannot be continued honestly (a grammar, presence / frequency penalties),
        or no engine left to try: :class:`EngineLostDuringCall`. No engine serving:
        :class:`NoEngineAvailable`. A generation still running at its deadline (:meth:`deadline_s`,
        over every engine it ran on) is aborted there: :class:`EngineCallDeadline`. Any other error
        of the call is raised as is. ``routed``, if given, gets the :class:`Route` of every attempt.
        """
        attempts = max(2, len(self.members()))  # each live engine once; at least one retry
        if not stream and self.nonstream_progress_s > 0:
            request, stream = replace(request, batch_window_s=self.nonstream_progress_s), True
        progress = Progress(request)
        budget = self.deadline_s(request.max_tokens)
        deadline = None if budget is None else asyncio.get_running_loop().time() + budget
        for attempt in range(attempts):
            route = self.route(rollout_id, group if attempt == 0 else None)
            member = route.member
            if routed is not None:
                routed.append(route)
            if attempt and not progress.ids:
                request = replace(request, request_id=uuid.uuid4().hex)
            self.acquire(member)
            chunks = self.generate(member, request, stream)
            try:
                while True:
                    timer = asyncio.timeout_at(deadline)
                    try:  # the deadline covers the wait for each chunk, never the caller's use of it
                        async with timer:
                            chunk = await anext(chunks)
                    except StopAsyncIteration:
                        return
                    except TimeoutError:
                        if not timer.expired():  # a timeout of the engine's own, not this call's deadline
                            raise
                        get_metrics().engine_call_deadline()
                        logger.warning("a call of rollout %s on engine slot %d passed its %.1fs deadline after %d "
                                       "tokens; aborted", rollout_id, member.slot, budget, len(progress.ids))
                        raise EngineCallDeadline(member.slot, budget, len(progress.ids)) from None
                    yield progress.take(chunk)
            except EngineCallDeadline:
                raise
            except Exception as exc:
                if not is_engine_death(exc):
                    raise
                self.report_lost(member, exc)
                if progress.finished:  # the engine died after its last chunk: nothing is missing
                    return
                if attempt + 1 >= attempts:
                    raise EngineLostDuringCall(member.slot) from None
                if progress.ids:
                    reason = unmovable(request, progress)
                    if reason is not None:
                        get_metrics().migration("refused")
                        raise EngineLostDuringCall(member.slot, reason) from None
                    request = progress.continuation()
                    get_metrics().migration("continued")
                    logger.warning("engine slot %d died after %d generated tokens; the call of rollout %s continues "
                                   "on another engine", member.slot, len(progress.ids), rollout_id)
                    if request is None:
                        yield progress.length_end(member.slot)
                        return
                else:
                    logger.warning("engine slot %d died; retrying the call of rollout %s on another engine",
                                   member.slot, rollout_id)
            finally:
                self.release(member)
                await chunks.aclose()

    def deadline_s(self, max_tokens: int) -> float | None:
        """Seconds a generation of up to ``max_tokens`` may take, whatever engines it runs on."""
        if self.call_deadline_s is None:
            return None
        return self.call_deadline_s + self.call_deadline_s_per_token * max_tokens

    async def generate(self, member: Member, request, stream: bool) -> AsyncIterator:
        """``request`` (:class:`~rollout_service.engine.types.GenerateRequest`) on ``member``'s engine: its chunks as they come
        (streaming), or the whole generation as one chunk. Over the engine's data channel when it
        has one (engine.data_channel: tcp), else a Ray actor call. Closing the iterator early stops
        the generation in the engine. Engine death: an error for which :func:`is_engine_death` holds."""
        if member.channel is not None:
            channel = self.channels.get(member.key)
            if channel is None or channel.closed:
                channel = self.channels[member.key] = EngineChannel(member.channel)
            chunks = channel.call(request, stream)
            async with contextlib.aclosing(chunks):
                async for chunk in chunks:
                    yield chunk
            return
        call, done = None, False
        try:
            if not stream:
                call = member.handle.generate_all.remote(request)
                chunk = await call
                done = True
                yield chunk
                return
            call = member.handle.generate.options(num_returns="streaming").remote(request)
            async for ref in call:
                yield await ref
            done = True
        finally:
            if call is not None and not done:
                _cancel(call)

    async def abort_rollout(self, rollout_id: str, timeout_s: float = 5.0) -> int:
        """Abort the requests of ``rollout_id`` on every engine serving now (each ends at its engine's
        next step with finish_reason abort); how many were running. An engine that does not answer
        within ``timeout_s`` counts none (a dead one runs nothing)."""
        return await abort_rollout_on(self.view.members if self.view is not None else (), rollout_id, timeout_s)

    def close_channels(self) -> None:
        for channel in self.channels.values():
            channel.close()
        self.channels.clear()

    def report_pin_move(self) -> None:
        """Tell the fleet a rollout moved off a live engine (it counts them for the status)."""
        try:
            self.fleet.count_pin_move.remote()
        except Exception:  # the fleet restarting: a count is not worth an error
            pass

    def report_lost(self, member: Member, error: BaseException) -> None:
        """A call on ``member`` failed as if the engine were dead: stop routing to it here and tell
        the fleet, which checks it now instead of at its next probe."""
        self.lost[member.key] = time.monotonic() + self.avoid_lost_s
        try:
            self.fleet.report_failure.remote(member.slot, member.generation, f"{type(error).__name__}: {error}"[:300],
                                             is_actor_dead(error))
        except Exception:  # the fleet itself restarting: its monitor will find the engine anyway
            pass


_BACKGROUND: set = set()


def _background(coro) -> None:
    """Run a restart callback without waiting for it (a reference is kept until it ends)."""
    task = asyncio.get_running_loop().create_task(coro)
    _BACKGROUND.add(task)
    task.add_done_callback(_BACKGROUND.discard)


def _cancel(call) -> None:
    """Stop an engine call nobody waits for any more (client gone, call cancelled): dropping a Ray
    streaming generator does not stop the actor's generator, ``ray.cancel`` does, and the engine
    then aborts the vLLM request."""
    import ray

    try:
        ray.cancel(call)
    except Exception:  # already finished, or the actor is gone
        pass


async def connect(fleet, **kwargs: Any) -> FleetClient:
    """A client with a fresh view, following the fleet from now on (call inside the event loop)."""
    client = FleetClient(fleet, **kwargs)
    await client.refresh()
    client.start_watching()
    return client
