"""Bad input gets a clear 4xx in the OpenAI error envelope, and the stored history is untouched."""

from __future__ import annotations

import asyncio
import uuid

import httpx
import pytest

from serve_helpers import MODEL



def _assert_envelope(r: httpx.Response, status: int, param: str | None = None, code: str | None = None):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err


@pytest.fixture
def rollout(http):
    """A rollout with one completed turn, and a snapshot of its stored trajectory."""
    rid = f"err-{uuid.uuid4().hex[:8]}"
    msgs = [{"role": "system", "content": "sys"}, {"role": "user", "content": "hello"}]
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": msgs, "max_tokens": 6, "seed": 1},
                  headers={"X-Rollout-Id": rid})
    assert r.status_code == 200
    msg = r.json()["choices"][0]["message"]
    history = msgs + [{"role": "assistant", "content": msg["content"] or ""}]
    snapshot = http.get(f"/v1/rollouts/{rid}").json()
    return rid, history, snapshot


def _unchanged(http, rid, snapshot):
    assert http.get(f"/v1/rollouts/{rid}").json() == snapshot


@pytest.mark.parametrize(
    "body, param",
    [
        (b"{not json", None),
        (b"[1, 2]", None),
        ({"model": MODEL, "messages": "hello"}, "messages"),
        ({"model": MODEL, "messages": []}, "messages"),
        ({"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
        ({"model": MODEL, "messages": [{"role": "user"}]}, "messages[0]"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "temperature": "hot"}, "temperature"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "n": 65}, "n"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "top_p": 0}, "top_p"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, "max_tokens"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}, None),
        ({"messages": [{"role": "user", "content": "x"}]}, "model"),
    ],
)
def test_malformed_requests_get_400_and_leave_history_untouched(http, rollout, body, param):
    rid, history, snapshot = rollout
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = http.post("/v1/chat/completions", headers={"X-Rollout-Id": rid, "content-type": "application/json"}, **kwargs)
    err = _assert_envelope(r, 400)
    if param is not None:
        assert err["param"] is not None and err["param"].startswith(param), err
    _unchanged(http, rid, snapshot)


def test_unknown_model_is_404(http, rollout):
    rid, history, snapshot = rollout
    r = http.post("/v1/chat/completions", json={"model": "gpt-9", "messages": history + [{"role": "user", "content": "x"}]},
                  headers={"X-Rollout-Id": rid})
    _assert_envelope(r, 404, param="model", code="model_not_found")
    _unchanged(http, rid, snapshot)


def test_prompt_over_context_length_is_400(http, rollout):
    rid, history, snapshot = rollout
    long = " ".join(f"word{i}" for i in range(1500))
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": history + [{"role": "user", "content": long}]},
                  headers={"X-Rollout-Id": rid})
    _assert_envelope(r, 400, code="context_length_exceeded")
    r = http.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 5000,
                                                "messages": history + [{"role": "user", "content": "x"}]},
                  headers={"X-Rollout-Id": rid})
    _assert_envelope(r, 400, param="max_tokens", code="context_length_exceeded")
    _unchanged(http, rid, snapshot)


def test_body_over_limit_is_413(http, rollout):
    rid, history, snapshot = rollout
    big = "x" * (9 * 1024 * 1024)
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": big}]},
                  headers={"X-Rollout-Id": rid})
    _assert_envelope(r, 413, code="request_too_large")
    _unchanged(http, rid, snapshot)


def test_non_monotonic_history_under_reject_is_409_naming_the_message(http, rollout):
    rid, history, snapshot = rollout
    edited = [history[0], {"role": "user", "content": "hello, EDITED"}, history[2], {"role": "user", "content": "next"}]
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": edited, "max_tokens": 4},
                  headers={"X-Rollout-Id": rid, "X-History-Policy": "reject"})
    err = _assert_envelope(r, 409, code="non_monotonic_history")
    assert err["param"].startswith("messages[1]")
    _unchanged(http, rid, snapshot)


def test_non_monotonic_history_under_fork_starts_a_new_segment(http, rollout):
    rid, history, snapshot = rollout
    summarized = [history[0], {"role": "user", "content": "summary of earlier turns"}, {"role": "user", "content": "next"}]
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": summarized, "max_tokens": 4},
                  headers={"X-Rollout-Id": rid})
    assert r.status_code == 200
    ro = r.json()["choices"][0]["message"]["rollout"]
    assert ro["segment"] == 1 and ro["monotonic"] is False
    traj = http.get(f"/v1/rollouts/{rid}").json()
    assert traj["segments"][0] == snapshot["segments"][0]
    assert len(traj["segments"]) == 2


