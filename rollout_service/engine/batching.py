"""Batching a token stream in time: the first piece at once, then at most one batch per window.

A streamed generation crosses Ray as one object per yielded chunk, and each object costs the
consumer far more CPU than the tokens in it (``scripts/bench_engine.py --windows``; figures in
docs/benchmarks.md, "Figures kept out of the code"). :func:`batched` puts a producer task between the engine's
output stream and the consumer: it drains the source as fast as the source yields, and the
consumer takes everything gathered since its last batch, merged into one. Pure asyncio, no Ray or
vLLM, so it is tested on its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import AsyncIterator, Callable, TypeVar

T = TypeVar("T")


async def batched(
    source: AsyncIterator[T],
    window_s: float,
    merge: Callable[[list[T]], T],
    clock: Callable[[], float] = time.monotonic,
) -> AsyncIterator[T]:
    """Yield ``source``'s items merged in batches.

    - The first item is yielded as soon as it arrives (time to first token), and so is the first
      item after a lull longer than ``window_s`` (a paused engine).
    - After that, a batch is yielded no sooner than ``window_s`` after the previous one was handed
      over, and holds every item that arrived meanwhile, including while the consumer was busy with
      the previous batch.
    - The end of the source flushes at once: a finished generation never waits out a window.
    - An exception from the source is raised to the consumer after the items that came before it.
    - If the consumer stops early (closes, is cancelled, fails), the producer is cancelled, so the
      source sees the cancellation inside its own ``await`` and cleans up there (the engine
      aborts the request).
    """
    pending: list[T] = []
    arrived = asyncio.Event()
    ended = asyncio.Event()
    error: list[Exception] = []

    async def drain() -> None:
        try:
            async with contextlib.aclosing(source) as items:  # type: ignore[type-var]
                async for item in items:
                    pending.append(item)
                    arrived.set()
        except Exception as exc:  # handed to the consumer; cancellation propagates
            error.append(exc)
        finally:
            ended.set()
            arrived.set()

    producer = asyncio.create_task(drain())
    try:
        last_sent: float | None = None
        while True:
            while not pending and not ended.is_set():
                arrived.clear()
                await arrived.wait()
            if pending and last_sent is not None and not ended.is_set():
                wait_s = last_sent + window_s - clock()
                if wait_s > 0:
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(wait_s):
                            await ended.wait()
            if pending:
                batch = merge(pending) if len(pending) > 1 else pending[0]
                pending.clear()
                last_sent = clock()
                yield batch
            elif ended.is_set():
                break
        if error:
            raise error[0]
    finally:
        if not producer.done():
            producer.cancel()
        await asyncio.wait([producer])
