"""The service's metrics, exported through Ray's metrics pipeline.

Every process records into ``ray.util.metrics`` objects; Ray's per-node metrics agent serves them
as Prometheus text on the node's metrics export port (``rollout-service up --metrics-port``,
default :data:`DEFAULT_METRICS_PORT`; KubeRay: container port ``metrics``, 8080), next to Ray's,
Serve's and vLLM's own (the engines export vLLM's metrics through its Ray stat logger). Ray's
exporter puts its namespace in front of every name: ``rollout_service_requests_total`` is scraped as
``ray_rollout_service_requests_total`` (Serve's are ``ray_serve_*``, vLLM's ``ray_vllm_*``), and it
adds ``WorkerId``, ``NodeAddress`` and ``SessionName`` labels: sum over them.

What each metric means is in :data:`METRICS` (one definition each, read by the docs and the
dashboard tests). The recording side is :class:`ServiceMetrics`, one per process, created lazily
by :func:`get_metrics` on first use, with one method per call site. The data plane records per
HTTP request and per turn, the fleet engine states, replacements and the weight version, the
refit controller each refit's outcome, phases and bytes.

Why the methods look the way they do:

- Per-record cost: building and validating a tag dict is most of what a ``ray.util.metrics``
  record costs, so each label combination is bound once (:class:`_Series`) and later records hand
  the cached dict straight to Ray's recorder. A request costs a few microseconds (see
  docs/observability.md for the measurement).
- Gauges: Ray exports a gauge's value only in the reporting interval it was set in, and its agent
  drops a series not re-reported within two intervals (``metrics_report_interval_ms``, 10 s by
  default). So gauges are kept (:data:`KEPT_GAUGES`) and re-set every :func:`gauge_refresh_s`, half
  an interval, by one daemon thread per process; a series that should vanish (the previous weight
  version of the info-style ``weight_version`` gauge) is simply no longer re-set and ages out.
  vLLM's own gauges (requests running and waiting, KV cache use) are kept the same way
  (:func:`kept_ray_stat_logger`): vLLM sets them only when the engine steps, so an idle engine's
  gauges would vanish from the endpoint instead of reading 0.
- Importable without vLLM (and without Ray: outside a Ray worker every method is a no-op).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Iterable

NAME_PREFIX = "rollout_service_"
EXPORT_PREFIX = "ray_"  # Ray's Prometheus exporter prefixes every application metric with its namespace
DEFAULT_METRICS_PORT = 9464  # `up` default: not Serve's 8000, Redis' 6379, Ray's 6379/8265/10001, KubeRay's 8080
ACTIVE_WINDOW_S = 300.0  # a rollout is active while its last call began less than this long ago

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
STORE_BUCKETS = (0.0002, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0)
REFIT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 900.0)
# Ray wants positive bucket bounds; lags are integers, so le="0.5" counts the calls generated on one version.
LAG_BUCKETS = (0.5, 1.5, 2.5, 3.5, 5.5, 10.5)
ABS_DIFF_BUCKETS = (1e-7, 1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 0.1, 1.0, 10.0)
MULT_PROB_BUCKETS = (1.00001, 1.0001, 1.001, 1.01, 1.1, 2.0, 10.0)

TURN_KINDS = ("monotonic", "fork", "reject", "replay")
CALL_MODES = ("stateful", "stateless", "completion")
# HistoryConflict.field values (onpolicy.messages.first_difference, onpolicy.turn); anything else -> "other".
FORK_REASONS = ("role", "content", "reasoning_content", "tool_calls", "tool_call_id", "missing", "new_messages",
                "tools", "echo", "other")
ENGINE_STATES = ("starting", "healthy", "suspect", "dead", "replacing", "stale", "retired", "draining")  # fleet.health.EngineState
REFIT_OUTCOMES = ("ok", "failed", "rejected")
REFIT_PHASES = ("pause", "transfer", "load", "resume")
STORE_OPS = ("load", "append", "read", "delete", "mark", "group")
REFUSAL_REASONS = ("aborted", "stale")


@dataclass(frozen=True)
class MetricDef:
    name: str
    kind: str  # counter | histogram | gauge
    description: str
    tags: tuple[str, ...] = ()
    buckets: tuple[float, ...] | None = None
    source: str = "data plane"  # which process records it: data plane | fleet | controller

    @property
    def exported(self) -> str:
        """The name on the metrics endpoint."""
        return EXPORT_PREFIX + self.name

    def exported_series(self) -> tuple[str, ...]:
        """Every series name this metric appears under when scraped."""
        if self.kind == "histogram":
            return tuple(f"{self.exported}_{s}" for s in ("bucket", "count", "sum"))
        return (self.exported,)


def _m(name: str, kind: str, description: str, tags: tuple[str, ...] = (), buckets=None, source="data plane"):
    return MetricDef(NAME_PREFIX + name, kind, description, tags, buckets, source)


METRICS: tuple[MetricDef, ...] = (
    # ---- data plane: per HTTP request (RolloutService, the replica that received it)
    _m("requests_total", "counter", "HTTP requests by route (path template) and status code.", ("route", "status")),
    _m("request_latency_seconds", "histogram", "HTTP request latency by route: the request reaching the replica to "
       "its last response byte sent (streams included).", ("route",), LATENCY_BUCKETS),
    _m("time_to_first_token_seconds", "histogram", "Streaming calls: the request reaching the replica to its first "
       "generated token there (non-streaming calls get their tokens at the end: see request latency).", ("route",),
       TTFT_BUCKETS),
    _m("prompt_tokens_total", "counter", "Prompt tokens of the calls answered by generation (replays excluded).",
       ("route",)),
    _m("generated_tokens_total", "counter", "Tokens generated for the calls answered (replays excluded).", ("route",)),
    _m("version_lag", "histogram", "Per call answered by generation: weight versions its generated tokens span "
       "minus one, i.e. the refits that landed while it was generating (0: on-policy, le=\"0.5\").", (), LAG_BUCKETS),
    # ---- data plane: per turn (TurnRunner, the replica owning the rollout)
    _m("turns_total", "counter", "Model calls by kind: monotonic (extends its segment, or starts a rollout), fork "
       "(edited history: a new segment), reject (edited history refused, 409), replay (a retry answered from the "
       "store).", ("kind",)),
    _m("forks_total", "counter", "Forked turns by reason: the first differing field of the history "
       "(HistoryConflict.field: role, content, tool_calls, missing, tools, echo, ...).", ("reason",)),
    _m("calls_total", "counter", "Calls taken by the turn runner: stateful (X-Rollout-Id), stateless (echo "
       "protocol), completion (raw /v1/completions).", ("mode",)),
    _m("calls_in_flight", "gauge", "Calls running now, per replica process; stateful calls in flight = rollouts "
       "generating now (a rollout runs one call at a time).", ("mode",)),
    _m("active_rollouts", "gauge", "Rollouts with a call in the last 300 s (ACTIVE_WINDOW_S), per replica process: "
       "live rollouts, also those between calls (waiting on a tool or an environment step). Sum over replicas "
       "(a rollout is routed to one; after a replica change it may count on two for one window).", ()),
    _m("rollout_version_lag", "histogram", "Per call of a stored rollout, at its admission (refused ones included): refits between the "
       "version of the rollout's oldest generated token and the version served now (the staleness bound's measure; "
       "a version older than the fleet remembers counts as the number it remembers).", (), LAG_BUCKETS),
    _m("turns_refused_total", "counter", "Calls of a rollout refused at admission, nothing generated or stored, by "
       "reason: aborted (409 rollout_aborted), stale (409 rollout_stale: past the staleness bound).", ("reason",)),
    _m("store_latency_seconds", "histogram", "Rollout store operations as the data plane sees them (the replica's "
       "state cache included): load, append, read (GET rollout), delete, replicate (a replayed answer waiting for the replicas under store.durability replicated).", ("op",), STORE_BUCKETS),
    _m("store_errors_total", "counter", "Failed rollout store operations by op and error type (StoreUnavailable, "
       "StoreFull, TurnConflict, ...).", ("op", "error")),
    # ---- engine fleet
    _m("engines", "gauge", "Engine slots by health state (fleet.health.EngineState); healthy + suspect serve. "
       "`fleet` names the fleet actor (`<instance_name>-fleet`), so two services in one cluster stay apart.",
       ("fleet", "state"), source="fleet"),
    _m("engine_replacements_total", "counter", "Engine replacements the fleet started (dead or hung engines).",
       ("fleet",), source="fleet"),
    _m("engine_pin_moves_total", "counter", "Rollouts moved off a live engine by routing.policy "
       "sticky_least_loaded (its engine was more than routing.load_margin requests above the least loaded).", ()),
    _m("turn_migrations_total", "counter", "Calls whose engine died mid-generation, by outcome: continued "
       "(on another engine, from the ids generated so far) or refused (a grammar or presence / frequency "
       "penalties: answered 503 engine_lost).", ("outcome",)),
    _m("engine_call_deadlines_total", "counter", "Generations aborted at their deadline (fleet.call_deadline_s + "
       "fleet.call_deadline_s_per_token x max_tokens) and answered 504 engine_deadline.", ()),
    _m("weight_version", "gauge", "Info-style: 1 with the weight version the fleet serves as label `version`.",
       ("fleet", "version"), source="fleet"),
    # ---- parity canary (rollout_service/canary: the replica that finished the generation)
    _m("canary_checked_total", "counter", "Generations the parity canary re-scored and compared, by the engine slot "
       "that sampled them (`engine`).", ("engine",)),
    _m("canary_skipped_total", "counter", "Generations drawn by the canary but not compared, by reason "
       "(canary.recompute.SKIP_REASONS: version_moved, penalties, queue_full, ...).", ("reason",)),
    _m("canary_abs_diff", "histogram", "|sampled logprob - teacher-forced recompute| per compared token, by the "
       "engine slot that sampled it.", ("engine",), ABS_DIFF_BUCKETS),
    _m("canary_tokens_total", "counter", "Tokens the canary compared, by engine slot.", ("engine",)),
    _m("canary_tokens_above_threshold_total", "counter", "Compared tokens with |logprob difference| above canary.threshold, "
       "by engine slot (the alert rule reads their share of canary_tokens_total).", ("engine",)),
    _m("canary_token_mult_prob_error", "histogram", "Per compared generation: the mean over its tokens of "
       "exp(|logprob difference|) (NeMo RL's token_mult_prob_error; 1 = exact), by engine slot.", ("engine",),
       MULT_PROB_BUCKETS),
    _m("canary_max_abs_diff", "gauge", "Largest |logprob difference| of the generations of an engine slot the canary "
       "checked in the last 5 minutes, per replica process (take the max over replicas; NaN: none checked).",
       ("engine",)),
    _m("canary_mean_abs_diff", "gauge", "Mean |logprob difference| over the tokens of an engine slot the canary "
       "compared in the last 5 minutes, per replica process (NaN: none).", ("engine",)),
    # ---- refit controller
    _m("refits_total", "counter", "Refits by outcome: ok, failed (rolled back, engines resumed on the previous "
       "version), rejected (another refit running, or a version label already used).", ("outcome",),
       source="controller"),
    _m("refit_phase_seconds", "histogram", "Refit phases from the refit report: pause, transfer (stage the new "
       "weights), load (in place), resume (label + commit + resume).", ("phase",), REFIT_BUCKETS,
       source="controller"),
    _m("refit_stall_seconds", "histogram", "A refit's whole stall: pause start to resume done.", (), REFIT_BUCKETS,
       source="controller"),
    _m("refit_bytes_total", "counter", "Bytes of weights each engine received, summed over refits.",
       source="controller"),
)

BY_NAME = {m.name: m for m in METRICS}


# ----------------------------------------------------------------------------------- recording
def gauge_refresh_s() -> float:
    """How often a kept gauge is re-set: half of Ray's metrics export interval in this process
    (Ray floors the interval at 1 s), so a live gauge is in every export and never ages out."""
    try:
        import ray

        ms = int(ray._config.metrics_report_interval_ms())
    except Exception:  # outside Ray, or another Ray: its documented environment knob
        ms = int(os.environ.get("RAY_metrics_report_interval_ms", "10000"))
    return max(ms, 1000) / 2000


class KeptGauges:
    """This process's live gauge series, re-set by one daemon thread every :func:`gauge_refresh_s`.
    ``keep(key, record, value)``: ``record(value)`` is called at every refresh, ``value`` may be a
    callable read then. ``drop(key)``: no longer re-set (Ray's agent ages the series out)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._kept: dict[Any, tuple[Any, Any]] = {}
        self._thread: threading.Thread | None = None

    def __contains__(self, key) -> bool:
        return key in self._kept

    def keep(self, key, record, value) -> None:
        if key in self._kept:
            self._kept[key] = (record, value)  # one dict store: vLLM's gauges land here every engine step
            return
        with self._lock:
            self._kept[key] = (record, value)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="rollout-service-gauges", daemon=True)
                self._thread.start()

    def drop(self, key) -> None:
        with self._lock:
            self._kept.pop(key, None)

    def _run(self) -> None:
        period = gauge_refresh_s()
        while True:
            time.sleep(period)
            with self._lock:
                current = list(self._kept.values())
            for record, value in current:
                try:
                    record(value() if callable(value) else value)
                except Exception:  # never let metrics take a process down
                    pass


