"""How the trainer's client waits on the refit controller: its object refs awaited on the event
loop, the controller's own exceptions (``RefitFailed``, ``RefitInProgress``, ...) raised rather
than Ray's wrapper (:func:`aget`), and the synchronous shim every plain method of
:class:`~rollout_service.refit.client.TrainerClient` is (:func:`run_sync`). Imports neither vLLM
nor (until used) Ray.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import sys
from typing import Awaitable, Callable

from rollout_service.refit.types import RefitFailed, RefitInProgress, WeightSyncNotInitialized


def run_sync(coro):
    """The synchronous shim: run a coroutine of the client to completion from sync code, in a private
    event loop; on a worker thread when the calling thread already runs a loop (which it blocks, as
    any synchronous call would)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(on_callers_device(asyncio.run), coro).result()


def on_callers_device(fn: Callable) -> Callable:
    """``fn``, to run in another thread on the calling thread's CUDA device: torch's current device is
    per thread (a new thread starts on device 0), and vLLM's NCCL trainer engine puts its
    communicator and buffers on the current device. A process that never imported torch has none."""
    torch = sys.modules.get("torch")
    device = None
    try:
        if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
            device = torch.cuda.current_device()
    except Exception:  # pragma: no cover - no usable CUDA
        device = None
    if device is None:
        return fn

    def on_device(*args, **kwargs):
        torch.cuda.set_device(device)
        return fn(*args, **kwargs)

    return on_device



_OUR_ERRORS = (RefitFailed, RefitInProgress, WeightSyncNotInitialized, ValueError, TypeError)


def _our_cause(exc: BaseException) -> BaseException | None:
    """The controller's own exception inside Ray's ``RayTaskError``, if it is one of ours."""
    cause = getattr(exc, "cause", None)
    return cause if isinstance(cause, _OUR_ERRORS) else None


async def aget(ref, timeout: float | None):
    """The ref's value, awaited, raising our own exceptions (RefitFailed, RefitInProgress, ...) rather
    than Ray's wrapper; a timeout raises Ray's ``GetTimeoutError``."""
    import ray

    try:
        return await asyncio.wait_for(_await(ref), timeout)
    except ray.exceptions.RayTaskError as exc:
        cause = _our_cause(exc)
        if cause is not None:
            raise cause from None
        raise
    except TimeoutError:
        raise ray.exceptions.GetTimeoutError(f"Get timed out: {ref} not ready after {timeout}s") from None


async def _await(ref):
    return await ref


async def settle(future: concurrent.futures.Future, awaitable: Awaitable) -> None:
    """Await ``awaitable`` and put its result or exception into a thread-safe ``future``."""
    try:
        result = await awaitable
    except BaseException as exc:
        future.set_exception(exc)
        if isinstance(exc, asyncio.CancelledError):
            raise
    else:
        future.set_result(result)


def mark_retrieved(task: asyncio.Task) -> None:
    """Done-callback of a shielded refit: mark its exception retrieved if nobody awaits it any more."""
    if not task.cancelled():
        task.exception()
