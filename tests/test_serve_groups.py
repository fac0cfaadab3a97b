"""Groups through the real Serve app, engine and Redis over HTTP: a call with ``n > 1`` under a
rollout id opens the rollouts ``R/0 ... R/{n-1}`` (each exact, each continued alone later), readable
as a group (``GET /v1/groups/{id}``, ``GET /v1/rollouts?group=``) and aborted as one
(``POST /v1/groups/{id}/abort``) while its members stream. That ``n`` under a rollout id answers as
vLLM's own server does is in test_serve_vs_vllm.py (chat_n, chat_n_stream)."""

from __future__ import annotations

import json
import time
import uuid

import httpx

from serve_helpers import MODEL


def _body(**extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "Name three fruits."}],
            "chat_template_kwargs": {"enable_thinking": False}, **extra}


def test_n_under_a_rollout_id_is_a_group_of_exact_rollouts_each_continued_alone(http):
    from rollout_service.training import rows_from_group

    rid = f"grp-{uuid.uuid4().hex[:8]}"
    headers = {"X-Rollout-Id": rid, "Idempotency-Key": f"key-{rid}"}
    r = http.post("/v1/chat/completions", json=_body(n=4, max_tokens=10, seed=11, logprobs=True), headers=headers)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    # a retry of the whole call (its answer lost) is answered from the store, member by member
    retry = http.post("/v1/chat/completions", json=_body(n=4, max_tokens=10, seed=11, logprobs=True), headers=headers)
    assert [c["message"]["rollout"]["replayed"] for c in retry.json()["choices"]] == [True] * 4
    assert [c["message"]["generation_token_ids"] for c in retry.json()["choices"]] == [
        c["message"]["generation_token_ids"] for c in choices]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    assert [c["message"]["rollout"]["id"] for c in choices] == [f"{rid}/{j}" for j in range(4)]
    prompt = choices[0]["message"]["prompt_token_ids"]
    for c in choices:  # each member: its own rollout, exactly what its choice answered
        msg = c["message"]
        assert msg["prompt_token_ids"] == prompt and msg["rollout"]["turn"] == 1
        traj = http.get(f"/v1/rollouts/{msg['rollout']['id']}").json()
        seg = traj["segments"][0]
        assert seg["token_ids"] == prompt + msg["generation_token_ids"]
        assert [lp for lp, m in zip(seg["logprobs"], seg["loss_mask"]) if m] == msg["generation_log_probs"]
        assert [t["logprob"] for t in c["logprobs"]["content"]] == msg["generation_log_probs"]
    assert len({tuple(c["message"]["generation_token_ids"]) for c in choices}) > 1  # seeds 11..14, not one sample
    # The same member sampled alone (its child seed, vLLM's rule): the same ids.
    alone = http.post("/v1/chat/completions", json=_body(max_tokens=10, seed=13, logprobs=True),
                      headers={"X-Rollout-Id": f"{rid}-alone"}).json()["choices"][0]["message"]
    assert alone["generation_token_ids"] == choices[2]["message"]["generation_token_ids"]

    group = http.get(f"/v1/groups/{rid}").json()
    assert group["object"] == "rollout.group" and group["size"] == 4 and group["states"]["finished"] == 4
    version = choices[0]["message"]["weight_versions"][0]["version"]
    assert all(m["turns"] == 1 and m["first_weight_version"] == m["last_weight_version"] == version
               for m in group["members"])
    listed = http.get("/v1/rollouts", params={"group": rid}).json()
    assert [m["id"] for m in listed["data"]] == [f"{rid}/{j}" for j in range(4)]
    page = http.get("/rollouts", params={"group": rid})
    assert page.status_code == 200 and page.text.count("/view\"") == 4 and f"{rid}%2F3/view" in page.text
    rows = rows_from_group(http.get(f"/v1/groups/{rid}", params={"trajectories": "true"}).json())
    assert [row.input_ids for row in rows] == [prompt + c["message"]["generation_token_ids"] for c in choices]

    # A later call of member 2 is an ordinary call of that rollout: monotonic, the others untouched.
    m2 = choices[2]["message"]
    later = _body(max_tokens=6, seed=5, messages=_body()["messages"] + [
        {"role": "assistant", "content": m2["content"]}, {"role": "user", "content": "One more."}])
    second = http.post("/v1/chat/completions", json=later, headers={"X-Rollout-Id": f"{rid}/2"})
    assert second.status_code == 200, second.text
    msg = second.json()["choices"][0]["message"]
    assert msg["rollout"]["turn"] == 2 and msg["rollout"]["monotonic"] is True
    assert msg["prompt_token_ids"][:len(prompt) + len(m2["generation_token_ids"])] == prompt + m2["generation_token_ids"]
    turns = {m["id"]: m["turns"] for m in http.get(f"/v1/groups/{rid}").json()["members"]}
    assert turns == {f"{rid}/0": 1, f"{rid}/1": 1, f"{rid}/2": 2, f"{rid}/3": 1}

    # X-Rollout-Group names the group; unknown and malformed group ids
    named = f"step-7-{uuid.uuid4().hex[:6]}"
    r = http.post("/v1/chat/completions", json=_body(n=2, max_tokens=4, seed=1),
                  headers={"X-Rollout-Id": f"{rid}-b", "X-Rollout-Group": named})
    assert r.status_code == 200, r.text
    assert [m["id"] for m in http.get(f"/v1/groups/{named}").json()["members"]] == [f"{rid}-b/0", f"{rid}-b/1"]
    # one sample per call, each naming the group
    single = f"single-{uuid.uuid4().hex[:6]}"
    for j in range(2):
        one = http.post("/v1/chat/completions", json=_body(max_tokens=2, seed=j),
                        headers={"X-Rollout-Id": f"{single}-{j}", "X-Rollout-Group": single})
        assert one.status_code == 200, one.text
    assert {m["id"]: m["state"] for m in http.get(f"/v1/groups/{single}").json()["members"]} == {
        f"{single}-0": "finished", f"{single}-1": "finished"}
    missing = http.get(f"/v1/groups/{rid}-b")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "group_not_found"
    bad = http.get("/v1/groups/bad%20id")
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "group_id"
    bad = http.get("/v1/rollouts", params={"group": "a/.."})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "group"
    too_long = http.post("/v1/chat/completions", json=_body(n=11, max_tokens=1), headers={"X-Rollout-Id": "r" * 126})
    assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "X-Rollout-Id"


