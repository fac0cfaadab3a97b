"""Metrics (rollout_service/metrics.py): what they are called, where they are shown, and that the real
endpoint counts exactly what happened.

The end-to-end test scrapes Ray's metrics endpoint of the session's service (Ray started with a
metrics export port: ``ray_session``) before and after a short run — 3 monotonic turns (one
streamed), 1 forked turn, 1 bad request, 1 refit — and checks every counter moved by exactly that.
Ray exports each process's records every 10 s, so the baseline is taken once nothing changes for
longer than that, and the run's totals are polled for (bounded).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import pytest

from rollout_service.metrics import (
    BY_NAME,
    DEFAULT_METRICS_PORT,
    EXPORT_PREFIX,
    METRICS,
    NAME_PREFIX,
    RequestObservation,
    ServiceMetrics,
)

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "deployments" / "grafana" / "rollout-service.json"
DOCS = ROOT / "docs" / "observability.md"
# Ray's metrics_report_interval_ms in this session (tests/runtime_fixtures.py sets it before Ray starts)
EXPORT_INTERVAL_S = int(os.environ.get("RAY_metrics_report_interval_ms", "10000")) / 1000
CHAT = "/v1/chat/completions"


# ----------------------------------------------------------------------------- definitions


def test_every_metric_is_prefixed_typed_and_named_for_prometheus():
    names = [m.name for m in METRICS]
    assert len(names) == len(set(names))
    for m in METRICS:
        assert m.name.startswith(NAME_PREFIX) and re.fullmatch(r"[a-z_]+", m.name), m.name
        assert m.kind in ("counter", "histogram", "gauge"), m
        assert m.name.endswith("_total") == (m.kind == "counter"), f"{m.name}: counters, and only they, end in _total"
        assert all(re.fullmatch(r"[a-z_]+", t) for t in m.tags), m
        assert m.description and m.source in ("data plane", "fleet", "controller")
        if m.kind == "histogram":
            assert m.buckets and all(0 < a < b for a, b in zip(m.buckets, m.buckets[1:])), m
        else:
            assert m.buckets is None


def test_recording_outside_ray_does_nothing_and_the_module_needs_neither_ray_nor_vllm():
    m = ServiceMetrics(enabled=False)
    obs = RequestObservation(0.0)
    obs.result(10, 3, False, [{"version": "0"}, {"version": "1"}])
    m.request(CHAT, 200, 0.1, obs)
    m.call_started("stateful")
    m.turn("fork", "content")
    m.store("load", 0.001, RuntimeError())
    m.call_ended("stateful")
    m.engines(["healthy"], "rollout-service-fleet")
    m.engine_replaced("rollout-service-fleet")
    m.weight_version("1", "rollout-service-fleet")
    m.refit("ok", {"pause_s": 0.1, "bytes": 5})
    assert obs.version_lag == 1
    code = ("import sys, rollout_service.metrics as m; m.get_metrics().turn('monotonic'); "
            "assert not {'ray', 'vllm', 'torch'} & set(sys.modules), sorted(sys.modules)")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def _exported_series() -> set[str]:
    return {s for m in METRICS for s in m.exported_series()}


def _vllm_metric_names() -> set[str]:
    """vLLM's metric names (``vllm:x``), as its Ray stat logger exports them: ``ray_vllm_x``."""
    from vllm.v1.metrics import loggers

    return {"ray_vllm_" + n for n in re.findall(r'name="vllm:([a-z_]+)"', Path(loggers.__file__).read_text())}


def test_active_rollouts_counts_each_rollout_once_until_its_window_passes(monkeypatch):
    import rollout_service.metrics as m

    metrics = m.ServiceMetrics(enabled=False)  # the window bookkeeping alone (no Ray needed)
    now = [1000.0]
    monkeypatch.setattr(m.time, "monotonic", lambda: now[0])
    for rid in ("a", "b", "a"):
        metrics._seen[rid] = m.time.monotonic()
    assert metrics._active_rollouts() == 2
    now[0] += m.ACTIVE_WINDOW_S - 1
    metrics._seen["b"] = now[0]  # b called again: its window restarts
    now[0] += 2
    assert metrics._active_rollouts() == 1 and set(metrics._seen) == {"b"}  # a expired and forgotten
    now[0] += m.ACTIVE_WINDOW_S
    assert metrics._active_rollouts() == 0 and metrics._seen == {}