KEPT_GAUGES = KeptGauges()


def kept_ray_stat_logger():
    """vLLM's Ray stat logger (``ray_vllm_*``) whose gauges stay reported while the engine idles:
    each gauge's last value is re-set with this process's own (:data:`KEPT_GAUGES`), as vLLM's own
    Prometheus registry keeps serving a gauge's last value. ImportError without vLLM."""
    from vllm.v1.metrics.ray_wrappers import RayGaugeWrapper, RayPrometheusStatLogger

    class KeptRayGauge(RayGaugeWrapper):
        _kept = None  # (the tags it was made for, key, record): built once per labelled series

        def set(self, value):
            metric, tags, kept = self.metric, self._tags, self._kept
            metric.set(value, tags=tags)
            if kept is None or kept[0] is not tags:  # labels() copies the object, with its _kept
                kept = self._kept = (tags, (id(metric), *tags.values()), lambda v: metric.set(v, tags=tags))
            KEPT_GAUGES.keep(kept[1], kept[2], value)

    class KeptRayPrometheusStatLogger(RayPrometheusStatLogger):
        _gauge_cls = KeptRayGauge

    return KeptRayPrometheusStatLogger


class _Series:
    """One metric with one label set, bound once: later records skip Ray's tag merge and checks."""

    __slots__ = ("record",)

    def __init__(self, metric, tags: dict[str, str]):
        raw = getattr(metric, "_metric", None)  # Ray's Cython recorder (ray.util.metrics.Metric internals)
        if raw is not None and hasattr(raw, "record") and not getattr(metric, "_default_tags", None):
            metric._validate_tags(tags)
            self.record = lambda value, _r=raw.record, _t=tags: _r(value, tags=_t)
        else:  # another Ray version: the public path
            method = getattr(metric, "inc", None) or getattr(metric, "observe", None) or metric.set
            self.record = lambda value, _m=method, _t=tags: _m(value, tags=_t)