def test_a_group_aborted_while_its_members_stream_ends_every_member_at_once(service, http):
    rid = f"grp-abort-{uuid.uuid4().hex[:8]}"
    body = _body(n=4, max_tokens=900, seed=3, stream=True, logprobs=True, ignore_eos=True,
                 stream_options={"include_usage": True})
    streamed = {j: 0 for j in range(4)}
    finish: dict[int, str] = {}
    after_abort = {j: 0 for j in range(4)}
    aborted_at = None
    with httpx.Client(base_url=service.url, timeout=120) as client:
        with client.stream("POST", "/v1/chat/completions", json=body, headers={"X-Rollout-Id": rid}) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                for c in chunk.get("choices", []):
                    n = len((c.get("logprobs") or {}).get("content") or [])
                    streamed[c["index"]] += n
                    if aborted_at is not None:
                        after_abort[c["index"]] += n
                    if c.get("finish_reason"):
                        finish[c["index"]] = c["finish_reason"]
                if aborted_at is None and all(v >= 4 for v in streamed.values()):
                    sent_at = time.monotonic()
                    answer = http.post(f"/v1/groups/{rid}/abort", json={"reason": "dynamic sampling"})
                    aborted_at = time.monotonic()
                    assert answer.status_code == 200, answer.text
                    assert answer.json()["aborted_calls"] == 4
            assert aborted_at is not None, f"the stream ended before every member streamed 4 tokens: {streamed} {finish}"
            ended_s = time.monotonic() - aborted_at
    print(f"group abort: the abort call took {aborted_at - sent_at:.3f}s, the streams ended {ended_s:.3f}s after its "
          f"answer; tokens that reached the client after it, per member {after_abort}; tokens per member {streamed}")
    assert finish == {j: "abort" for j in range(4)}, finish
    assert ended_s < 1.0
    group = http.get(f"/v1/groups/{rid}", params={"trajectories": "true"}).json()
    assert group["states"]["aborted"] == 4
    for m in group["members"]:
        j = int(m["id"].rsplit("/", 1)[1])
        assert m["status_reason"] == "dynamic sampling" and m["turns"] == 1
        turn = m["trajectory"]["segments"][0]["turns"][0]
        assert turn["finish_reason"] == "abort" and turn["gen_end"] - turn["gen_start"] == streamed[j] < 900
    refused = http.post("/v1/chat/completions", json=_body(max_tokens=4), headers={"X-Rollout-Id": f"{rid}/1"})
    assert refused.status_code == 409 and refused.json()["error"]["code"] == "rollout_aborted"
    again = http.post(f"/v1/groups/{rid}/abort")
    assert again.status_code == 200 and all(m["already_aborted"] for m in again.json()["members"])
    unknown = http.post(f"/v1/groups/nope-{uuid.uuid4().hex[:6]}/abort")
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "group_not_found"
