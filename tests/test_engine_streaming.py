"""Engine streaming: batched chunks (first token at once), exactly the tokens of an unbatched stream.

The batching itself (:func:`rollout_service.engine.batching.batched`) is pure asyncio and pinned
first with scripted sources; then the real engine actor: chunk count, first chunk, bit-identity with
``generate_all``, and a consumer that goes away aborting its vLLM request.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest

from rollout_service.engine.batching import batched


def _concat(items: list[list[int]]) -> list[int]:
    return [x for item in items for x in item]


async def _script(steps, log: list[str] | None = None):
    """Yield ``[i]`` per step after sleeping its delay; a step that is an exception is raised."""
    try:
        for i, step in enumerate(steps):
            if isinstance(step, Exception):
                raise step
            await asyncio.sleep(step)
            yield [i]
    except asyncio.CancelledError:
        if log is not None:
            log.append("cancelled")
        raise
    finally:
        if log is not None:
            log.append("closed")


async def _collect(source, window_s):
    out, times = [], []
    t0 = time.monotonic()
    async with contextlib.aclosing(batched(source, window_s, _concat)) as batches:
        async for batch in batches:
            out.append(batch)
            times.append(time.monotonic() - t0)
    return out, times


async def test_the_first_item_goes_out_alone_and_what_follows_within_the_window_in_one_batch():
    out, _ = await _collect(_script([0.0] * 41), window_s=0.5)
    assert out == [[0], list(range(1, 41))]


async def test_batches_after_the_first_are_a_window_apart():
    out, times = await _collect(_script([0.0] + [0.004] * 100), window_s=0.06)
    assert _concat(out) == list(range(101))
    gaps = [b - a for a, b in zip(times[1:-1], times[2:-1])]  # the last batch is the end: sent at once
    assert len(out) <= 101 // 3 and gaps and min(gaps) >= 0.05


async def test_the_end_of_the_source_is_sent_without_waiting_out_the_window():
    out, times = await _collect(_script([0.0, 0.01, 0.0]), window_s=2.0)
    assert _concat(out) == [0, 1, 2]
    assert times[-1] < 1.0


async def test_an_item_after_a_lull_is_sent_at_once():
    out, times = await _collect(_script([0.0, 0.3, 0.0]), window_s=0.05)
    assert out[0] == [0] and out[1][0] == 1
    assert times[1] < 0.3 + 0.2  # not held for another window after the lull


async def test_what_arrives_while_the_consumer_is_busy_is_merged_even_with_a_zero_window():
    out = []
    async for batch in batched(_script([0.0] + [0.005] * 10), 0.0, _concat):
        out.append(batch)
        if len(out) == 1:
            await asyncio.sleep(0.2)  # the consumer is busy with its first batch
    assert out == [[0], list(range(1, 11))]


async def test_a_source_error_reaches_the_consumer_after_the_items_before_it():
    got: list[list[int]] = []
    with pytest.raises(RuntimeError, match="engine died"):
        async for batch in batched(_script([0.0, 0.0, RuntimeError("engine died")]), 0.01, _concat):
            got.append(batch)
    assert _concat(got) == [0, 1]


async def test_a_consumer_that_stops_early_cancels_the_source():
    log: list[str] = []
    batches = batched(_script([0.0] + [0.01] * 100, log), 0.01, _concat)
    assert await anext(batches) == [0]
    await batches.aclose()
    assert log == ["cancelled", "closed"]


async def test_a_cancelled_consumer_cancels_the_source():
    log: list[str] = []

    async def consume():
        async for _ in batched(_script([0.0] + [0.01] * 100, log), 0.01, _concat):
            pass

    task = asyncio.create_task(consume())
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert log == ["cancelled", "closed"]


# --------------------------------------------------------------------------- the real engine actor

PROMPT = [151644, 872, 198, 9707, 1879, 151645, 198, 151644, 77091, 198]  # <|im_start|>user\n... assistant\n


def _request(seed: int, max_tokens: int, **sampling):
    from rollout_service.engine.types import GenerateRequest
    from rollout_service.engine.sampling import SamplingOptions

    return GenerateRequest(prompt_ids=PROMPT, sampling=SamplingOptions.validated(seed=seed, ignore_eos=True, **sampling),
                           max_tokens=max_tokens)


async def _stream(actor, request, window_s):
    """(chunks, arrival seconds of each) of one streamed generation."""
    chunks, times = [], []
    t0 = time.monotonic()
    async for ref in actor.generate.options(num_returns="streaming").remote(request, window_s):
        chunks.append(await ref)
        times.append(time.monotonic() - t0)
    return chunks, times


def _joined(chunks):
    return ([t for c in chunks for t in c.token_ids], [lp for c in chunks for lp in c.logprobs],
            [d for c in chunks for d in c.top_logprobs or ()])


async def test_a_long_stream_comes_in_few_chunks_with_the_same_tokens_as_generate_all(engine_actor):
    n = 128
    batched_chunks, times = await _stream(engine_actor, _request(11, n, top_logprobs=2), 0.1)
    unbatched_chunks, _ = await _stream(engine_actor, _request(11, n, top_logprobs=2), 0.0)
    whole = await engine_actor.generate_all.remote(_request(11, n, top_logprobs=2))

    assert len(batched_chunks[0].token_ids) == 1  # the first token is flushed at once ...
    assert times[0] < times[-1] / 2  # ... long before the generation ends
    assert len(batched_chunks) <= n // 3 < len(unbatched_chunks)
    assert [c.finish_reason for c in batched_chunks] == [None] * (len(batched_chunks) - 1) + ["length"]

    ids, lps, tops = _joined(batched_chunks)
    assert len(ids) == n and len(tops) == n
    assert (ids, lps, tops) == _joined(unbatched_chunks) == (whole.token_ids, whole.logprobs, whole.top_logprobs)
    last = batched_chunks[-1]
    assert last.weight_versions == unbatched_chunks[-1].weight_versions == whole.weight_versions == [("0", 0, n)]
    assert (last.finish_reason, last.num_prompt_tokens) == (whole.finish_reason, whole.num_prompt_tokens)


@pytest.mark.parametrize("window_s", [0.02, 0.0])
async def test_a_consumer_that_cancels_its_stream_aborts_the_vllm_request(engine_actor, window_s):
    """The engine is paused (keep) right after the first chunk, so the request cannot finish by
    itself: it leaves the engine only through the abort the cancellation triggers."""
    import ray

    gen = engine_actor.generate.options(num_returns="streaming").remote(_request(12, 600), window_s)
    first = await (await anext(gen))
    assert first.token_ids and first.finish_reason is None
    await engine_actor.pause.remote(mode="keep")
    try:
        assert await engine_actor.num_in_flight.remote() == 1
        ray.cancel(gen)
        deadline = time.monotonic() + 10
        while await engine_actor.num_in_flight.remote() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert await engine_actor.num_in_flight.remote() == 0
    finally:
        await engine_actor.resume.remote()
    again, _ = await _stream(engine_actor, _request(12, 4), window_s)  # the engine serves on
    assert len(_joined(again)[0]) == 4
