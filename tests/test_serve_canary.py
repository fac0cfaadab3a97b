"""The parity canary in a real Serve app: every generation of a short run is counted exactly in
``GET /v1/status`` (checked, or skipped by reason) and on the real metrics scrape, within the parity
bound; ``rollout-service status`` prints it.

A second app (canary.sample_fraction 1.0, one replica) is deployed beside the session's service on
the same fleet and engine (same instance name and engine config: the fleet keeps its engine), and
deleted after; the session service itself runs with the canary off so that the other tests' exact
counts (vLLM's token counters among them) never see a re-scoring."""

from __future__ import annotations

import time
import uuid

import httpx

from rollout_service.metrics import EXPORT_PREFIX, NAME_PREFIX
from serve_helpers import wait_healthy

APP = "canaryapp"
PARITY = 1e-5


def _scrape(url: str) -> dict[tuple[str, tuple], float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url, timeout=30).text
    out: dict[tuple[str, tuple], float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name.startswith(EXPORT_PREFIX + NAME_PREFIX + "canary_"):
                labels = tuple(sorted((k, v) for k, v in s.labels.items() if k in ("engine", "reason", "le")))
                out[(s.name, labels)] = out.get((s.name, labels), 0.0) + s.value  # summed over processes
    return out


def _gauges(url: str, name: str, **labels: str) -> dict[str, float]:
    """``name``'s samples with ``labels`` by the process (WorkerId) that exports them, this test process
    left out (an earlier test may have run a canary in it: its gauges stay on the endpoint)."""
    import ray
    from prometheus_client.parser import text_string_to_metric_families

    me = ray.get_runtime_context().get_worker_id()
    out = {}
    for fam in text_string_to_metric_families(httpx.get(url, timeout=30).text):
        for s in fam.samples:
            if (s.name == EXPORT_PREFIX + NAME_PREFIX + name and all(s.labels.get(k) == v for k, v in labels.items())
                    and s.labels.get("WorkerId") != me):
                out[s.labels.get("WorkerId", "")] = s.value
    return out




def test_a_serve_app_counts_every_generation_in_status_and_on_the_metrics_scrape(service):
    from ray import serve

    from rollout_service.config import CanaryConfig
    from rollout_service.ops.cli import format_status
    from rollout_service.ops.runtime import metrics_url
    from rollout_service.serve.app import build_app
    from serve_helpers import MODEL

    scrape_url = metrics_url()
    cfg = service.config.model_copy(deep=True)
    cfg.canary = CanaryConfig(sample_fraction=1.0)
    cfg.service.num_affinity_replicas = 1
    base = f"{service.url}/{APP}"
    serve.run(build_app(cfg), name=APP, route_prefix=f"/{APP}")
    try:
        wait_healthy(f"{base}/health")
        before = _scrape(scrape_url)
        generated: list[int] = []  # completion tokens of each call
        with httpx.Client(base_url=base, timeout=120) as http:
            def chat(rid: str, messages: list[dict], **sampling) -> dict:
                r = http.post("/v1/chat/completions", headers={"X-Rollout-Id": rid},
                              json={"model": MODEL, "messages": messages, "max_tokens": 8, **sampling})
                assert r.status_code == 200, r.text
                out = r.json()
                generated.append(out["usage"]["completion_tokens"])
                return out["choices"][0]["message"]

            for i in range(3):  # three rollouts of two turns at the parity default (temperature 1): checked
                rid = f"canary-{uuid.uuid4().hex[:8]}"
                messages = [{"role": "user", "content": f"Tell me about {i}."}]
                reply = chat(rid, messages, seed=i)
                chat(rid, messages + [{"role": "assistant", "content": reply["content"]},
                                      {"role": "user", "content": "More."}], seed=i)
            for i in range(2):  # a frequency penalty: cannot be recomputed from the logits alone, skipped by name
                chat(f"canary-{uuid.uuid4().hex[:8]}", [{"role": "user", "content": "Hi."}], frequency_penalty=0.3,
                     seed=i)
            r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": "nope"})  # no generation
            assert r.status_code == 400

            deadline = time.monotonic() + 120
            while True:
                status = http.get("/v1/status").json()
                canary = status["canary"]
                if canary["checked"] + sum(canary["skipped"].values()) >= 8:
                    break
                assert time.monotonic() < deadline, canary
                time.sleep(0.5)
        print({k: canary[k] for k in ("checked", "skipped", "tokens", "max_abs_diff", "mean_abs_diff",
                                      "token_mult_prob_error")})
        assert canary["enabled"] and canary["sample_fraction"] == 1.0
        assert canary["checked"] == 6 and canary["skipped"] == {"penalties": 2}
        tokens = sum(generated[:6])
        assert 0 <= canary["max_abs_diff"] <= PARITY and canary["tokens"] == tokens
        (engine,) = canary["by_engine"]
        assert (engine["slot"], engine["weight_version"], engine["checked"], engine["tokens"]) == (
            0, status["weight_version"], 6, tokens)
        assert engine["scored_on"] == {"0": 6}  # one engine: it re-scores its own generations
        assert abs(engine["token_mult_prob_error"] - 1.0) <= 2 * PARITY and engine["share_above_threshold"] == 0.0
        text = format_status(status, base)
        print(text)
        assert "parity canary: on (sample fraction 1.0), 6 generations checked, 2 skipped (penalties 2)" in text
        assert any(line.startswith("0 ") and status["weight_version"] in line for line in text.splitlines()[-2:])

        def moved(after, name, **labels):
            key = (EXPORT_PREFIX + NAME_PREFIX + name, tuple(sorted(labels.items())))
            return after.get(key, 0.0) - before.get(key, 0.0)

        deadline = time.monotonic() + 90
        while True:  # Ray exports every few seconds: wait for the records to reach the scrape
            after = _scrape(scrape_url)
            got = {"checked": moved(after, "canary_checked_total", engine="0"),
                   "skipped": moved(after, "canary_skipped_total", reason="penalties"),
                   "tokens": moved(after, "canary_tokens_total", engine="0"),
                   "abs_diff_count": moved(after, "canary_abs_diff_count", engine="0"),
                   "mult_count": moved(after, "canary_token_mult_prob_error_count", engine="0"),
                   "above": moved(after, "canary_tokens_above_threshold_total", engine="0")}
            want = {"checked": 6, "skipped": 2, "tokens": tokens, "abs_diff_count": tokens, "mult_count": 6, "above": 0}
            gauges = _gauges(scrape_url, "canary_max_abs_diff", engine="0")
            if got == want and gauges:
                break
            assert time.monotonic() < deadline, (got, want, gauges)
            time.sleep(0.5)
        assert len(gauges) == 1 and 0 <= next(iter(gauges.values())) <= PARITY, gauges
    finally:
        serve.delete(APP)
