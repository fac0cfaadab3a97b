"""The smaller endpoints: models, health, tokenize (with the on-policy correction), completions."""

from __future__ import annotations

import uuid

import pytest

from serve_helpers import MODEL



def test_models_is_vllm_compatible(openai_client, tiny_model_dir):
    models = openai_client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert models[0].model_dump()["root"] == str(tiny_model_dir)


def test_health(http):
    r = http.get("/health")
    assert r.status_code == 200 and r.json()["status"] == "ok" and r.json()["engines_alive"] == 1
    assert r.json()["store_durability"] == {"durability": "local", "ok": True}  # test_store_replication: replicated
    head = http.head("/health")  # load balancers' and some probes' method
    assert head.status_code == 200 and head.content == b"", (head.status_code, head.content)


def test_version_names_the_vllm_it_serves_with(http):
    from vllm import __version__

    assert http.get("/version").json() == {"version": __version__}  # vLLM's route and answer


def test_tokenize_returns_the_ids_the_next_call_will_use(http):
    """NeMo Gym captures ids through /tokenize: it must see the on-policy prompt, not a re-render."""
    rid = f"tok-{uuid.uuid4().hex[:8]}"
    msgs = [{"role": "user", "content": "Tokenize me"}]
    first = http.post("/v1/chat/completions", json={"model": MODEL, "messages": msgs, "max_tokens": 12, "seed": 9},
                      headers={"X-Rollout-Id": rid}).json()["choices"][0]["message"]
    nxt = msgs + [{"role": "assistant", "content": first["content"] or ""}, {"role": "user", "content": "again"}]
    tok = http.post("/tokenize", json={"model": MODEL, "messages": nxt}, headers={"X-Rollout-Id": rid}).json()
    base = first["prompt_token_ids"] + first["generation_token_ids"]
    assert tok["tokens"][: len(base)] == base and tok["count"] == len(tok["tokens"])
    second = http.post("/v1/chat/completions", json={"model": MODEL, "messages": nxt, "max_tokens": 4, "seed": 9},
                       headers={"X-Rollout-Id": rid}).json()["choices"][0]["message"]
    assert second["prompt_token_ids"] == tok["tokens"]
    plain = http.post("/tokenize", json={"model": MODEL, "prompt": "hello world"}).json()
    assert plain["tokens"] == [14990, 1879] and plain["max_model_len"] == 1024


def test_completions_accept_token_id_prompts(openai_client):
    out = openai_client.completions.create(model=MODEL, prompt=[151644, 872, 198, 9707], max_tokens=8, seed=2,
                                           temperature=1.0, extra_body={"ignore_eos": True, "return_token_ids": True})
    choice = out.choices[0].model_dump()
    assert len(choice["token_ids"]) == 8 and len(choice["generation_log_probs"]) == 8
    assert choice["prompt_token_ids"] == [151644, 872, 198, 9707]
    again = openai_client.completions.create(model=MODEL, prompt=[151644, 872, 198, 9707], max_tokens=8, seed=2,
                                             temperature=1.0, extra_body={"ignore_eos": True, "return_token_ids": True})
    assert again.choices[0].model_dump()["token_ids"] == choice["token_ids"]


def test_chat_logprobs_and_return_token_ids(openai_client):
    out = openai_client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5, seed=4, logprobs=True, top_logprobs=3,
        extra_body={"return_token_ids": True, "return_tokens_as_token_ids": True, "ignore_eos": True})
    choice = out.choices[0]
    lp = choice.logprobs.content
    ids = choice.model_dump()["token_ids"]
    assert len(lp) == 5 and [e.token for e in lp] == [f"token_id:{t}" for t in ids]
    assert all(len(e.top_logprobs) == 3 for e in lp)
    assert [e.logprob for e in lp] == choice.message.model_dump()["generation_log_probs"]