class _NoSeries:
    __slots__ = ()

    @staticmethod
    def record(value) -> None:
        pass


_NO_SERIES = _NoSeries()


class ServiceMetrics:
    """One process's metrics; one method per call site. ``enabled=False``: every method is a no-op."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self._metrics: dict[str, Any] = {}
        self._series: dict[tuple, Any] = {}
        self._lock = threading.Lock()
        self._in_flight = dict.fromkeys(CALL_MODES, 0)
        self._seen: dict[str, float] = {}  # rollout id -> monotonic time of its last call (active_rollouts)
        self._version: dict[str, str] = {}  # fleet -> the version it reports
        if enabled:
            from ray.util import metrics as rm

            for d in METRICS:
                if d.kind == "counter":
                    self._metrics[d.name] = rm.Counter(d.name, d.description, tag_keys=d.tags)
                elif d.kind == "histogram":
                    self._metrics[d.name] = rm.Histogram(d.name, d.description, list(d.buckets), tag_keys=d.tags)
                else:
                    self._metrics[d.name] = rm.Gauge(d.name, d.description, tag_keys=d.tags)

    def series(self, name: str, *labels: str):
        """The bound series of ``name`` with ``labels`` (in the order of its tags)."""
        key = (name, *labels)
        s = self._series.get(key)
        if s is None:
            if not self.enabled:
                return _NO_SERIES
            d = BY_NAME[name]
            with self._lock:
                s = self._series.get(key) or _Series(self._metrics[name], dict(zip(d.tags, labels)))
                self._series[key] = s
        return s

    def _gauge(self, name: str, value, *labels: str) -> None:
        """Set a gauge and keep it reported; ``value`` may be a callable read at every refresh."""
        if not self.enabled:
            return
        s = self.series(name, *labels)
        s.record(value() if callable(value) else value)
        KEPT_GAUGES.keep((name, *labels), s.record, value)

    def _drop_gauge(self, name: str, *labels: str) -> None:
        KEPT_GAUGES.drop((name, *labels))

    # ------------------------------------------------------------ data plane: HTTP requests
    def request(self, route: str, status: int, seconds: float, obs: "RequestObservation | None" = None) -> None:
        """One HTTP request answered (``obs``: what the call generated, if it generated)."""
        if not self.enabled:
            return
        self.series("rollout_service_requests_total", route, str(status)).record(1)
        self.series("rollout_service_request_latency_seconds", route).record(seconds)
        if obs is None or obs.generated is None or obs.replayed:
            return
        if obs.first_token_s is not None:
            self.series("rollout_service_time_to_first_token_seconds", route).record(obs.first_token_s)
        if obs.prompt_tokens > 0:
            self.series("rollout_service_prompt_tokens_total", route).record(obs.prompt_tokens)
        if obs.generated > 0:
            self.series("rollout_service_generated_tokens_total", route).record(obs.generated)
        self.series("rollout_service_version_lag").record(obs.version_lag)

    # ------------------------------------------------------------ data plane: turns
    def call_started(self, mode: str) -> None:
        """A call begins. The in-flight gauge is not recorded per call: Ray reports a gauge once per
        interval anyway, so the refresher reads the count (up to gauge_refresh_s() old)."""
        if self.enabled:
            self.series("rollout_service_calls_total", mode).record(1)
            self._in_flight[mode] += 1
            if ("rollout_service_calls_in_flight", mode) not in KEPT_GAUGES:
                self._gauge("rollout_service_calls_in_flight", lambda: self._in_flight[mode], mode)

    def rollout_seen(self, rollout_id: str) -> None:
        """A call of a stateful rollout began: it counts as active for ACTIVE_WINDOW_S. One dict write per
        call; the refresher thread counts and forgets the expired ones."""
        if self.enabled:
            self._seen[rollout_id] = time.monotonic()
            if ("rollout_service_active_rollouts",) not in KEPT_GAUGES:
                self._gauge("rollout_service_active_rollouts", self._active_rollouts)

    def _active_rollouts(self) -> int:
        horizon = time.monotonic() - ACTIVE_WINDOW_S
        for rid, seen in list(self._seen.items()):
            if seen < horizon:
                self._seen.pop(rid, None)
        return len(self._seen)

    def call_ended(self, mode: str) -> None:
        if self.enabled:
            self._in_flight[mode] -= 1

    def turn(self, kind: str, fork_reason: str | None = None) -> None:
        self.series("rollout_service_turns_total", kind).record(1)
        if kind == "fork":
            reason = fork_reason if fork_reason in FORK_REASONS else "other"
            self.series("rollout_service_forks_total", reason).record(1)

    def store(self, op: str, seconds: float, error: BaseException | None = None) -> None:
        self.series("rollout_service_store_latency_seconds", op).record(seconds)
        if error is not None:
            self.series("rollout_service_store_errors_total", op, type(error).__name__).record(1)

    # ------------------------------------------------------------ fleet
    def engines(self, states: Iterable[str], fleet: str) -> None:
        """The state of every slot of ``fleet`` (every state is set, zeros included)."""
        if not self.enabled:
            return
        counts = dict.fromkeys(ENGINE_STATES, 0)
        for s in states:
            counts[s] = counts.get(s, 0) + 1
        for state, n in counts.items():
            self._gauge("rollout_service_engines", n, fleet, state)

    def migration(self, outcome: str) -> None:
        self.series("rollout_service_turn_migrations_total", outcome).record(1)

    def engine_call_deadline(self) -> None:
        self.series("rollout_service_engine_call_deadlines_total").record(1)

    def rollout_lag(self, lag: int) -> None:
        self.series("rollout_service_rollout_version_lag").record(lag)

    def turn_refused(self, reason: str) -> None:
        self.series("rollout_service_turns_refused_total", reason).record(1)

    def pin_moved(self) -> None:
        self.series("rollout_service_engine_pin_moves_total").record(1)

    def engine_replaced(self, fleet: str) -> None:
        self.series("rollout_service_engine_replacements_total", fleet).record(1)

    def weight_version(self, version: str, fleet: str) -> None:
        """The version ``fleet`` serves now: its series is 1, the previous one is no longer reported (ages out)."""
        if not self.enabled:
            return
        previous = self._version.get(fleet)
        if previous is not None and previous != version:
            self._drop_gauge("rollout_service_weight_version", fleet, previous)
        self._version[fleet] = version
        self._gauge("rollout_service_weight_version", 1, fleet, version)

    # ------------------------------------------------------------ parity canary
    def canary_skipped(self, reason: str) -> None:
        self.series("rollout_service_canary_skipped_total", reason).record(1)

    def canary_checked(self, slot: int, diffs: list[float], above: int, mult_prob_error: float | None) -> None:
        """One compared generation of engine ``slot``: its per-token |Δ|, how many were above the
        threshold, its token_mult_prob_error."""
        if not self.enabled:
            return
        engine = str(slot)
        self.series("rollout_service_canary_checked_total", engine).record(1)
        hist = self.series("rollout_service_canary_abs_diff", engine)
        for d in diffs:
            hist.record(d)
        if diffs:
            self.series("rollout_service_canary_tokens_total", engine).record(len(diffs))
        if above:
            self.series("rollout_service_canary_tokens_above_threshold_total", engine).record(above)
        if mult_prob_error is not None:
            self.series("rollout_service_canary_token_mult_prob_error", engine).record(mult_prob_error)

    def canary_gauges(self, slot: int, max_now, mean_now) -> None:
        """Keep engine ``slot``'s max / mean gauges, read from the callables at every refresh."""
        self._gauge("rollout_service_canary_max_abs_diff", max_now, str(slot))
        self._gauge("rollout_service_canary_mean_abs_diff", mean_now, str(slot))

    # ------------------------------------------------------------ refit controller
    def refit(self, outcome: str, report: dict[str, Any] | None = None) -> None:
        """One refit that ran (``report``: its RefitReport dict) or was rejected before it ran."""
        if not self.enabled:
            return
        self.series("rollout_service_refits_total", outcome).record(1)
        if not report:
            return
        ran = REFIT_PHASES
        failed = report.get("failed_step")
        if failed in ("pause", "transfer", "load"):
            ran = REFIT_PHASES[: REFIT_PHASES.index(failed) + 1] + ("resume",)
        for phase in ran:
            seconds = report.get(f"{phase}_s")
            if seconds is not None:
                self.series("rollout_service_refit_phase_seconds", phase).record(float(seconds))
        if report.get("stall_s"):
            self.series("rollout_service_refit_stall_seconds").record(float(report["stall_s"]))
        if report.get("bytes"):
            self.series("rollout_service_refit_bytes_total").record(int(report["bytes"]))