def test_kept_gauges_are_re_set_every_half_export_interval_until_dropped(monkeypatch):
    import rollout_service.metrics as m

    def refresh_s(interval_ms: str) -> float:  # what a process of a Ray started with that interval reads
        code = "from rollout_service.metrics import gauge_refresh_s; print(gauge_refresh_s())"
        env = {**os.environ, "RAY_metrics_report_interval_ms": interval_ms}
        return float(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                                    check=True, timeout=120).stdout)

    assert refresh_s("3000") == 1.5
    assert refresh_s("200") == 0.5  # Ray floors its export interval at 1 s

    monkeypatch.setattr(m, "gauge_refresh_s", lambda: 0.02)
    kept, seen, n = m.KeptGauges(), [], [0]
    kept.keep("a", lambda v: seen.append(("a", v)), 1)
    kept.keep("a", lambda v: seen.append(("a", v)), 2)  # a later set replaces the kept value
    kept.keep("b", lambda v: seen.append(("b", v)), lambda: n[0])  # a callable is read at each refresh
    assert "a" in kept and "b" in kept
    n[0] = 7
    time.sleep(0.2)
    assert ("a", 2) in seen and ("b", 7) in seen and ("a", 1) not in seen
    kept.drop("a")
    time.sleep(0.05)
    seen.clear()
    time.sleep(0.2)
    assert seen and {k for k, _ in seen} == {"b"}  # dropped: no longer re-set


def test_grafana_dashboard_imports_and_queries_only_metrics_that_exist():
    dash = json.loads(DASHBOARD.read_text())
    assert dash["uid"] and dash["title"] and dash["schemaVersion"] >= 36
    datasource = [v for v in dash["templating"]["list"] if v["type"] == "datasource"]
    assert [v["query"] for v in datasource] == ["prometheus"]  # import asks for nothing but a Prometheus
    panels = [p for p in dash["panels"] if p["type"] != "row"]
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    exprs = [t["expr"] for p in panels for t in p["targets"]]
    assert all(t["datasource"]["uid"] == "${datasource}" for p in panels for t in p["targets"])
    used = {n for e in exprs for n in re.findall(r"\b(ray_[a-z_]+)", e)}
    ours, vllm = _exported_series(), _vllm_metric_names()
    unknown = {n for n in used if n not in ours and re.sub(r"_(total|bucket|count|sum)$", "", n) not in vllm}
    assert unknown == set()
    unshown = {m.name for m in METRICS if not set(m.exported_series()) & used}
    assert unshown == set()  # every metric we define is on the dashboard
    for e in exprs:  # balanced brackets: a cheap guard against a broken PromQL edit
        assert e.count("(") == e.count(")") and e.count("[") == e.count("]") and e.count("{") == e.count("}"), e


def test_docs_describe_every_metric_under_its_exported_name():
    text = DOCS.read_text()
    missing = [m.exported for m in METRICS if f"`{m.exported}" not in text]
    assert missing == []
    assert f"--metrics-port" in text and str(DEFAULT_METRICS_PORT) in text


# ----------------------------------------------------------------------------- the real endpoint


def _scrape(url: str) -> list[tuple[str, dict[str, str], float]]:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url, timeout=30).text
    return [(s.name, s.labels, s.value) for fam in text_string_to_metric_families(text) for s in fam.samples
            if s.name.startswith((EXPORT_PREFIX + NAME_PREFIX, "ray_vllm_"))]


def _value(samples, name: str, **labels: str) -> float:
    """Sum over every process (WorkerId ...) of the samples of ``name`` carrying ``labels``."""
    return sum(v for n, ls, v in samples if n == name and all(ls.get(k) == w for k, w in labels.items()))