async def test_concurrent_different_calls_on_one_rollout_give_one_success_and_one_409(service, rollout):
    rid, history, snapshot = rollout
    bodies = [{"model": MODEL, "messages": history + [{"role": "user", "content": "go"}], "max_tokens": 64,
               "ignore_eos": True, "seed": seed} for seed in (5, 6)]
    async with httpx.AsyncClient(base_url=service.url, timeout=120) as client:
        results = await asyncio.gather(*[
            client.post("/v1/chat/completions", json=body, headers={"X-Rollout-Id": rid}) for body in bodies
        ])
    codes = sorted(r.status_code for r in results)
    assert codes == [200, 409], [r.text for r in results]
    _assert_envelope(next(r for r in results if r.status_code == 409), 409, code="concurrent_turn")
    traj = (await asyncio.to_thread(httpx.get, f"{service.url}/v1/rollouts/{rid}")).json()
    assert traj["turns"] == 2 and len(traj["segments"]) == 1
    assert traj["segments"][0]["token_ids"][: len(snapshot["segments"][0]["token_ids"])] == snapshot["segments"][0]["token_ids"]


def test_unknown_and_invalid_rollout_ids(http):
    _assert_envelope(http.get("/v1/rollouts/does-not-exist"), 404, code="rollout_not_found")
    _assert_envelope(http.delete("/v1/rollouts/does-not-exist"), 404)
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "x"}]},
                  headers={"X-Rollout-Id": "bad id with spaces{}"})
    _assert_envelope(r, 400, param="X-Rollout-Id")


def test_delete_frees_a_rollout(http, rollout):
    rid, _, _ = rollout
    assert http.delete(f"/v1/rollouts/{rid}").json()["deleted"] is True
    _assert_envelope(http.get(f"/v1/rollouts/{rid}"), 404)


def test_unknown_route_and_method_use_the_envelope(http):
    _assert_envelope(http.get("/v1/nothing-here"), 404)
    _assert_envelope(http.get("/v1/chat/completions"), 405)


def test_responses_and_completions_reject_bad_input(http):
    _assert_envelope(http.post("/v1/responses", json={"model": MODEL, "input": []}), 400, param="input")
    _assert_envelope(http.post("/v1/responses", json={"model": MODEL, "input": [{"type": "telepathy"}]}), 400)
    _assert_envelope(http.post("/v1/completions", json={"model": MODEL, "prompt": [1, -5]}), 400, param="prompt")
    _assert_envelope(http.post("/v1/completions", json={"model": MODEL, "prompt": [999999999]}), 400, param="prompt")
    _assert_envelope(http.post("/tokenize", json={"model": MODEL}), 400)


def test_abort_over_http_refuses_the_next_call_and_keeps_the_history(http, rollout):
    rid, history, snapshot = rollout
    _assert_envelope(http.post(f"/v1/rollouts/{rid}/abort", json={"reason": 3}), 400)
    _assert_envelope(http.post(f"/v1/rollouts/{rid}/abort", json={"why": "x"}), 400)
    _assert_envelope(http.post(f"/v1/rollouts/nope-{uuid.uuid4().hex[:6]}/abort"), 404, code="rollout_not_found")
    assert http.get(f"/v1/rollouts/{rid}").json()["status"] == "running"
    r = http.post(f"/v1/rollouts/{rid}/abort", json={"reason": "over-sampled"})
    assert r.status_code == 200, r.text
    assert r.json() == {"id": rid, "object": "rollout.abort", "status": "aborted", "reason": "over-sampled",
                        "already_aborted": False, "aborted_calls": 0}
    again = http.post(f"/v1/rollouts/{rid}/abort")  # no body: idempotent, the first reason stands
    assert again.status_code == 200 and again.json()["already_aborted"] and again.json()["reason"] == "over-sampled"
    r = http.post("/v1/chat/completions", headers={"X-Rollout-Id": rid},
                  json={"model": MODEL, "messages": history + [{"role": "user", "content": "more"}], "max_tokens": 4})
    err = _assert_envelope(r, 409, code="rollout_aborted")
    assert "over-sampled" in err["message"] and err["type"] == "conflict_error"
    stored = http.get(f"/v1/rollouts/{rid}").json()
    assert (stored["status"], stored["status_reason"]) == ("aborted", "over-sampled")
    assert {k: v for k, v in stored.items() if k not in ("status", "status_reason")} == \
        {k: v for k, v in snapshot.items() if k not in ("status", "status_reason")}


@pytest.mark.parametrize("value", ["-1", "one", "1.5", "1e3", ""])
def test_a_malformed_staleness_bound_is_400(http, rollout, value):
    rid, history, snapshot = rollout
    r = http.post("/v1/chat/completions", headers={"X-Rollout-Id": rid, "X-Max-Staleness": value},
                  json={"model": MODEL, "messages": history + [{"role": "user", "content": "more"}], "max_tokens": 4})
    _assert_envelope(r, 400, param="X-Max-Staleness")
    _unchanged(http, rid, snapshot)
