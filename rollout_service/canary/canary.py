"""The online parity canary of one data-plane replica.

A generation is drawn with probability ``canary.sample_fraction`` (:meth:`Canary.draw`, before it
runs; once finished, :meth:`Canary.take` puts it on a bounded queue without waiting: nothing else on
the answer's path, and an undrawn generation keeps nothing for the canary). A
worker task takes it off the queue, re-scores prompt + generated ids on an engine by teacher
forcing (:meth:`~rollout_service.engine.scoring.Scoring.score`: one prefill, vLLM's prompt logprobs),
on another serving engine when there is one (``canary.score_on``), checks that the engine holds the
version that sampled the generation's last token, recomputes the processed logprob of every
generated token under the generation's own sampling parameters
(:mod:`rollout_service.canary.recompute`; where that needs every logit, the scoring engine's worker
computes it over the whole vocabulary) and counts |Δ| against what the engine returned when it
sampled (:class:`~rollout_service.canary.stats.CanaryStats`, the metrics). A generation a refit
landed in is compared on the tokens of its last version: those over pure KV count as any (the
scorer holds exactly their weights), those over KV an older version computed (``kv_version``,
``refit.clear_cache: false``) are counted apart (``mixed``: expected off, never in the alarm's
figures); tokens of the older versions are not compared. What cannot be compared honestly is
skipped and counted by reason. A reporter task sends the replica's figures to the fleet
every ``canary.report_interval_s`` when they moved (``GET /v1/status`` merges them).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import math
import random
import threading
import time
from dataclasses import dataclass
from typing import Any

from rollout_service.canary.recompute import WHOLE_TOLERANCE, WHOLE_VOCABULARY, plan, processed
from rollout_service.canary.stats import CanaryStats
from rollout_service.config import CanaryConfig
from rollout_service.engine.types import Processing, ScoreRequest, kv_spans
from rollout_service.metrics import get_metrics
from rollout_service.training.parity import DIFF_CAP

logger = logging.getLogger(__name__)

RESEND_S = 30.0  # a report is sent at least this often, moved or not (a restarted fleet gets it back)
WINDOW_S = 300.0  # the max / mean gauges cover the generations checked this long ago at most


@dataclass
class Generation:
    """One finished generation as the data plane saw it."""

    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    sampling: Any  # engine.sampling.SamplingOptions
    slot: int
    weight_versions: list[tuple[str, int, int]]
    migrations: int = 0
    kv_resets: list[int] | None = None  # GenerationChunk.kv_resets
    kv_base: str | None = None  # GenerationChunk.kv_base


class Canary:
    def __init__(self, config: CanaryConfig, fleet, replica_id: str, *, max_top: int,
                 logprobs_mode: str = "processed_logprobs", rng: random.Random | None = None):
        """``fleet``: the replica's :class:`~rollout_service.fleet.client.FleetClient`; ``max_top`` and
        ``logprobs_mode``: the engines' ``max_logprobs`` and ``logprobs_mode``."""
        self.config = config
        self.fleet = fleet
        self.replica_id = replica_id
        self.max_top = max_top
        self.logprobs_mode = logprobs_mode
        self.whole_vocabulary = True  # False once a scoring engine could not process the whole vocabulary
        self.rng = rng or random.Random()
        self._window: dict[int, collections.deque] = {}  # slot -> (time, max |Δ|, sum |Δ|, tokens) per check
        self._window_lock = threading.Lock()  # the metrics' refresher thread reads the windows
        self._lock = threading.Lock()  # the figures: counted in a worker thread, reported from the loop
        self.stats = CanaryStats(threshold=config.threshold)
        self.queue: asyncio.Queue[tuple[Generation, int]] = asyncio.Queue(maxsize=config.queue_size)
        self._tasks: list[asyncio.Task] = []
        self._busy = 0  # generations taken off the queue and not finished

    @property
    def enabled(self) -> bool:
        return self.config.sample_fraction > 0

    def draw(self) -> bool:
        """Whether the generation about to run is checked (a random draw at ``sample_fraction``): the data
        plane asks before a generation, so only a drawn one keeps its ids and logprobs for :meth:`take`."""
        return self.enabled and self.rng.random() < self.config.sample_fraction

    def offer(self, gen: Generation) -> None:
        """Draw ``gen`` or not, and take it if drawn; never waits, never raises."""
        if self.draw():
            self.take(gen)

    def take(self, gen: Generation) -> None:
        """Queue a drawn generation for re-scoring (or count why not); never waits, never raises."""
        try:
            self._start()
            if len(gen.prompt_ids) + len(gen.token_ids) > self.config.max_score_tokens:
                return self._skip("too_long")
            num_top = plan(gen.sampling, self.max_top, self.logprobs_mode, self.whole_vocabulary)
            if isinstance(num_top, str):
                return self._skip(num_top)
            self.queue.put_nowait((gen, num_top))
        except asyncio.QueueFull:
            self._skip("queue_full")
        except Exception:
            logger.warning("the canary could not take a generation", exc_info=True)

    def idle(self) -> bool:
        """Nothing waiting or being re-scored."""
        return self.queue.empty() and not self._busy

    def figures(self) -> dict[str, Any]:
        """This replica's figures as it reports them (:meth:`CanaryStats.report`)."""
        with self._lock:
            return self.stats.report()

    def _skip(self, reason: str) -> None:
        with self._lock:
            self.stats.skip(reason)
        get_metrics().canary_skipped(reason)

    def _start(self) -> None:
        if not self._tasks or any(t.done() for t in self._tasks):
            for task in self._tasks:
                if task.done() and not task.cancelled() and task.exception() is not None:
                    logger.error("a canary task ended: %r; restarted", task.exception())
                task.cancel()
            loop = asyncio.get_running_loop()
            self._tasks = [loop.create_task(self._work()), loop.create_task(self._report_loop())]

    def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        self._tasks = []

    # ------------------------------------------------------------------ checking
    async def _work(self) -> None:
        while True:
            gen, num_top = await self.queue.get()
            self._busy += 1
            try:
                reason = await self.check(gen, num_top)
                if reason is not None:
                    self._skip(reason)
            except Exception:
                logger.warning("the canary's check of a generation failed", exc_info=True)
                self._skip("score_failed")
            finally:
                self._busy -= 1

    async def check(self, gen: Generation, num_top: int) -> str | None:
        """Re-score and count ``gen``; the skip reason if it could not be compared."""
        spans = kv_spans(gen.weight_versions, gen.kv_resets, gen.kv_base)
        if not spans or not gen.token_ids:
            return "empty"
        if gen.migrations:
            return "migrated"  # its tokens came from two engines
        version = spans[-1][0]
        member = self._scorer(gen.slot)
        if member is None:
            return "no_engine"
        s = gen.sampling
        whole = num_top == WHOLE_VOCABULARY
        request = ScoreRequest(token_ids=list(gen.prompt_ids) + list(gen.token_ids), start=len(gen.prompt_ids),
                               num_top=0 if whole else num_top,
                               processing=Processing(s.temperature, max(s.top_k, 0), s.top_p, s.min_p,
                                                     WHOLE_TOLERANCE) if whole else None)
        ref = member.handle.score.remote(request)
        try:
            result = await asyncio.wait_for(asyncio.wrap_future(ref.future()), self.config.score_timeout_s)
        except asyncio.TimeoutError:
            _cancel(ref)
            return "score_timeout"
        except Exception as exc:
            logger.info("canary: re-scoring on engine slot %d failed: %s", member.slot, exc)
            return "score_failed"
        if not result.whole_vocabulary:  # from now on, what the top logprobs give (recompute.plan)
            if self.whole_vocabulary:
                logger.warning("canary: engine slot %d cannot process the whole vocabulary; settings that need it "
                               "are skipped from now on", member.slot)
            self.whole_vocabulary = False
            return "whole_vocabulary_unavailable"
        if not result.supported:
            return "engine_cannot_score"
        if result.weight_version != version:
            return "version_moved"
        if not result.logprobs:
            return "empty"
        # The recompute and the per-token records are pure Python over every token: off the event loop
        # that streams the answers.
        return await asyncio.to_thread(self._compare, gen, version, member.slot, result, spans)

    def _compare(self, gen: Generation, version: str, scored_on: int, result, spans) -> str | None:
        if result.processed is not None:
            recomputed = result.processed  # the engine's worker processed the whole vocabulary
        else:
            recomputed = processed(gen.sampling, result.logprobs, result.top_logprobs)
            if isinstance(recomputed, str):
                return recomputed
        behaviour = gen.logprobs[: len(recomputed)]
        if len(spans) > 1:  # a refit landed in it: its last version's tokens, pure and mixed apart
            pure = [i for v, s, e, kv in spans if v == version and kv == version for i in range(s, e)
                    if i < len(recomputed)]
            mixed = [i for v, s, e, kv in spans if v == version and kv != version for i in range(s, e)
                     if i < len(recomputed)]
            if mixed:
                with self._lock:
                    self.stats.add_mixed([behaviour[i] for i in mixed], [recomputed[i] for i in mixed])
            if not pure:
                return None
            behaviour, recomputed = [behaviour[i] for i in pure], [recomputed[i] for i in pure]
        with self._lock:
            turn = self.stats.add(gen.slot, version, scored_on, behaviour, recomputed)
        diffs = [min(abs(r - b), DIFF_CAP) if math.isfinite(r) else DIFF_CAP
                 for b, r in zip(behaviour, recomputed) if r is not None]
        with self._window_lock:
            new = gen.slot not in self._window
            self._window.setdefault(gen.slot, collections.deque()).append(
                (time.monotonic(), max(diffs, default=0.0), sum(diffs), len(diffs)))
        if new:  # (outside the lock: the gauge reads its window at once)
            slot = gen.slot
            get_metrics().canary_gauges(slot, lambda: self._window_figure(slot, "max"),
                                        lambda: self._window_figure(slot, "mean"))
        get_metrics().canary_checked(gen.slot, diffs, turn.above, turn.token_mult_prob_error)
        return None

    def _window_figure(self, slot: int, which: str) -> float:
        """Max or mean |Δ| over the generations of ``slot`` checked in the last WINDOW_S (NaN: none)."""
        horizon = time.monotonic() - WINDOW_S
        with self._window_lock:
            window = self._window.get(slot, ())
            while window and window[0][0] < horizon:
                window.popleft()
            if not window:
                return math.nan
            if which == "max":
                return max(w[1] for w in window)
            tokens = sum(w[3] for w in window)
            return sum(w[2] for w in window) / tokens if tokens else math.nan

    def _scorer(self, slot: int):
        members = self.fleet.members()
        same = [m for m in members if m.slot == slot]
        if self.config.score_on == "other":
            others = [m for m in members if m.slot != slot]
            if others:
                return min(others, key=lambda m: (m.load, self.rng.random()))
        return same[0] if same else None

    # ------------------------------------------------------------------ reporting
    async def _report_loop(self) -> None:
        sent, sent_at = -1, 0.0
        while True:
            await asyncio.sleep(self.config.report_interval_s)
            if self.stats.changes == sent and time.monotonic() - sent_at < RESEND_S:
                continue
            changes = self.stats.changes
            if await self.report():
                sent, sent_at = changes, time.monotonic()

    async def report(self) -> bool:
        """Send this replica's figures to the fleet now; False if it could not be reached in time."""
        try:
            await asyncio.wait_for(self.fleet.fleet.report_canary.remote(self.replica_id, self.figures()),
                                   timeout=5.0)
            return True
        except Exception as exc:
            logger.info("canary: the fleet did not take this replica's report: %s", exc)
            return False


def _cancel(ref) -> None:
    with contextlib.suppress(Exception):
        import ray

        ray.cancel(ref)
