"""What a refit returns or raises. Plain Python: the trainer imports these without vLLM or Ray."""

from __future__ import annotations

import asyncio

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class RefitReport:
    """One refit, as the trainer sees it. Seconds are wall time of each step over all engines."""

    version: str
    previous_version: str
    transport: str
    ok: bool = False
    bytes: int = 0  # bytes of the state dict each engine received
    num_tensors: int | None = None
    staging: str = "inside"  # overlap: staged while the engines generated; inside: within the pause; mixed
    staging_fallback: str | None = None  # why an engine staged inside when overlap was configured
    staged_bytes: int = 0  # bytes of new weights each engine held staged beside the serving ones (overlap)
    stage_s: float = 0.0  # overlap: staging in every engine while they generate (outside the stall)
    pause_s: float = 0.0  # pause(keep) on every engine
    transfer_s: float = 0.0  # stage the new state dict in every worker (model untouched): inside the pause, or = stage_s (overlap)
    worker_receive_s: float = 0.0  # of which: the slowest worker's own receive / read
    trainer_send_s: float | None = None  # collective: trainer's handshake done -> END sent (the bytes' time on the wire)
    load_s: float = 0.0  # in-place reload_weights in every worker
    resume_s: float = 0.0  # label + commit + resume
    stall_s: float = 0.0  # pause start -> resume done (the engines' stall)
    total_s: float = 0.0  # the whole refit: first stage (overlap) or pause (inside) -> resume done
    clear_cache: bool = False
    requests_in_flight: int = 0  # requests frozen by the pause and kept (mode="keep")
    requests_aborted: int = 0  # must be 0
    error: str | None = None
    failed_step: str | None = None
    rolled_back: bool = False
    worker_timings: list[dict[str, Any]] = field(default_factory=list)
    engines: list[int] = field(default_factory=list)  # fleet slots of the engines the refit ran over
    engines_lost: list[int] = field(default_factory=list)  # of which: died during the refit
    commit_failed: list[int] = field(default_factory=list)  # loaded + labelled, backup not released: rolled forward

    @property
    def transfer_gbps(self) -> float:
        return self.bytes / self.transfer_s / 1e9 if self.transfer_s > 0 else float("nan")

    @property
    def control_s(self) -> float:
        """The stall less the weights' own time inside it (transfer if inside, load): the control
        fan-out's cost."""
        inside = 0.0 if self.staging == "overlap" else self.transfer_s
        return max(0.0, self.stall_s - inside - self.load_s)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "control_s": self.control_s}


class RefitInProgress(RuntimeError):
    """A refit is already running on this service; refits are never interleaved."""


class RefitFailed(RuntimeError):
    """The refit did not happen. Every engine was resumed on the previous weights and version.

    ``report`` (a dict, see :class:`RefitReport`) says which step failed and how long each took.
    """

    def __init__(self, message: str, report: dict[str, Any] | None = None):
        super().__init__(message, report)
        self.report = report or {}

    def __str__(self) -> str:
        return str(self.args[0])


class WeightSyncNotInitialized(RuntimeError):
    """The collective transport needs ``init_weight_sync`` first (or again, after a broken group, or
    after the fleet's serving engines changed: messages starting with :data:`MEMBERSHIP_CHANGED`)."""


MEMBERSHIP_CHANGED = "the serving engines changed since init_weight_sync"
GROUP_UNKNOWN = "collective transfer needs init_weight_sync first"  # the controller holds no group (e.g. restarted)


def short_error(exc: BaseException) -> str:
    """One line: the root cause's type and message, without Ray's remote traceback."""
    cause = getattr(exc, "cause", None) or exc
    lines = [ln.strip() for ln in str(cause).splitlines() if ln.strip()]
    if isinstance(exc, asyncio.TimeoutError) or isinstance(cause, asyncio.TimeoutError):
        return "TimeoutError: step timed out"
    return f"{type(cause).__name__}: {lines[-1] if lines else ''}"[:500]