def _counters(samples) -> dict:
    return {(n, tuple(sorted((k, v) for k, v in ls.items()))): v for n, ls, v in samples
            if n.endswith(("_total", "_count", "_sum", "_bucket"))}


def _settled(url: str, timeout: float = 120.0):
    """A scrape no record is still on its way to: unchanged over more than one export interval."""
    deadline = time.monotonic() + timeout
    before = _scrape(url)
    while True:
        time.sleep(EXPORT_INTERVAL_S + 1)
        after = _scrape(url)
        if _counters(after) == _counters(before):
            return after
        assert time.monotonic() < deadline, "the metrics never settled"
        before = after


@pytest.fixture(scope="module")
def metrics_url(service):
    from rollout_service.ops.runtime import metrics_url

    url = metrics_url()
    assert url is not None and service.metrics_url == url
    return url


@pytest.fixture(scope="module")
def trainer(service):
    from rollout_service.refit.client import TrainerClient
    from rollout_service.refit.controller import get_controller

    client = TrainerClient(get_controller(), timeout_s=120)
    client.init_weight_sync()
    yield client
    client.close()


def _chat(http, rid: str, messages: list[dict], stream: bool = False) -> tuple[dict, dict]:
    """(assistant message, usage) of one call of rollout ``rid``."""
    from serve_helpers import MODEL

    body = {"model": MODEL, "messages": messages, "max_tokens": 8, "seed": 1}
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
        r = http.post(CHAT, json=body, headers={"X-Rollout-Id": rid})
        assert r.status_code == 200, r.text
        chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
        content = "".join((c["choices"][0]["delta"].get("content") or "") for c in chunks if c.get("choices"))
        return {"role": "assistant", "content": content}, chunks[-1]["usage"]
    r = http.post(CHAT, json=body, headers={"X-Rollout-Id": rid})
    assert r.status_code == 200, r.text
    out = r.json()
    return {"role": "assistant", "content": out["choices"][0]["message"]["content"]}, out["usage"]