def test_api_key_is_required_when_configured(service):
    """A second app with a key, sharing the session's engine through the control-plane actor."""
    import httpx
    from ray import serve

    from rollout_service.serve.app import build_app

    cfg = service.config.model_copy(deep=True)
    cfg.service.api_key = "s3cret"
    cfg.service.num_affinity_replicas = 1
    serve.run(build_app(cfg), name="keyed", route_prefix="/keyed")
    try:
        url = f"{service.url}/keyed"
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        r = httpx.post(f"{url}/v1/chat/completions", json=body, headers={"Authorization": "Bearer wrong"}, timeout=60)
        assert r.status_code == 401
        r = httpx.post(f"{url}/v1/chat/completions", json=body, headers={"Authorization": "Bearer s3cret"}, timeout=60)
        assert r.status_code == 200 and len(r.json()["choices"][0]["message"]["generation_token_ids"]) >= 1
        assert httpx.get(f"{url}/health", timeout=60).status_code == 200  # probes need no key
        # Refused before routing or reading a body: any other path, the schema, a wrong method, a huge body.
        for method, path in (("GET", "/openapi.json"), ("GET", "/no/such/path"), ("PUT", "/v1/chat/completions")):
            r = httpx.request(method, f"{url}{path}", timeout=60)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", (method, path, r.text)
        r = httpx.post(f"{url}/v1/chat/completions", content=b"x" * (9 << 20), timeout=60)
        assert r.status_code == 401, r.text
        schema = httpx.get(f"{url}/openapi.json", headers={"Authorization": "Bearer s3cret"}, timeout=60).json()
        assert schema["components"]["securitySchemes"]["ApiKey"] == {
            "type": "http", "scheme": "bearer", "description": schema["components"]["securitySchemes"]["ApiKey"]["description"]}
        assert {"ApiKey": []} in schema["paths"]["/v1/chat/completions"]["post"]["security"]
        assert "security" not in schema["paths"]["/health"]["get"]
    finally:
        serve.delete("keyed")


def test_chat_template_kwargs_reach_the_template(http, tiny_tokenizer):
    """enable_thinking=false: the prompt closes an empty think block, and the output is content."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "no thinking"}], "max_tokens": 6, "seed": 8,
            "chat_template_kwargs": {"enable_thinking": False}, "ignore_eos": True}
    msg = http.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
    suffix = tiny_tokenizer.encode("<|im_start|>assistant\n<think>\n\n</think>\n\n", add_special_tokens=False)
    assert msg["prompt_token_ids"][-len(suffix):] == suffix
    assert msg.get("reasoning_content") is None and msg["content"]


def test_responses_stream_cut_by_max_output_tokens_ends_incomplete(openai_client):
    import uuid

    stream = openai_client.responses.create(model=MODEL, input="stream please", max_output_tokens=10, stream=True,
                                            extra_body={"seed": 2}, extra_headers={"X-Rollout-Id": f"rs-{uuid.uuid4().hex[:8]}"})
    events = list(stream)
    assert events[0].type == "response.created"
    done = events[-1]
    assert done.type == "response.incomplete" and done.response.status == "incomplete"
    assert done.response.incomplete_details.reason == "max_output_tokens"
    last = done.response.output[-1].model_dump()
    assert len(last["generation_token_ids"]) == 10 and last["rollout"]["turn"] == 1
    deltas = "".join(getattr(e, "delta", "") for e in events if e.type.endswith(".delta"))
    assert deltas  # text streamed before the final event


def test_a_client_that_disconnects_mid_stream_aborts_its_engine_request(service):
    """Dropping the HTTP stream stops the generation (the engine's in-flight count returns to 0)
    long before the 900 tokens it asked for would have been generated."""
    import time
    import uuid

    import httpx
    import ray

    from rollout_service.fleet.fleet import get_fleet, fleet_name

    fleet = get_fleet(fleet_name(service.config.service.instance_name))
    engines = ray.get(fleet.view.remote()).handles()

    def in_flight() -> int:
        return sum(ray.get([e.num_in_flight.remote() for e in engines]))

    body = {"model": MODEL, "messages": [{"role": "user", "content": "a very long story"}], "max_tokens": 900,
            "ignore_eos": True, "stream": True, "seed": 1}
    t0 = time.monotonic()
    with httpx.Client(base_url=service.url, timeout=60) as client:
        with client.stream("POST", "/v1/chat/completions", json=body,
                           headers={"X-Rollout-Id": f"gone-{uuid.uuid4().hex[:8]}"}) as r:
            assert r.status_code == 200, r.read()
            lines = []
            # The iterator is kept: a for loop's own would be collected at the break, and closing
            # it closes httpx's connection, which is the disconnect this test makes only later.
            stream = r.iter_lines()
            for line in stream:
                lines.append(line)
                # The first generated text (the role chunk before it may leave before the engine has the request).
                if '"reasoning_content":"' in line or ('"content":"' in line and '"content":""' not in line):
                    break
            assert in_flight() >= 1, (f"no engine request in flight {time.monotonic() - t0:.2f} s after the call, at "
                                      f"its first text (line {len(lines)}): {lines[-3:]}; engines {engines}; "
                                      f"fleet now {ray.get(fleet.stats.remote())}")
    deadline = time.monotonic() + 20
    while in_flight() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert in_flight() == 0
