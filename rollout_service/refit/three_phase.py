"""A refit's three phases over the engines and its failure path; a mixin of
:class:`~rollout_service.refit.controller.RefitController`, whose fleet, engine control, version
record and config it uses (the controller brackets the refit on the fleet around it).

Three fan-outs, one engine call each (:mod:`rollout_service.engine.refit_steps`), over the engines'
data channels or by Ray calls (:mod:`rollout_service.refit.control`), after a fourth under
``refit.staging: overlap`` (the default):

0. **stage ahead**: every engine receives the new weights in a background thread of its workers
   while it keeps generating (:meth:`ThreePhaseRefit._stage_ahead`); a failure here pauses nothing;
1. **pause** (keep: in-flight requests are frozen, none aborted), with the in-flight and aborted counts;
2. **apply**: stage the new state dict through the transfer (unless staged ahead), load it in place, label the version,
   each step under its own deadline; an engine names the step that failed;
3. **commit + resume**: release the backup of the previous weights, then resume. No engine resumes
   before every engine is loaded and labelled; from there the refit rolls forward.

The failure path: any failure before the commit — an engine dying mid-refit included — rolls every
surviving engine back as far as it got (:meth:`ThreePhaseRefit._roll_back_failed_refit`: reload the
previous weights, restore the previous label), hands an engine that cannot be restored to the fleet
to be replaced (never left paused), resumes the rest and counts the aborted requests. How long each
step may take, and so the whole refit: :mod:`rollout_service.refit.deadlines`.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Any

from rollout_service.config import RolloutServiceConfig
from rollout_service.engine.refit_steps import STEPS as APPLY_STEPS
from rollout_service.fleet.types import FleetView, Member, is_actor_dead, is_engine_death
from rollout_service.refit.deadlines import apply_deadline_s, stage_deadline_s
from rollout_service.refit.transports import bytes_of
from rollout_service.refit.types import RefitReport, short_error

logger = logging.getLogger("rollout_service.refit.controller")


class _StepFailed(Exception):
    """An engine's apply call named the step that failed and why (the message is the report's error)."""


class ThreePhaseRefit:
    config: RolloutServiceConfig

    async def _run_three_phases(self, version, transfer, clear_cache, timeout, fail_load_after_tensors,
                                view: FleetView) -> RefitReport:
        """Three fan-outs, one engine call each (rollout_service.engine.refit_steps): pause (with the
        counts), apply (stage, load, label), commit + resume, over the engines' data channels or by
        Ray calls (rollout_service.refit.control). No engine resumes before every engine is loaded
        and labelled; from there the refit rolls forward."""
        engines = view.handles()
        previous = self.weight_version
        report = RefitReport(
            version=version, previous_version=previous, transport=getattr(transfer, "kind", "?"), clear_cache=clear_cache,
            engines=[m.slot for m in view.members],
        )
        step = "pause"
        applying = False
        reached: dict[int, str | None] = {}  # slot -> the last apply step it finished (absent: unknown)
        paused: list[Any] = []
        resumed: set[int] = set()  # id() of the handles the commit phase resumed
        aborted_before: dict[int, int] = {}  # id(handle) -> its aborted count before the refit
        aborted_after: int | None = None
        await self._control.prepare(view.members, timeout)
        t_start = time.perf_counter()
        t_pause: float | None = None
        stage = transfer.engine_stage()
        staged: set[int] = set()  # slots that staged ahead (overlap): their apply only loads and labels
        token = uuid.uuid4().hex[:12]  # this refit, to the engines' background stages
        try:
            if self.config.refit.staging == "overlap":
                step = "transfer"
                staged = await self._stage_ahead(view, transfer, stage, timeout, report, token)
                step = "pause"

            async def pause(m: Member):
                # Recorded before the call: a pause that times out or fails half-way may still land,
                # and every engine asked to pause is resumed on the way out (resume is idempotent).
                paused.append(m.handle)
                counts = await self._control.call(m, "refit_pause", clear_cache)
                aborted_before[id(m.handle)] = counts["aborted"]
                return counts

            t0 = t_pause = time.perf_counter()
            counts = await asyncio.wait_for(asyncio.gather(*[pause(m) for m in view.members]), timeout)
            report.pause_s = time.perf_counter() - t0
            report.requests_in_flight = sum(c["in_flight"] for c in counts)

            step, applying = "transfer", True
            t0 = time.perf_counter()
            kwargs = {"fail_after_tensors": fail_load_after_tensors} if fail_load_after_tensors is not None else None

            def apply(m: Member):
                ahead = m.slot in staged
                return self._control.call(m, "refit_apply", None if ahead else stage, version, kwargs, timeout,
                                          ray_only=not ahead and "refs" in stage)  # refs cannot cross the channel

            applied = await asyncio.gather(
                *[asyncio.wait_for(apply(m), apply_deadline_s(timeout)) for m in view.members], return_exceptions=True)
            apply_s = time.perf_counter() - t0
            done = [a for a in applied if not isinstance(a, BaseException)]
            for m, a in zip(view.members, applied):
                if not isinstance(a, BaseException):
                    reached[m.slot] = a["reached"]
            # Nothing to undo on an engine that died: the fleet replaces it on the current version.
            await self._report_lost([(m, a) for m, a in zip(view.members, applied)
                                     if isinstance(a, BaseException) and is_engine_death(a)], timeout, report)
            inside_s = max((a["seconds"].get("transfer", 0.0) for a in done), default=0.0)  # staged in the pause
            if len(staged) < len(view.members):  # some or all staged inside the pause
                inside_bytes, inside_receive_s = bytes_of([a["stage"] for a in done])
                report.bytes = max(report.bytes, inside_bytes)
                report.worker_receive_s = max(report.worker_receive_s, inside_receive_s)
                report.transfer_s = inside_s
            report.worker_timings = [w for a in done for w in a["load"] if w]
            report.load_s = max((a["seconds"].get("load", 0.0) for a in done), default=0.0)
            label_s = max(0.0, apply_s - inside_s - report.load_s)
            failed = [a for a in applied if isinstance(a, BaseException) or not a["ok"]]
            if failed:
                first = min(failed, key=lambda a: 0 if isinstance(a, BaseException) else APPLY_STEPS.index(a["step"]))
                if isinstance(first, BaseException):
                    raise first
                step = first["step"]
                raise _StepFailed(first["error"])
            # Every engine holds the new weights under the new label: from here the refit rolls
            # forward. A commit only releases the backup; one that fails is reported, not undone.
            step = "commit"
            aborted_after = await self._commit_and_resume(view, timeout, report, resumed)
            report.resume_s += label_s
            self.weight_version = version
            self._version_history.append(version)
            report.ok = True
        except BaseException as exc:  # noqa: BLE001 - every failure must end in a consistent, resumed state
            report.failed_step = step
            report.error = str(exc) if isinstance(exc, _StepFailed) else short_error(exc)
            logger.warning("refit to %s failed at %s: %s", version, step, report.error)

            def undo(slot: int) -> tuple[bool, bool] | None:
                """(roll the load back, restore the label) for one engine, from how far it got; None:
                unknown (its apply call raised: it died, or answered nothing within every step's
                deadline and may still be loading): it must not serve again, the fleet replaces it."""
                if not applying:
                    return False, False
                if slot not in reached:  # (a dead one is in report.engines_lost, left out)
                    return None
                return reached[slot] is not None, reached[slot] in ("load", "label")

            # Before any apply, what an engine holds is this refit's stage ahead (discarded by its token, and
            # the refit fenced: a late begin of it is refused); from the apply on, whatever it staged.
            report.rolled_back = await self._roll_back_failed_refit(view, previous, undo, timeout, report,
                                                                    None if applying else token)
        finally:
            left = [e for e in paused if id(e) not in resumed]
            if left:
                await self._resume(left, timeout, report)
            report.total_s = time.perf_counter() - t_start
            report.stall_s = time.perf_counter() - t_pause if t_pause is not None else 0.0
        if aborted_after is None:  # a failure path: counted again on the engines counted before
            aborted_after = await self._sum([e for e in engines if id(e) in aborted_before], "num_aborted", timeout)
        report.requests_aborted = max(0, aborted_after - sum(aborted_before.values()))
        if report.engines_lost:
            lost = ", ".join(map(str, report.engines_lost))
            report.error = "; ".join(filter(None, [f"engine slot(s) {lost} died during the refit (the fleet replaces them)",
                                                   report.error]))
        return report

    async def _stage_ahead(self, view: FleetView, transfer, stage: dict[str, Any], timeout: float,
                           report: RefitReport, token: str) -> set[int]:
        """``refit.staging: overlap``: every engine stages the new weights while it generates
        (``refit_stage``, under one step's deadline). Returns the slots that staged; an engine
        over ``refit.staging_budget_bytes``, or whose staging copy could not be allocated, stages
        inside the pause instead (``report.staging_fallback``). A collective transfer over budget
        stages inside on every engine (every worker of the group must receive the same broadcast
        at once). Raises :class:`_StepFailed` (step ``transfer``) when any engine failed to stage:
        no engine was paused, and the failure path drops what the others staged."""
        report.staging = "overlap"
        budget = self.config.refit.staging_budget_bytes
        total = getattr(transfer, "total_bytes", None)
        if getattr(transfer, "kind", None) == "collective" and budget is not None and total is not None and total > budget:
            report.staging, report.staging_fallback = "inside", f"{total} bytes over refit.staging_budget_bytes ({budget})"
            return set()
        t0 = time.perf_counter()
        results = await asyncio.gather(
            *[asyncio.wait_for(self._control.call(m, "refit_stage", stage, timeout, budget, token,
                                                  ray_only="refs" in stage), stage_deadline_s(timeout))
              for m in view.members],
            return_exceptions=True)
        report.stage_s = time.perf_counter() - t0  # (with every engine falling back: their answers' time)
        await self._report_lost([(m, r) for m, r in zip(view.members, results)
                                 if isinstance(r, BaseException) and is_engine_death(r)], timeout, report)
        failed = [(m, r) for m, r in zip(view.members, results) if isinstance(r, BaseException) or r["error"]]
        if failed:
            m, r = failed[0]
            raise r if isinstance(r, BaseException) else _StepFailed(f"engine slot {m.slot} while staging: {r['error']}")
        staged = {m.slot for m, r in zip(view.members, results) if r["ok"]}
        fallbacks = [f"engine slot {m.slot}: {r['fallback']}" for m, r in zip(view.members, results) if r["fallback"]]
        if fallbacks:
            report.staging_fallback = "; ".join(fallbacks)[:600]
        done = [r for r in results if r["ok"]]
        report.bytes, report.worker_receive_s = bytes_of([r["stage"] for r in done])
        report.staged_bytes = report.bytes
        report.staging = "overlap" if len(staged) == len(view.members) else ("mixed" if staged else "inside")
        if report.staging == "overlap":
            report.transfer_s = report.stage_s  # (else: the transfer inside the pause, set by the apply)
        return staged

    async def _report_lost(self, lost: list[tuple[Member, BaseException]], timeout: float, report) -> None:
        """The engines that died during a phase, reported to the fleet all at once (``T`` in all:
        :func:`~rollout_service.refit.deadlines.refit_lease_s`)."""
        await asyncio.gather(*[self._lost(m, exc, timeout, report) for m, exc in lost])

    async def _lost(self, m: Member, exc: BaseException, timeout: float, report) -> None:
        """An engine died during the refit: reported (the fleet replaces it on the current version)."""
        report.engines_lost.append(m.slot)
        try:  # the fleet's monitor finds the engine anyway
            await asyncio.wait_for(self.fleet.report_failure.remote(
                m.slot, m.generation, f"{type(exc).__name__}: during a refit", is_actor_dead(exc)), timeout)
        except Exception:
            pass

    async def _commit_and_resume(self, view: FleetView, timeout, report, resumed: set[int]) -> int | None:
        """Release every engine's backup of the previous weights and resume it (one call each). Past
        the point of no return: an engine whose commit fails still serves the new weights under the
        new label (its stale backup is released by its next load); one that died is replaced by the
        fleet on the new version; one whose resume fails is resumed by the fleet
        (``fleet.resume_unbracketed_pause_s``). Returns the aborted count after, if every engine
        answered."""
        t0 = time.perf_counter()
        results = await asyncio.gather(
            *[asyncio.wait_for(self._control.call(m, "refit_commit_resume", timeout), 2 * timeout) for m in view.members],
            return_exceptions=True)
        report.resume_s = time.perf_counter() - t0
        commit_errors, resume_errors = [], []
        dead: list[tuple[Member, BaseException]] = []
        aborted = 0
        for m, r in zip(view.members, results):
            if isinstance(r, BaseException):
                if is_engine_death(r):
                    dead.append((m, r))
                else:  # stalled: neither its commit nor its resume is known; the fleet's probes decide
                    report.commit_failed.append(m.slot)
                    commit_errors.append(f"engine slot {m.slot}: {short_error(r)}")
                resumed.add(id(m.handle))  # a second resume of a dead or stalled engine would only wait
                aborted = None
                continue
            resumed.add(id(m.handle))
            if aborted is not None:
                aborted += r["aborted"]
            if r["commit_error"]:
                report.commit_failed.append(m.slot)
                commit_errors.append(f"engine slot {m.slot}: {r['commit_error']}")
            if r["resume_error"]:
                resume_errors.append(f"engine slot {m.slot}: {r['resume_error']}")
        await self._report_lost(dead, timeout, report)
        if commit_errors:
            report.error = "commit failed (rolled forward: every engine holds the new weights): " + "; ".join(commit_errors)
            logger.warning("refit to %s: %s", report.version, report.error)
        if resume_errors:
            # Not a reason to undo anything: a committed refit stays committed.
            report.error = (report.error + "; " if report.error else "") + (
                "resume failed (the fleet resumes the engine): " + "; ".join(resume_errors))[:600]
        return aborted

    async def _roll_back_failed_refit(self, view: FleetView, previous, undo, timeout, report,
                                      token: str | None = None) -> bool:
        """Back to the previous weights and label on every surviving engine, as far as each got
        (``undo(slot)``: roll the load back, restore the label). An engine that died needs nothing
        (its replacement loads the fleet's current version); one that is alive but cannot be
        restored must not serve a half-loaded model: it is handed to the fleet to be killed and
        replaced (its in-flight calls fail over), never left paused."""
        broken: list[str] = []
        unrestorable: list[Member] = []
        rolled: list[bool] = []
        lost = set(report.engines_lost)

        async def one(m: Member):
            e = m.handle
            plan = undo(m.slot)
            if plan is None:
                broken.append(f"engine slot {m.slot}: its state after the failed apply is unknown")
                unrestorable.append(m)
                return
            rollback, relabel = plan
            try:
                if rollback:
                    await asyncio.wait_for(e.collective_rpc.remote("rs_rollback", timeout=timeout), timeout)
                    rolled.append(True)
                else:  # all it staged, and refit ``token`` fenced: a late begin of its stage is refused
                    await asyncio.wait_for(e.collective_rpc.remote(
                        "rs_discard_staged", kwargs={"token": token, "fence": True} if token else None,
                        timeout=timeout), timeout)
                if relabel:
                    await asyncio.wait_for(e.set_weight_version.remote(previous), timeout)
            except Exception as exc:
                if is_engine_death(exc):
                    await self._lost(m, exc, timeout, report)
                    return
                broken.append(f"engine slot {m.slot}: {short_error(exc)}")
                unrestorable.append(m)

        async def hand_over(m: Member):
            try:
                await asyncio.wait_for(self.fleet.mark_dead.remote(
                    m.slot, m.generation, f"not restorable after a failed refit: {report.error}"), timeout)
            except Exception as exc:  # the fleet's probes find it (it stays paused, never resumed here)
                logger.warning("could not hand engine slot %d to the fleet: %s", m.slot, short_error(exc))

        await asyncio.gather(*[one(m) for m in view.members if m.slot not in lost])
        await asyncio.gather(*[hand_over(m) for m in unrestorable])  # all at once: T in all
        self._unrestorable = [m.handle for m in unrestorable]
        if broken:
            report.error = f"{report.error}; rollback failed, replaced by the fleet: {'; '.join(broken)}"
        return bool(rolled) and not broken

    async def _resume(self, paused, timeout, report) -> None:
        keep_paused = set(map(id, getattr(self, "_unrestorable", [])))
        self._unrestorable = []
        t0 = time.perf_counter()
        results = await asyncio.gather(
            *[asyncio.wait_for(e.resume.remote(), timeout) for e in paused if id(e) not in keep_paused],
            return_exceptions=True,
        )
        errors = [f"{type(r).__name__}: {r}" for r in results if isinstance(r, BaseException) and not is_engine_death(r)]
        if errors:
            # Not a reason to undo anything: a committed refit stays committed (the fleet resumes an
            # engine left paused outside a refit after fleet.resume_unbracketed_pause_s).
            report.error = (report.error + "; " if report.error else "") + (
                "resume failed (the fleet resumes the engine): " + "; ".join(errors))[:600]
        report.resume_s += time.perf_counter() - t0

    @staticmethod
    async def _sum(engines, method: str, timeout: float) -> int:
        """Sum over the engines that answer within ``timeout`` (a dead or stalled one counts 0: the
        refit notices it elsewhere)."""
        values = await asyncio.gather(*[asyncio.wait_for(getattr(e, method).remote(), timeout) for e in engines],
                                      return_exceptions=True)
        return int(sum(v for v in values if isinstance(v, int)))