class RequestObservation:
    """What one HTTP request's call generated, filled in by the data plane as events pass."""

    __slots__ = ("t0", "stream", "first_token_s", "prompt_tokens", "generated", "replayed", "version_lag")

    def __init__(self, t0: float):
        self.t0 = t0
        self.stream = False
        self.first_token_s: float | None = None
        self.prompt_tokens = 0
        self.generated: int | None = None  # None: no generation answered (error, non-generating route)
        self.replayed = False
        self.version_lag = 0

    def first_token(self, now: float) -> None:
        if self.stream and self.first_token_s is None:
            self.first_token_s = now - self.t0

    def result(self, prompt_tokens: int, generated: int, replayed: bool, weight_versions) -> None:
        """One generation's result; the choices of one request (n > 1, several prompts) add up."""
        self.prompt_tokens += prompt_tokens
        self.generated = (self.generated or 0) + generated
        self.replayed = replayed
        # Refits that landed during the generation: versions its spans name, less one (a span split
        # by kv_version is one version).
        self.version_lag = max(0, len({w["version"] if isinstance(w, dict) else w[0] for w in weight_versions or ()}) - 1)


_process_metrics: ServiceMetrics | None = None
_DISABLED = ServiceMetrics(enabled=False)
_create_lock = threading.Lock()


def get_metrics() -> ServiceMetrics:
    """This process's metrics, created on first use; a no-op object until Ray is initialized here."""
    global _process_metrics
    m = _process_metrics
    if m is not None:
        return m
    ray = sys.modules.get("ray")  # not imported: this process cannot be a Ray worker (and need not import it)
    if ray is None or not ray.is_initialized():
        return _DISABLED
    with _create_lock:
        if _process_metrics is None:
            _process_metrics = ServiceMetrics()
        return _process_metrics
