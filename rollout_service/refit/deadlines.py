"""How long a refit may take: the deadline of an engine's apply call, and the bound of a whole refit
that both sides use — the refit controller as the lease of its bracket on the fleet
(``begin_refit``), the trainer's client as how long it waits for the controller's answer. Plain
Python: the trainer imports it without vLLM or Ray.

Every step of a refit (:mod:`rollout_service.refit.three_phase`) runs under the step timeout ``T``
(``refit.step_timeout_s``, or the trainer's ``timeout_s``), the apply call under the sum of its
three steps' deadlines plus a margin.
"""

from __future__ import annotations

from rollout_service.engine.refit_steps import STEPS as APPLY_STEPS

APPLY_MARGIN_S = 5.0  # past the sum of an apply's step deadlines, for the call itself
SLACK_S = 25.0  # the controller's own work between its calls, its pauses between attempts to end the bracket


def apply_deadline_s(step_timeout_s: float) -> float:
    """An engine's apply call: stage, load and label, each under the step timeout, plus a margin."""
    return len(APPLY_STEPS) * step_timeout_s + APPLY_MARGIN_S


def stage_deadline_s(step_timeout_s: float) -> float:
    """An engine's stage ahead of the pause (``refit.staging: overlap``): one step, plus a margin."""
    return step_timeout_s + APPLY_MARGIN_S


def refit_lease_s(step_timeout_s: float) -> float:
    """The longest a refit's bracket can stay open with its controller alive: the lease the controller
    asks of the fleet (a bracket still open after it was left by a dead controller; the fleet ends
    it), **16 T + 35 s**. The steps, in the order they run, each fan-out concurrent over the
    engines, each wait under its deadline (``T``: the step timeout):

    - the control connections checked (``min(T, 10 s)``, counted ``T``);
    - the stage ahead of the pause (``refit.staging: overlap``), ``T + 5 s``
      (:func:`stage_deadline_s`), then the reports to the fleet of the engines it found dead, ``T``;
    - the pause ``T``;
    - the apply, ``3 T + 5 s`` (:func:`apply_deadline_s`), then the reports to the fleet of the
      engines it found dead, ``T``;
    - the failure path (a step failed, an engine died or did not answer): the roll-back and the
      relabel ``2 T``, an engine's death in them reported ``T``, the engines that cannot be restored
      handed to the fleet ``T``, the resume ``T``, the aborted requests counted ``T``: ``6 T``. The
      path past the commit is shorter: commit and resume ``2 T``, the deaths in it reported ``T``,
      the counts ``T`` (``4 T``);
    - the end of the bracket delivered to the fleet (asked again while it restarts, for ``T``; the
      last attempt under ``T``): ``2 T``;
    - 25 s of slack for the controller's own work between calls.

    ``2 T + (2 T + 5 s) + (4 T + 5 s) + 6 T + 2 T + 25 s`` = ``16 T + 35 s``."""
    t = step_timeout_s
    before_apply = t + (stage_deadline_s(t) + t) + t
    apply = apply_deadline_s(t) + t
    after_apply = max(2 * t + t + t + t + t,  # the failure path
                      2 * t + t + t)  # past the commit
    end_of_bracket = 2 * t
    return before_apply + apply + after_apply + end_of_bracket + SLACK_S


def trainer_wait_s(step_timeout_s: float) -> float:
    """How long the trainer's client waits for the controller's refit call (and for the engine
    workers to join its broadcast): the bracket's lease (:func:`refit_lease_s`) plus ``T`` for the
    call's set-up before the bracket opens (the controller's look at the fleet, under ``T``), so the
    client never gives up on a refit the controller is still entitled to finish."""
    return refit_lease_s(step_timeout_s) + step_timeout_s
