"""The online parity canary of one data-plane replica.

A finished generation is drawn with probability ``canary.sample_fraction`` (:meth:`Canary.offer`:
a random draw and a non-blocking put on a bounded queue, nothing else on the answer's path). A
worker task takes it off the queue, re-scores prompt + generated ids on an engine by teacher
forcing (:meth:`~rollout_service.engine.scoring.Scoring.score`: one prefill, vLLM's prompt logprobs),
on another serving engine when there is one (``canary.score_on``), checks that the engine held the
same weight version the whole generation was sampled with, recomputes the processed logprob of
every generated token under the generation's own sampling parameters
(:mod:`rollout_service.canary.recompute`) and counts |Δ| against what the engine returned when it
sampled (:class:`~rollout_service.canary.stats.CanaryStats`, the metrics). What cannot be compared
honestly is skipped and counted by reason. A reporter task sends the replica's figures to the fleet
every ``canary.report_interval_s`` when they moved (``GET /v1/status`` merges them).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from dataclasses import dataclass
from typing import Any

from rollout_service.canary.recompute import plan, processed
from rollout_service.canary.stats import CanaryStats
from rollout_service.config import CanaryConfig
from rollout_service.engine.types import ScoreRequest
from rollout_service.metrics import get_metrics

logger = logging.getLogger(__name__)

RESEND_S = 30.0  # a report is sent at least this often, moved or not (a restarted fleet gets it back)


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


class Canary:
    def __init__(self, config: CanaryConfig, fleet, replica_id: str, *, max_top: int, rng: random.Random | None = None):
        """``fleet``: the replica's
        :class:`~rollout_service.fleet.client.FleetClient`; ``max_top``: the engines' ``max_logprobs``."""
        self.config = config
        self.fleet = fleet
        self.replica_id = replica_id
        self.max_top = max_top
        self.rng = rng or random.Random()
        self.stats = CanaryStats(threshold=config.threshold)
        self.queue: asyncio.Queue[tuple[Generation, int]] = asyncio.Queue(maxsize=config.queue_size)
        self._tasks: list[asyncio.Task] = []
        self._busy = 0  # generations taken off the queue and not finished

    @property
    def enabled(self) -> bool:
        return self.config.sample_fraction > 0

    def offer(self, gen: Generation) -> None:
        """Draw ``gen`` or not; never waits, never raises."""
        try:
            if not self.enabled or self.rng.random() >= self.config.sample_fraction:
                return
            self._start()
            num_top = plan(gen.sampling, self.max_top)
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

    def _skip(self, reason: str) -> None:
        self.stats.skip(reason)
        get_metrics().canary_skipped(reason)

    def _start(self) -> None:
        if not self._tasks:
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
        versions = {v for v, _, _ in gen.weight_versions}
        if len(versions) != 1:
            return "version_moved" if versions else "empty"
        if gen.migrations:
            return "migrated"  # its tokens came from two engines
        if not gen.token_ids:
            return "empty"
        version = versions.pop()
        member = self._scorer(gen.slot)
        if member is None:
            return "no_engine"
        request = ScoreRequest(token_ids=list(gen.prompt_ids) + list(gen.token_ids), start=len(gen.prompt_ids),
                               num_top=num_top)
        ref = member.handle.score.remote(request)
        try:
            result = await asyncio.wait_for(asyncio.wrap_future(ref.future()), self.config.score_timeout_s)
        except asyncio.TimeoutError:
            _cancel(ref)
            return "score_timeout"
        except Exception as exc:
            logger.info("canary: re-scoring on engine slot %d failed: %s", member.slot, exc)
            return "score_failed"
        if not result.supported:
            return "engine_cannot_score"
        if result.weight_version != version:
            return "version_moved"
        if not result.logprobs:
            return "empty"
        recomputed = processed(gen.sampling, result.logprobs, result.ranks, result.top_logprobs)
        if isinstance(recomputed, str):
            return recomputed
        behaviour = gen.logprobs[: len(recomputed)]
        turn = self.stats.add(gen.slot, version, member.slot, behaviour, recomputed)
        current = self.stats.entries[(gen.slot, version)]["stats"]
        get_metrics().canary_checked(gen.slot, (min(abs(r - b), 100.0) for b, r in zip(behaviour, recomputed)),
                                     turn.above, turn.token_mult_prob_error, current.max_abs, current.mean_abs or 0.0)
        return None

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
            await asyncio.wait_for(self.fleet.fleet.report_canary.remote(self.replica_id, self.stats.report()),
                                   timeout=5.0)
            return True
        except Exception as exc:
            logger.info("canary: the fleet did not take this replica's report: %s", exc)
            return False


def _cancel(ref) -> None:
    with contextlib.suppress(Exception):
        import ray

        ray.cancel(ref)
