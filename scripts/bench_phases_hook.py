"""Per-request phase timing inside a RolloutService replica, for the benchmarks' *phases pass* only.

Loaded into the replicas of an instrumented redeploy as Ray's ``worker_process_setup_hook``
(``scripts/bench_service_vs_vllm.py`` and ``scripts/bench_turn_latency.py`` put this directory on
the replica's PYTHONPATH); the measured rounds never run it. It wraps, by attribute, the
replica's steps and writes one JSON line per HTTP request to
``$BENCH_PHASES_DIR/phases-<pid>.jsonl``:

- ``asgi``: the FastAPI app's whole handling of the request (from its outermost middleware,
  ``serve.http.Metered``: body read and validation, the route, the response
  sent back to Serve, the request's metrics), wall ms,
  and ``asgi_thread_cpu`` (CPU of the thread running it over that span: the request's own CPU at
  one request at a time, more when requests overlap);
- ``dialect_in`` / ``dialect_out``: ``chat.turn_request`` / ``chat.response`` (HTTP body ->
  TurnRequest, TurnResult -> answer model);
- ``run_turn`` (inclusive) and inside it ``digest``, ``load`` (store / state cache),
  ``replay_check``, ``sampling``, ``plan`` (``build_prompt``: template + tokenize), ``engine``
  (``TurnRunner._generate``: the Ray actor call to the engine and AsyncLLM), ``parse``
  (reasoning / tool parsers), ``finish_turn``, ``append`` (store write);
- ``request_id`` (Serve's, as the proxy's and the replica's access logs and the client's
  ``x-request-id`` header carry it) and ``t_end`` (epoch seconds).

Times of async steps count only the time spent inside them (an async generator's ``__anext__``
calls), not their consumer's.
"""

from __future__ import annotations

import contextvars
import functools
import json
import os
import time

_CURRENT: contextvars.ContextVar[dict | None] = contextvars.ContextVar("bench_phases", default=None)
_OUT = None


def _emit(rec: dict) -> None:
    global _OUT
    if _OUT is None:
        d = os.environ.get("BENCH_PHASES_DIR") or "/tmp"
        os.makedirs(d, exist_ok=True)
        _OUT = open(os.path.join(d, f"phases-{os.getpid()}.jsonl"), "a", buffering=1)
    _OUT.write(json.dumps(rec) + "\n")


def _add(name: str, seconds: float) -> None:
    rec = _CURRENT.get()
    if rec is not None:
        rec[name] = rec.get(name, 0.0) + seconds * 1e3


def _sync(fn, name):
    @functools.wraps(fn)
    def wrapper(*a, **kw):
        t0 = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            _add(name, time.perf_counter() - t0)
    return wrapper


def _async(fn, name):
    @functools.wraps(fn)
    async def wrapper(*a, **kw):
        t0 = time.perf_counter()
        try:
            return await fn(*a, **kw)
        finally:
            _add(name, time.perf_counter() - t0)
    return wrapper


def _agen(fn, name):
    # Added step by step: the app answers as soon as the result event comes and closes the
    # generator later, after the request's line is written.
    @functools.wraps(fn)
    async def wrapper(*a, **kw):
        agen = fn(*a, **kw)
        try:
            while True:
                t0 = time.perf_counter()
                try:
                    item = await agen.__anext__()
                except StopAsyncIteration:
                    _add(name, time.perf_counter() - t0)
                    return
                _add(name, time.perf_counter() - t0)
                yield item
        finally:
            aclose = getattr(agen, "aclose", None)
            if aclose is not None:
                await aclose()
    return wrapper


def install() -> None:
    from ray import serve

    from rollout_service.serve import http, turn_types, turns
    from rollout_service.serve.dialects import chat

    runner = turns.TurnRunner
    runner.run_turn = _agen(runner.run_turn, "run_turn")
    runner._load = _async(runner._load, "load")
    runner._replay_of = _sync(runner._replay_of, "replay_check")
    runner._sampling = _sync(runner._sampling, "sampling")
    runner._plan = _sync(runner._plan, "plan")
    runner._generate = _agen(runner._generate, "engine")
    runner._parse = _sync(runner._parse, "parse")
    runner._append = _async(runner._append, "append")
    turns.finish_turn = _sync(turns.finish_turn, "finish_turn")
    turn_types.TurnRequest.digest = _sync(turn_types.TurnRequest.digest, "digest")
    chat.turn_request = _sync(chat.turn_request, "dialect_in")
    chat.response = _sync(chat.response, "dialect_out")

    # The outermost middleware of the app: the metrics middleware.
    outer = http.Metered
    guard_call = outer.__call__

    async def timed_guard(self, scope, receive, send):
        if scope.get("type") != "http":
            return await guard_call(self, scope, receive, send)
        rec: dict = {"path": scope.get("path")}
        try:
            rec["request_id"] = serve.context._get_serve_request_context().request_id
        except Exception:  # noqa: BLE001 - timing must never break a request
            rec["request_id"] = None
        token = _CURRENT.set(rec)
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            return await guard_call(self, scope, receive, send)
        finally:
            rec["asgi"] = (time.perf_counter() - t0) * 1e3
            rec["asgi_thread_cpu"] = (time.thread_time() - c0) * 1e3
            rec["t_end"] = time.time()
            _CURRENT.reset(token)
            try:
                _emit(rec)
            except Exception:  # noqa: BLE001
                pass

    outer.__call__ = timed_guard
