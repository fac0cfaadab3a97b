"""What a restarted refit controller does before its first refit: end whatever refit its
previous incarnation left behind, with every serving engine on one version and resumed.

A mixin of :class:`~rollout_service.refit.controller.RefitController`, whose fleet, config,
locks and version record it uses.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from rollout_service.config import RolloutServiceConfig
from rollout_service.fleet.types import Member, is_actor_dead
from rollout_service.refit.types import short_error

logger = logging.getLogger("rollout_service.refit.controller")


class AbandonedRefitRecovery:
    config: RolloutServiceConfig

    def _end_abandoned_refit_soon(self) -> None:
        """Called by a restarted incarnation's constructor (in the actor's event loop): end the
        abandoned refit now, not at the first call, so engines a dead refit left paused serve again
        within seconds. Retried with a growing pause while the fleet cannot be reached; the first
        call still runs it (and waits for it) if it has not succeeded by then."""

        async def run() -> None:
            pause = 0.5
            while self._reconstructed:
                try:
                    await self._after_restart()
                except Exception as exc:
                    if is_actor_dead(exc):
                        self._fleet = None  # killed for good: looked up (or created) by name again
                    logger.warning("refit controller restarted: recovery failed, retrying in %.1fs: %s", pause,
                                   short_error(exc))
                    await asyncio.sleep(pause)
                    pause = min(pause * 2, self.config.refit.step_timeout_s)

        self._abandoned_refit_task = asyncio.get_running_loop().create_task(run())

    async def _after_restart(self) -> None:
        if not self._reconstructed:
            return
        async with self._abandoned_refit_lock:
            if self._reconstructed:
                self.recovered = await self._end_abandoned_refit()
                self._reconstructed = False
                logger.warning("refit controller restarted: %s", self.recovered)

    async def _end_abandoned_refit(self) -> dict[str, Any]:
        """After a restart: whatever refit the previous incarnation was running is over. Every
        serving engine is brought back to one version and resumed:

        - an engine that loaded new weights without committing them reloads the previous ones
          (``rs_rollback``) and takes the fleet's version label back;
        - if every engine committed the same new version (the old incarnation died between the
          commit and telling the fleet), the fleet is told: the refit happened;
        - an engine that committed a version the others did not is handed to the fleet to be
          replaced on the current version (its weights cannot be rolled back);
        - the NCCL path loads in place with nothing staged: every engine goes back to its last
          committed weights (``rs_nccl_abort``), as when a round's lease runs out;
        - every engine is resumed (idempotent) and the fleet's refit bracket ended.
        The engines looked at are the serving ones and, while the fleet's refit bracket is open,
        every live engine of that refit (``loaded_members``): a restarted fleet keeps those labelled
        with a version it never recorded out of the serving set (STALE) until this brings them back.
        The trainer's refit call failed with the controller's death; it may retry."""
        timeout = self.config.refit.step_timeout_s
        stats = await asyncio.wait_for(self.fleet.stats.remote(), timeout)
        members = await asyncio.wait_for(self.fleet.loaded_members.remote(), timeout)
        current = stats["weight_version"]
        healths = await asyncio.gather(*[asyncio.wait_for(m.handle.health.remote(), timeout) for m in members],
                                       return_exceptions=True)
        left = stats.get("refitting") or any(
            isinstance(h, BaseException) or h.get("paused") or h.get("weight_version") != current for h in healths)
        if not left:  # died between refits: nothing to undo (and nothing to reload: NCCL engines keep theirs)
            self.weight_version = current
            if current not in self._version_history:
                self._version_history.append(current)
            return {"version": current, "engines": len(members), "rolled_back": 0, "relabelled": 0,
                    "replaced": 0, "rolled_forward": None}
        nccl = self.config.refit.backend == "nccl"

        async def one(m: Member):
            e = m.handle
            rolled = await asyncio.wait_for(e.collective_rpc.remote("rs_nccl_abort" if nccl else "rs_rollback",
                                                                    timeout=timeout), timeout)
            if not nccl:
                await asyncio.wait_for(e.collective_rpc.remote("rs_discard_staged", timeout=timeout), timeout)
            return (bool(nccl or any(r.get("reloaded") for r in rolled if r)),
                    await asyncio.wait_for(e.weight_version.remote(), timeout))

        results = await asyncio.gather(*[one(m) for m in members], return_exceptions=True)
        done: dict[str, Any] = {"version": current, "engines": len(members), "rolled_back": 0,
                                "relabelled": 0, "replaced": 0, "rolled_forward": None}
        alive = [(m, r) for m, r in zip(members, results) if not isinstance(r, BaseException)]
        for m, r in zip(members, results):
            if isinstance(r, BaseException):  # dead or broken: the fleet replaces it on the current version
                await asyncio.wait_for(self.fleet.mark_dead.remote(
                    m.slot, m.generation, f"after a controller restart: {short_error(r)}"), timeout)
                done["replaced"] += 1
        versions = {version for (_, version) in (r for _, r in alive)}
        kept = [(m, rolled, version) for m, (rolled, version) in alive]
        if len(versions) == 1 and versions != {current} and not any(rolled for _, rolled, _ in kept):
            done["rolled_forward"] = done["version"] = next(iter(versions))  # every engine committed it
        else:
            for m, rolled, version in kept:
                done["rolled_back"] += int(rolled)
                if version == current:
                    continue
                if rolled:  # back on the previous weights: the previous label too
                    await asyncio.wait_for(m.handle.set_weight_version.remote(current), timeout)
                    done["relabelled"] += 1
                else:
                    await asyncio.wait_for(self.fleet.mark_dead.remote(
                        m.slot, m.generation, "committed a version the fleet never recorded (controller died "
                        "mid-refit)"), timeout)
                    done["replaced"] += 1
        await asyncio.gather(*[asyncio.wait_for(m.handle.resume.remote(), timeout) for m, _ in alive],
                             return_exceptions=True)
        if stats.get("refitting") or done["rolled_forward"]:
            await asyncio.wait_for(self.fleet.end_refit.remote(done["rolled_forward"]), timeout)
        self.weight_version = done["version"]
        if self.weight_version not in self._version_history:
            self._version_history.append(self.weight_version)
        return done

