"""A refit's engine side in three calls, one per phase, instead of one call per step.

The refit controller fans out to every engine once per phase: ``refit_pause`` (the in-flight and
aborted counts, then pause in keep mode), ``refit_apply`` (stage, load, label: each with its own
deadline, stopped at the first step that fails, which it names), ``refit_commit_resume`` (release
the backup, then resume; the aborted count after). Each phase is what the step-by-step calls did,
in the same order on this engine and through the same methods (so a fault injected into one of
them lands in the same place); what changes is the number of Ray calls per refit, which is what a
refit's stall grows with on a fleet of many engines (docs/scale.md). The step-by-step methods stay:
a replacement's load, the NCCL round and a restarted controller's recovery use them. The three
phases are reached by Ray calls or over the engine's data channel (:meth:`RefitSteps.refit_control`):
the same methods either way.

A mixin of both engine actors (:class:`~rollout_service.engine.replica.EngineReplica` and
:class:`~rollout_service.engine.simulated.SimulatedEngine`), whose ``pause``, ``resume``,
``collective_rpc``, ``stage_weights_from_object_store``, ``object_store_stage``,
``release_object_store_stage``, ``set_weight_version``, ``num_in_flight`` and ``num_aborted`` it calls.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from rollout_service.weights.staging import host_deadline

STEPS = ("transfer", "load", "label")  # refit_apply's steps, in order (the names a refit report uses)
STAGE_COLLECTIVE = "rs_stage_collective"  # the worker methods that stage a refit's weights
STAGE_PATH = "rs_stage_path"
STAGE_POLL_S = 0.02  # how often refit_stage asks the workers whether a background stage is done


def step_error(exc: BaseException) -> str:
    """One line naming the error (a step's deadline: ``TimeoutError: step timed out``)."""
    cause = getattr(exc, "cause", None) or exc
    if isinstance(exc, asyncio.TimeoutError) or isinstance(cause, asyncio.TimeoutError):
        return "TimeoutError: step timed out"
    lines = [ln.strip() for ln in str(cause).splitlines() if ln.strip()]
    return f"{type(cause).__name__}: {lines[-1] if lines else ''}"[:500]


class RefitSteps:
    def refit_control(self) -> dict[str, Any]:
        """The three phases by name: what the engine's data channel serves as control calls, so a
        refit controller can reach them without a Ray call per engine (``refit.control: channel``).
        Over the channel a stage may only name the staging methods (``refit_apply`` runs any worker
        method a stage names: a Ray handle's holder may, a channel token's holder may not)."""

        def check(stage: Any) -> None:
            if not isinstance(stage, dict) or set(stage) - {"rpc", "args"} or stage.get("rpc") not in (STAGE_PATH,
                                                                                                     STAGE_COLLECTIVE):
                raise ValueError("a refit over the channel stages only through "
                                 f"{STAGE_PATH} or {STAGE_COLLECTIVE}, got {str(stage)[:120]}")

        async def apply_staged(stage: dict[str, Any] | None, *args: Any) -> dict[str, Any]:
            if stage is not None:  # None: staged already (refit_stage)
                check(stage)
            return await self.refit_apply(stage, *args)

        async def stage_ahead(stage: dict[str, Any], *args: Any) -> dict[str, Any]:
            check(stage)
            return await self.refit_stage(stage, *args)

        async def ready() -> bool:
            return True

        return {"refit_ready": ready, "refit_stage": stage_ahead, "refit_pause": self.refit_pause,
                "refit_apply": apply_staged, "refit_commit_resume": self.refit_commit_resume}

    async def refit_stage(self, stage: dict[str, Any], timeout: float, budget_bytes: int | None = None,
                          token: str | None = None, poll_interval_s: float = STAGE_POLL_S) -> dict[str, Any]:
        """Stage the new weights of refit ``token`` while this engine keeps generating
        (``refit.staging: overlap``): the workers receive them in a background thread
        (``rs_stage_begin``), polled between the engine's steps until done; all of it within
        ``timeout`` (a begin that reaches the workers later is refused there, so a stage the
        controller gave up on never starts behind its back). Returns ``ok``, the workers' stage
        results, its seconds, and ``fallback`` (why this engine stages inside the pause instead:
        over ``budget_bytes``, or memory ran out) or ``error`` (nothing staged; a stage still
        running is abandoned). Never raises but for the engine's own death."""
        out: dict[str, Any] = {"ok": False, "fallback": None, "error": None, "stage": [], "bytes": 0, "seconds": 0.0}
        t0 = time.perf_counter()
        deadline = time.monotonic() + timeout

        def left() -> float:
            return max(0.001, deadline - time.monotonic())

        method = None
        try:
            if "refs" in stage:
                method, args = await asyncio.wait_for(self.object_store_stage(list(stage["refs"])), left())
            else:
                method, args = stage["rpc"], list(stage.get("args") or ())
            began = await asyncio.wait_for(self.collective_rpc(
                "rs_stage_begin", args=(method, args, budget_bytes, token, host_deadline(left())), timeout=left()), left())
            out["bytes"] = max((b.get("bytes", 0) for b in began), default=0)
            # One worker that cannot is enough: the engine stages inside (what the others began is
            # discarded below).
            fallback = next((b["fallback"] for b in began if not b["started"]), None)
            while fallback is None:
                polls = await asyncio.wait_for(
                    self.collective_rpc("rs_stage_poll", args=(token,), timeout=left()), left())
                if all(p["done"] for p in polls):
                    fallback = next((p["fallback"] for p in polls if p.get("fallback")), None)
                    if fallback is None:
                        out["stage"], out["ok"] = polls, True
                    break
                if time.monotonic() > deadline:
                    raise asyncio.TimeoutError()
                await asyncio.sleep(poll_interval_s)
            if fallback is not None:
                out["fallback"] = fallback
        except Exception as exc:  # noqa: BLE001 - named and returned: the controller ends the refit
            out["error"] = step_error(exc)
        finally:
            if not out["ok"]:  # nothing half-staged of this refit stays behind (nor a thread's late result)
                try:
                    await asyncio.wait_for(self.collective_rpc("rs_discard_staged", kwargs={"token": token},
                                                               timeout=timeout), timeout)
                except Exception:  # noqa: BLE001 - the next refit's stage discards it too
                    pass
            if method is not None and "refs" in stage:
                self.release_object_store_stage(method, args)
            out["seconds"] = time.perf_counter() - t0
        return out

    async def refit_pause(self, clear_cache: bool = False) -> dict[str, Any]:
        """The counts a refit report carries (taken before the pause), then pause in keep mode."""
        in_flight, aborted = self.num_in_flight(), self.num_aborted()
        seconds = await self.pause(mode="keep", clear_cache=clear_cache)
        return {"in_flight": in_flight, "aborted": aborted, "seconds": seconds}

    async def refit_apply(self, stage: dict[str, Any], version: str, load_kwargs: dict | None,
                          timeout: float) -> dict[str, Any]:
        """Stage the new weights (``stage``: ``{"rpc": worker method, "args": [...]}`` or
        ``{"refs": [state dict ref]}``; None: staged already by :meth:`refit_stage`), load them,
        label them ``version``. Returns ``ok``, the
        step reached (``reached``: the last that finished, None if none), on failure the step and
        its error, the stage's and the load's worker results, and each step's seconds. A step's
        failure (its deadline ``timeout`` included) is returned, not raised: the controller rolls
        back exactly what each engine did. An engine that does not answer within the sum of the
        steps' deadlines is in an unknown state: the controller has the fleet replace it."""
        out: dict[str, Any] = {"ok": False, "reached": None, "step": None, "error": None, "stage": [], "load": [],
                               "seconds": {}}
        step = STEPS[0]
        try:
            t0 = time.perf_counter()
            if stage is None:  # staged while generating (refit_stage): the load is the first step
                out["reached"], step = "transfer", "load"
            elif "refs" in stage:
                staging = self.stage_weights_from_object_store(list(stage["refs"]), timeout)
            else:
                staging = self.collective_rpc(stage["rpc"], args=tuple(stage.get("args") or ()), timeout=timeout)
            if stage is not None:
                out["stage"] = await asyncio.wait_for(staging, timeout)
                out["seconds"]["transfer"], out["reached"], step = time.perf_counter() - t0, "transfer", "load"
            t0 = time.perf_counter()
            out["load"] = await asyncio.wait_for(
                self.collective_rpc("rs_load_staged", kwargs=load_kwargs, timeout=timeout), timeout)
            out["seconds"]["load"], out["reached"], step = time.perf_counter() - t0, "load", "label"
            t0 = time.perf_counter()
            await asyncio.wait_for(self.set_weight_version(version), timeout)
            out["seconds"]["label"], out["reached"] = time.perf_counter() - t0, "label"
            out["ok"] = True
        except Exception as exc:  # noqa: BLE001 - named and returned: the controller's failure path decides
            out["step"], out["error"] = step, step_error(exc)
        return out

    async def refit_commit_resume(self, timeout: float) -> dict[str, Any]:
        """Release the previous weights' backup, then resume (always, also after a failed commit:
        past the label a refit rolls forward). Returns the errors of either and the aborted count."""
        out: dict[str, Any] = {"commit_error": None, "resume_error": None}
        try:
            await self.collective_rpc("rs_commit", timeout=timeout)
        except Exception as exc:  # noqa: BLE001 - reported; the engine serves the new weights either way
            out["commit_error"] = step_error(exc)
        t0 = time.perf_counter()
        try:
            await asyncio.wait_for(self.resume(), timeout)
        except Exception as exc:  # noqa: BLE001 - reported; the fleet resumes an engine left paused
            out["resume_error"] = step_error(exc)
        out["resume_s"] = time.perf_counter() - t0
        out["aborted"] = self.num_aborted()
        return out
