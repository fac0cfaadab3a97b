"""Per-call cost of recording the service's metrics (rollout_service.metrics) in a Ray worker.

    .venv/bin/python scripts/bench_metrics.py

Starts a local Ray, then in one actor times: a plain ``ray.util.metrics`` Counter.inc with a tag
dict built per call (the naive way), one bound-series record, and what the data plane records per
HTTP request (``ServiceMetrics.request`` for a generated call) and per turn (call started / turn /
store load + append / call ended).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rollout_service.ops.runtime import apply_local_env, shutdown_local_ray, start_local_ray  # noqa: E402

apply_local_env()


def bench(n: int = 50_000) -> dict[str, float]:
    from ray.util.metrics import Counter

    from rollout_service.metrics import RequestObservation, get_metrics

    m = get_metrics()
    naive = Counter("rollout_service_bench_naive_total", "bench", tag_keys=("route", "status"))
    out: dict[str, float] = {}

    def timed(name, fn):
        fn()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        out[name] = (time.perf_counter() - t0) / n * 1e6

    route = "/v1/chat/completions"
    timed("naive Counter.inc(tags={...}) us", lambda: naive.inc(1, tags={"route": route, "status": str(200)}))
    s = m.series("rollout_service_turns_total", "monotonic")
    timed("bound series record us", lambda: s.record(1))
    obs = RequestObservation(time.perf_counter())
    obs.stream = True
    obs.first_token(time.perf_counter())
    obs.result(812, 32, False, [{"version": "0", "start": 0, "end": 32}])
    timed("per HTTP request (request(), generated call) us", lambda: m.request(route, 200, 0.05, obs))

    def turn():
        m.call_started("stateful")
        m.store("load", 0.0004)
        m.store("append", 0.0007)
        m.turn("monotonic")
        m.call_ended("stateful")

    timed("per turn (call started + ended, store load + append, turn) us", turn)
    return out


def main() -> int:
    start_local_ray(num_cpus=2)
    import ray

    try:
        result = ray.get(ray.remote(num_cpus=0)(bench).remote())
    finally:
        shutdown_local_ray()
    print(json.dumps({k: round(v, 2) for k, v in result.items()}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