def test_the_endpoint_counts_exactly_a_short_run(service, http, metrics_url, trainer, tiny_model_dir):
    from safetensors.torch import load_file

    before = _settled(metrics_url)

    rid = f"metrics-{uuid.uuid4().hex[:8]}"
    messages = [{"role": "user", "content": "Say something."}]
    usages = []
    for i, follow_up in enumerate(["And more.", "And again.", None]):
        reply, usage = _chat(http, rid, messages, stream=(i == 2))  # three monotonic turns, the last streamed
        usages.append(usage)
        if follow_up:
            messages += [reply, {"role": "user", "content": follow_up}]
    _, usage = _chat(http, rid, [{"role": "user", "content": "Say something else."}])  # an edited history: a fork
    usages.append(usage)
    bad = http.post(CHAT, json={"model": "tiny-qwen3", "messages": "not a list"})
    assert bad.status_code == 400
    version = f"metrics-{uuid.uuid4().hex[:6]}"
    report = trainer.refit(version, load_file(str(tiny_model_dir / "model.safetensors")))  # same weights, new label
    assert report["ok"]

    prompt = sum(u["prompt_tokens"] for u in usages)
    generated = sum(u["completion_tokens"] for u in usages)
    counted = {
        ("requests_total", (("route", CHAT), ("status", "200"))): 4,
        ("requests_total", (("route", CHAT), ("status", "400"))): 1,
        ("request_latency_seconds_count", (("route", CHAT),)): 5,
        ("time_to_first_token_seconds_count", (("route", CHAT),)): 1,
        ("prompt_tokens_total", (("route", CHAT),)): prompt,
        ("generated_tokens_total", (("route", CHAT),)): generated,
        ("version_lag_count", ()): 4,
        ("version_lag_bucket", (("le", "0.5"),)): 4,
        ("turns_total", (("kind", "monotonic"),)): 3,
        ("turns_total", (("kind", "fork"),)): 1,
        ("turns_total", (("kind", "reject"),)): 0,
        ("turns_total", (("kind", "replay"),)): 0,
        ("forks_total", (("reason", "content"),)): 1,
        ("calls_total", (("mode", "stateful"),)): 4,
        ("calls_total", (("mode", "stateless"),)): 0,
        ("store_latency_seconds_count", (("op", "load"),)): 4,
        ("store_latency_seconds_count", (("op", "append"),)): 4,
        ("store_errors_total", ()): 0,
        ("refits_total", (("outcome", "ok"),)): 1,
        ("refits_total", (("outcome", "failed"),)): 0,
        **{("refit_phase_seconds_count", (("phase", p),)): 1 for p in ("pause", "transfer", "load", "resume")},
        ("refit_stall_seconds_count", ()): 1,
        ("refit_bytes_total", ()): report["bytes"],
    }
    expected = {(EXPORT_PREFIX + NAME_PREFIX + n, ls): v for (n, ls), v in counted.items()}
    # vLLM's own counter, through its Ray stat logger: the engine generated exactly what we answered.
    expected[("ray_vllm_generation_tokens_total", ())] = generated

    def moved(samples):
        return {(n, ls): _value(samples, n, **dict(ls)) - _value(before, n, **dict(ls)) for n, ls in expected}

    # What the dashboard queries must be on the endpoint under those names (vLLM's included); only what
    # this session never records (a store error, an engine replacement, a pin move: the session service
    # routes least_loaded, without prefix caching; the canary's windowed gauges: the session service runs
    # with the canary off, and another test's canary reads NaN once its window has passed; a refusal at
    # admission: nothing here is aborted or stale) may be absent.
    dash = json.loads(DASHBOARD.read_text())
    queried = {n for p in dash["panels"] for t in p.get("targets", []) for n in re.findall(r"\b(ray_[a-z_]+)", t["expr"])}
    never = {s for m in ("store_errors_total", "engine_replacements_total", "engine_pin_moves_total",
                         "canary_max_abs_diff", "canary_mean_abs_diff", "turns_refused_total")
             for s in BY_NAME[NAME_PREFIX + m].exported_series()}

    deadline = time.monotonic() + 9 * EXPORT_INTERVAL_S
    while True:
        after = _scrape(metrics_url)
        got = moved(after)
        over = {k: v for k, v in got.items() if v > expected[k]}
        assert over == {}, f"counted more than happened: {over} (expected {expected})"
        # Ray's agent drops a gauge series not re-exported within two export intervals, so on a loaded
        # machine a late export can leave a process's gauges out of one scrape; they must come back.
        missing = queried - never - {n for n, _, _ in after}
        if got == expected and not missing and _value(after, "ray_rollout_service_weight_version", version=version,
                                                                  fleet=f"{service.config.service.instance_name}-fleet") == 1 \
                and _value(after, "ray_rollout_service_active_rollouts") >= 1 \
                and _value(after, "ray_rollout_service_calls_in_flight", mode="stateful") == 0:
            # The in-flight gauge is read every gauge_refresh_s() (metrics.call_started), so it may show
            # the last call for a few seconds after the counters have it done; it must reach 0.
            break
        assert time.monotonic() < deadline, ({k: (v, expected[k]) for k, v in got.items() if v != expected[k]},
                                             f"not on the endpoint: {missing}")
        time.sleep(1)
    fleet = f"{service.config.service.instance_name}-fleet"  # other tests' fleets report under their own label
    assert _value(after, "ray_rollout_service_engines", fleet=fleet, state="healthy") == service.config.engine.num_engines
    assert _value(after, "ray_rollout_service_calls_in_flight", mode="stateful") == 0
    # An idle engine's gauges stay on the endpoint, reading 0, past the two export intervals after which
    # Ray's agent drops a series nobody re-reports (vLLM sets them only when the engine steps).
    time.sleep(2 * max(EXPORT_INTERVAL_S, 1) + 1)
    idle = _scrape(metrics_url)
    engine_gauges = {"ray_vllm_num_requests_running", "ray_vllm_num_requests_waiting", "ray_vllm_kv_cache_usage_perc"}
    assert engine_gauges - {n for n, _, _ in idle} == set()
    assert _value(idle, "ray_vllm_num_requests_running") == 0 and _value(idle, "ray_vllm_num_requests_waiting") == 0


