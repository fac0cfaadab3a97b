"""Retries are not forks: a repeated call gets the stored answer back and stores nothing new."""

from __future__ import annotations

import asyncio
import json
import uuid

import httpx
import pytest

from serve_helpers import MODEL, parse_sse



def _rollout(http):
    rid = f"idem-{uuid.uuid4().hex[:8]}"
    msgs = [{"role": "user", "content": "hello"}]
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": msgs, "max_tokens": 6, "seed": 1},
                  headers={"X-Rollout-Id": rid})
    assert r.status_code == 200, r.text
    history = msgs + [{"role": "assistant", "content": r.json()["choices"][0]["message"]["content"] or ""},
                      {"role": "user", "content": "next"}]
    return rid, {"model": MODEL, "messages": history, "max_tokens": 8, "seed": 7, "ignore_eos": True}


def _answer(r: httpx.Response) -> dict:
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]


SAME = ("prompt_token_ids", "generation_token_ids", "generation_log_probs", "weight_versions", "content", "tool_calls")


def test_a_retry_with_the_same_idempotency_key_replays_the_stored_answer(http):
    rid, body = _rollout(http)
    headers = {"X-Rollout-Id": rid, "Idempotency-Key": f"k-{uuid.uuid4().hex}"}
    first = _answer(http.post("/v1/chat/completions", json=body, headers=headers))
    stored = http.get(f"/v1/rollouts/{rid}").json()
    again = _answer(http.post("/v1/chat/completions", json={**body}, headers=headers))
    assert {k: again.get(k) for k in SAME} == {k: first.get(k) for k in SAME}
    assert first["rollout"]["replayed"] is False and again["rollout"] == {**first["rollout"], "replayed": True}
    assert http.get(f"/v1/rollouts/{rid}").json() == stored  # nothing stored, no fork


def test_the_same_key_with_a_different_body_is_422_and_stores_nothing(http):
    rid, body = _rollout(http)
    headers = {"X-Rollout-Id": rid, "Idempotency-Key": "key-1"}
    _answer(http.post("/v1/chat/completions", json=body, headers=headers))
    stored = http.get(f"/v1/rollouts/{rid}").json()
    r = http.post("/v1/chat/completions", json={**body, "seed": 8}, headers=headers)
    assert r.status_code == 422 and r.json()["error"]["code"] == "idempotency_key_reused", r.text
    assert http.get(f"/v1/rollouts/{rid}").json() == stored


def test_without_a_key_an_identical_repeat_of_the_last_call_replays_it_streamed_or_not(http):
    rid, body = _rollout(http)
    first = _answer(http.post("/v1/chat/completions", json=body, headers={"X-Rollout-Id": rid}))
    stored = http.get(f"/v1/rollouts/{rid}").json()
    again = _answer(http.post("/v1/chat/completions", json=body, headers={"X-Rollout-Id": rid}))
    assert again["generation_token_ids"] == first["generation_token_ids"] and again["rollout"]["replayed"] is True
    with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}, headers={"X-Rollout-Id": rid}) as r:
        chunks = parse_sse(r.iter_lines())
    last = chunks[-1]["choices"][0]["delta"]
    assert last["generation_token_ids"] == first["generation_token_ids"]
    assert last["generation_log_probs"] == first["generation_log_probs"] and last["rollout"]["replayed"] is True
    assert http.get(f"/v1/rollouts/{rid}").json() == stored
    # A repeat of an *earlier* call is an edited history, not a retry: it forks.
    r = http.post("/v1/chat/completions", json={**body, "messages": body["messages"][:1]}, headers={"X-Rollout-Id": rid})
    assert _answer(r)["rollout"]["segment"] == 1


def test_a_responses_retry_replays_too(openai_client, http):
    rid = f"idem-resp-{uuid.uuid4().hex[:6]}"
    kwargs = dict(model=MODEL, input="hello", max_output_tokens=5, extra_body={"seed": 3},
                  extra_headers={"X-Rollout-Id": rid})
    first = openai_client.responses.create(**kwargs).output[-1].model_dump()
    again = openai_client.responses.create(**kwargs).output[-1].model_dump()
    assert again["generation_token_ids"] == first["generation_token_ids"] and again["rollout"]["replayed"] is True
    assert http.get(f"/v1/rollouts/{rid}").json()["turns"] == 1


async def test_a_retry_that_arrives_while_the_call_runs_waits_for_it_and_gets_its_answer(service, http):
    rid, body = _rollout(http)
    body = {**body, "max_tokens": 48}
    async with httpx.AsyncClient(base_url=service.url, timeout=120) as client:
        a, b = await asyncio.gather(*[client.post("/v1/chat/completions", json=body, headers={"X-Rollout-Id": rid})
                                      for _ in range(2)])
    a, b = _answer(a), _answer(b)
    assert a["generation_token_ids"] == b["generation_token_ids"]
    assert sorted([a["rollout"]["replayed"], b["rollout"]["replayed"]]) == [False, True]
    traj = http.get(f"/v1/rollouts/{rid}").json()
    assert traj["turns"] == 2 and len(traj["segments"]) == 1
