"""The trainer's side of the collective transport over the gloo group ``init_weight_sync`` formed:
a refit's bucket plan, the controller's call started, the buckets broadcast from a worker thread
while a poll watches for the workers' join (the controller refusing or failing, or the join's
deadline passing), what the refit returns or raises from the controller's outcome and the
trainer's own send, and a group that fell out of step with the workers forgotten without waiting
for it. A mixin of :class:`~rollout_service.refit.client.TrainerClient` (its group, its pack buffers
and its call of the controller), beside :class:`~rollout_service.refit.nccl_trainer.NcclTrainer`.
Imports neither vLLM nor Ray.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from typing import Any, Callable

from rollout_service.refit.awaiting import aget, settle
from rollout_service.refit.deadlines import trainer_wait_s
from rollout_service.refit.transports import CollectiveTransfer
from rollout_service.refit.types import RefitFailed, WeightSyncNotInitialized
from rollout_service.weights.collective import ABORT_MESSAGE, GroupOutOfSync, plan_for_state_dict, send_buckets


class GlooTrainer:
    async def _arefit_collective(self, version, params, clear, timeout, on_bucket, bucket_bytes) -> dict[str, Any]:
        group, plan = self._collective_plan(params, bucket_bytes)
        ref = self._start(version, CollectiveTransfer(plan.to_json(), plan.total_bytes), clear, timeout)
        # The controller's outcome is awaited on the loop and lands in a thread-safe future: the
        # send's poll (in the worker thread) reads it there, without Ray.
        outcome: concurrent.futures.Future = concurrent.futures.Future()
        waiter = asyncio.ensure_future(settle(outcome, aget(ref, trainer_wait_s(timeout))))
        poll = _join_poll(outcome.done, outcome.result, timeout)
        try:
            timings, send_error = await asyncio.to_thread(self._send, group, params, plan, on_bucket, poll)
        except BaseException:
            waiter.cancel()  # the workers never joined: as the sync path, do not wait for the controller
            raise
        await waiter
        return self._collective_result(outcome.exception() or outcome.result(), timings, send_error)

    def _collective_plan(self, params, bucket_bytes: int):
        if self._group is None:
            raise WeightSyncNotInitialized("call init_weight_sync() first (or again after a failed transfer)")
        return self._group, plan_for_state_dict(params, bucket_bytes)

    def _send(self, group, params, plan, on_bucket, poll) -> tuple[dict[str, float], BaseException | None]:
        """The trainer's broadcast (blocking; the async path runs it in a worker thread).

        Returns ``(timings, None)``, or ``(timings, error)`` if it raised after the workers joined
        (the trainer's trailer said ABORT; the controller's outcome decides what to raise). If the
        workers never joined (``poll`` saw the controller refuse or fail, or the join timed out),
        the first header is still pending on our side: the group is out of step with the workers,
        so it is forgotten (re-create it before the next collective refit) and the cause raised.
        """
        timings: dict[str, float] = {}
        try:
            send_buckets(group, params, plan, on_bucket=on_bucket, poll=poll, buffers=self._pack_buffers,
                         timings=timings)
        except GroupOutOfSync as exc:
            self._forget_group(group)
            raise exc.__cause__ or exc
        except BaseException as exc:
            return timings, exc
        return timings, None

    def _collective_result(self, outcome, timings: dict[str, float], send_error: BaseException | None):
        """What a collective refit returns or raises, from the controller's ``outcome`` (its report,
        or the exception waiting for it raised) and the trainer's own ``send_error``."""
        if isinstance(outcome, RefitFailed):
            self._forget_group_if_out_of_step(outcome.report)
            if send_error is not None:
                raise outcome from send_error
            raise outcome
        if isinstance(outcome, BaseException):
            raise outcome
        if send_error is not None:
            raise send_error
        outcome["trainer_send_s"] = timings.get("send_s")
        return outcome

    def _forget_group_if_out_of_step(self, report: dict[str, Any] | None) -> None:
        """A worker's receive failed or timed out (not a clean ABORT): the group is out of step and
        the controller forgot it too; the next collective refit needs ``init_weight_sync()``."""
        report = report or {}
        if report.get("failed_step") == "transfer" and ABORT_MESSAGE not in (report.get("error") or ""):
            self._forget_group()

    def _forget_group(self, group=None) -> None:
        """Drop an out-of-step group without waiting for it. A broadcast of ours may still be pending
        in it (the handshake nobody received), and destroying a gloo group joins its threads: the
        thread that drops the last reference would wait until the workers leave the group or its
        timeout ends (measured: the whole timeout; on an event loop, a loop stalled that long). A
        timer thread holds the group until then, so whoever forgets it never waits."""
        group = self._group if group is None else group
        if self._group is group:
            self._group = None
        if group is not None:
            holder = [group]
            del group
            timer = threading.Timer(self._group_timeout_s + 5.0, holder.clear)
            timer.daemon = True
            timer.start()

def _join_poll(finished: Callable[[], bool], outcome: Callable[[], Any], step_timeout: float) -> Callable[[], None]:
    """``send_buckets``'s poll while waiting for the workers to join: the controller may have
    refused or failed (``finished()``; ``outcome()`` raises its exception), or the join timed out."""
    deadline = time.monotonic() + trainer_wait_s(step_timeout)

    def poll() -> None:
        if finished():
            outcome()
            raise RuntimeError("controller finished a collective refit without receiving any data")
        if time.monotonic() > deadline:
            raise TimeoutError(f"engine workers did not join the broadcast within {step_timeout}s")

    return poll