def test_the_endpoint_counts_replays_rejects_stateless_and_completion_calls(service, http, metrics_url):
    """The turn kinds and call modes the short run above does not make, counted exactly: a retry
    answered from the store (replay: no tokens, no lag), an edited history refused (reject, 409), a
    stateless call (echo protocol) and a raw completion (a call, not a turn)."""
    from serve_helpers import MODEL

    before = _settled(metrics_url)

    rid = f"metrics-{uuid.uuid4().hex[:8]}"
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Say something."}], "max_tokens": 8, "seed": 1}
    key = {"X-Rollout-Id": rid, "Idempotency-Key": f"k-{uuid.uuid4().hex[:8]}"}
    first = http.post(CHAT, json=body, headers=key)
    again = http.post(CHAT, json=body, headers=key)  # the same call retried: answered from the store
    assert first.status_code == again.status_code == 200, (first.text, again.text)
    assert again.json()["choices"][0]["message"]["rollout"]["replayed"] is True
    edited = {**body, "messages": [{"role": "user", "content": "Say something else."}]}
    refused = http.post(CHAT, json=edited, headers={"X-Rollout-Id": rid, "X-History-Policy": "reject"})
    assert refused.status_code == 409 and refused.json()["error"]["code"] == "non_monotonic_history", refused.text
    stateless = http.post(CHAT, json=body)
    assert stateless.status_code == 200, stateless.text
    completion = http.post("/v1/completions", json={"model": MODEL, "prompt": "Hello", "max_tokens": 4, "seed": 1})
    assert completion.status_code == 200, completion.text

    generated = {CHAT: sum(r.json()["usage"]["completion_tokens"] for r in (first, stateless)),
                 "/v1/completions": completion.json()["usage"]["completion_tokens"]}
    counted = {
        ("requests_total", (("route", CHAT), ("status", "200"))): 3,
        ("requests_total", (("route", CHAT), ("status", "409"))): 1,
        ("requests_total", (("route", "/v1/completions"), ("status", "200"))): 1,
        ("generated_tokens_total", (("route", CHAT),)): generated[CHAT],  # the replay adds none
        ("generated_tokens_total", (("route", "/v1/completions"),)): generated["/v1/completions"],
        ("version_lag_count", ()): 3,  # first, stateless, completion: not the replay, not the 409
        ("turns_total", (("kind", "monotonic"),)): 2,  # the first call, the stateless call
        ("turns_total", (("kind", "replay"),)): 1,
        ("turns_total", (("kind", "reject"),)): 1,
        ("turns_total", (("kind", "fork"),)): 0,
        ("forks_total", ()): 0,
        ("calls_total", (("mode", "stateful"),)): 3,
        ("calls_total", (("mode", "stateless"),)): 1,
        ("calls_total", (("mode", "completion"),)): 1,
        ("store_latency_seconds_count", (("op", "load"),)): 3,
        ("store_latency_seconds_count", (("op", "append"),)): 1,
        ("store_errors_total", ()): 0,
    }
    expected = {(EXPORT_PREFIX + NAME_PREFIX + n, ls): v for (n, ls), v in counted.items()}

    def moved(samples):
        return {(n, ls): _value(samples, n, **dict(ls)) - _value(before, n, **dict(ls)) for n, ls in expected}

    deadline = time.monotonic() + 9 * EXPORT_INTERVAL_S
    while True:
        got = moved(_scrape(metrics_url))
        over = {k: v for k, v in got.items() if v > expected[k]}
        assert over == {}, f"counted more than happened: {over} (expected {expected})"
        if got == expected:
            break
        assert time.monotonic() < deadline, {k: (v, expected[k]) for k, v in got.items() if v != expected[k]}
        time.sleep(1)
