"""The app's own OpenAPI schema, fuzzed against the running service: no request is a 5xx, and
every answer's status and content type are ones the schema documents for the operation.

schemathesis loads ``/openapi.json`` from the live app (every route declares its body and its
headers, so the schema describes what a client may send) and, for every operation, sends requests
that fit the schema and requests that break it (negative mode: wrong types, missing and extra
fields, out-of-range values, bad headers). Every answer must be below 500, and every 4xx the
OpenAI error envelope.

Bounded: a few examples per operation and mode, one wall-clock budget for them all (examples past
it return at once); a generated call asks for at most ``MAX_TOKENS`` tokens, so a request that
happens to be valid costs little. Not derandomized: each run explores new inputs; a failure it
finds is fixed and pinned, minimized, as an explicit row of tests/test_serve_bad_input.py.
"""

from __future__ import annotations

import json
import time
import uuid

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode


# Per operation and mode: small enough that every operation is reached (at 50 examples under a 30 s
# budget the budget ran out on the fourth of fifteen operations, and the rest were never sent one).
MAX_EXAMPLES = 12
BUDGET_S = 90.0  # a guard for every operation and mode together (~30 s here): past it, the test fails
MAX_TOKENS = 4
TOKEN_FIELDS = ("max_tokens", "max_completion_tokens", "max_output_tokens")
GENERATING = ("/v1/chat/completions", "/v1/responses", "/v1/completions")
SKIP = ("/health",)  # may rightly answer 503 (not ready), and takes no input
# Sampling fields the schema types but does not bound: a generated value is nearly always out of
# range, so a steered example leaves them out to reach the turn runner and the engine.
SAMPLING = ("n", "temperature", "top_p", "top_k", "min_p", "stop", "stop_token_ids", "seed", "presence_penalty",
            "frequency_penalty", "repetition_penalty", "logprobs", "top_logprobs")
ROLLOUT_HEADERS = ("X-Rollout-Id", "X-Session-ID", "X-History-Policy", "Idempotency-Key")
VOCAB = 151936
TEXT = st.text(min_size=1, max_size=40)
MESSAGES = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]), "content": TEXT}),
                    max_size=3).map(lambda ms: ms + [{"role": "user", "content": "next"}])
# How far an example is steered towards a request the app accepts, so the fuzzer reaches past the
# edge (the schema cannot say everything the app checks): the served model's name; rollout headers
# valid (a few ids, so calls continue and fork rollouts) or absent; no unbounded sampling fields; a
# valid conversation / prompt; at most three of the other fields, so one odd field is not hidden
# behind another. Each independently, else as generated; positive mode only (a negative example
# stays as broken as it was generated).
STEER = st.fixed_dictionaries({
    "model": st.booleans(),
    "headers": st.sampled_from(["as-generated", "absent", "valid"]),
    "rollout": st.sampled_from(["a", "b", "c"]),
    "policy": st.sampled_from([None, "fork", "reject"]),
    "sampling": st.booleans(),
    "conversation": st.one_of(st.none(), MESSAGES),
    "prompt": st.one_of(TEXT, st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=8)),
    "keep": st.one_of(st.none(), st.sets(st.integers(0, 63), max_size=3)),
})
REQUIRED = ("model", "messages", "input", "prompt")


@pytest.fixture(scope="module")
def app_schema(service):
    return schemathesis.openapi.from_url(f"{service.url}/openapi.json")


def _steer(case, steer: dict | None, model: str, run: str) -> None:
    if steer is None:
        return
    if isinstance(case.body, dict):
        if steer["model"] and "model" in case.body:
            case.body["model"] = model
        if steer["sampling"]:
            for name in SAMPLING:
                case.body.pop(name, None)
        if steer["keep"] is not None:
            optional = sorted(k for k in case.body if k not in REQUIRED)
            for i, name in enumerate(optional):
                if i not in steer["keep"]:
                    del case.body[name]
        if steer["conversation"] is not None:
            path = case.operation.path
            if path in ("/v1/chat/completions", "/tokenize"):
                case.body.pop("prompt", None)
                case.body["messages"] = steer["conversation"]
            elif path == "/v1/responses":
                case.body["input"] = steer["conversation"]
            elif path == "/v1/completions":
                case.body["prompt"] = steer["prompt"]
    if steer["headers"] != "as-generated":
        case.headers = case.headers if case.headers is not None else {}
        for name in ROLLOUT_HEADERS:
            case.headers.pop(name, None)
        if steer["headers"] == "valid":
            case.headers["X-Rollout-Id"] = f"fuzz-{run}-{steer['rollout']}"
            if steer["policy"]:
                case.headers["X-History-Policy"] = steer["policy"]


def _cheap(case) -> None:
    """Cap the tokens a generated call may ask for (a larger valid count would only cost time)."""
    if case.operation.path == "/inference/v1/generate" and isinstance(case.body, dict):
        sampling = case.body.get("sampling_params")
        if isinstance(sampling, dict):  # no max_tokens there means the whole context, as on vLLM's route
            value = sampling.get("max_tokens")
            if "max_tokens" not in sampling or (type(value) is int and MAX_TOKENS < value <= 1024):
                sampling["max_tokens"] = MAX_TOKENS
        return
    if case.operation.path not in GENERATING or not isinstance(case.body, dict):
        return
    for name in TOKEN_FIELDS:
        value = case.body.get(name)
        if type(value) is int and MAX_TOKENS < value <= 1024:
            case.body[name] = MAX_TOKENS
    if not any(name in case.body for name in TOKEN_FIELDS):
        case.body["max_tokens"] = MAX_TOKENS


def _check(case, base_url: str) -> None:
    _cheap(case)
    response = case.call(base_url=base_url, timeout=120)
    where = f"{case.as_curl_command()}\n-> {response.status_code} {response.text[:2000]}"
    assert response.status_code < 500, where
    # The schema tells the truth about the answer: its status is one the operation documents, its
    # content type one documented for that status.
    documented = case.operation.definition.raw["responses"]
    assert str(response.status_code) in documented, f"undocumented status ({sorted(documented)}): {where}"
    media = (response.headers.get("content-type") or [""])[0].split(";")[0]  # schemathesis: header -> values
    assert media in documented[str(response.status_code)].get("content", {}), f"undocumented {media}: {where}"
    if response.status_code >= 400:
        try:
            err = json.loads(response.content)["error"]
        except (ValueError, KeyError, TypeError):
            raise AssertionError(f"not the OpenAI error envelope: {where}") from None
        assert set(err) == {"message", "type", "param", "code"}, where
        assert isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str), where


def test_no_request_the_schema_allows_or_breaks_is_a_server_error(app_schema, service):
    operations = [result.ok() for result in app_schema.get_all_operations()]
    labels = {f"{op.method.upper()} {op.path}" for op in operations}
    assert {"POST /v1/chat/completions", "POST /v1/responses", "POST /v1/completions", "POST /tokenize",
            "GET /v1/rollouts/{rollout_id}", "DELETE /v1/rollouts/{rollout_id}"} <= labels, labels
    model = httpx.get(f"{service.url}/v1/models").json()["data"][0]["id"]
    run = uuid.uuid4().hex[:8]
    deadline = time.monotonic() + BUDGET_S
    failures: list[str] = []
    fuzzed = 0
    for op in operations:
        if op.path in SKIP:
            continue
        for mode in (GenerationMode.NEGATIVE, GenerationMode.POSITIVE):
            if time.monotonic() >= deadline:  # past the budget Hypothesis would only generate and discard
                break
            fuzzed += 1

            @given(case=op.as_strategy(generation_mode=mode), steer=STEER if mode.is_positive else st.none())
            @settings(max_examples=MAX_EXAMPLES, deadline=None, database=None,
                      suppress_health_check=list(HealthCheck))
            def fuzz(case, steer):
                if time.monotonic() < deadline:
                    _steer(case, steer, model, run)
                    _check(case, service.url)

            try:
                fuzz()
            except Unsatisfiable:  # nothing to break: no body, only string path parameters (any string is one)
                assert mode is GenerationMode.NEGATIVE, op.path
            except Exception as exc:  # the minimized example's failure (or Flaky, when shrinking ran past the budget)
                failures.append(f"{op.method.upper()} {op.path} ({mode.value}): {exc}")
    pairs = 2 * sum(op.path not in SKIP for op in operations)
    print(f"{fuzzed} of {pairs} operation x mode pairs fuzzed in {time.monotonic() - deadline + BUDGET_S:.0f}s")
    assert not failures, "\n\n".join(failures)
    assert fuzzed == pairs, f"the {BUDGET_S:.0f}s budget ran out after {fuzzed} of {pairs} operation x mode pairs"


def test_the_schema_documents_every_error_as_the_envelope_and_no_validation_422(app_schema, service):
    """FastAPI's default 422 (its own validation-error body) is never answered here: validation errors
    are 400s with the OpenAI envelope, which every documented error status carries."""
    raw = httpx.get(f"{service.url}/openapi.json").json()
    assert "HTTPValidationError" not in json.dumps(raw)
    for path, ops in raw["paths"].items():
        for method, op in ops.items():
            errors = {s: r for s, r in op["responses"].items() if int(s) >= 400}
            assert errors, f"{method} {path} documents no error"
            for status, answer in errors.items():
                assert answer["content"] == {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}, (
                    method, path, status)
    assert set(raw["paths"]["/v1/chat/completions"]["post"]["responses"]["200"]["content"]) == {
        "application/json", "text/event-stream"}
    assert set(raw["paths"]["/rollouts/{rollout_id}/view"]["get"]["responses"]["200"]["content"]) == {"text/html"}


@pytest.mark.parametrize("method, path, allowed", [
    ("OPTIONS", "/v1/rollouts/some-id", "DELETE, GET"),  # two routes share the path: both named
    ("PUT", "/v1/chat/completions", "POST"),
    ("TRACE", "/health", "GET, HEAD"),
])
def test_an_undeclared_method_is_a_405_whose_allow_names_every_method_of_the_path(service, method, path, allowed):
    r = httpx.request(method, f"{service.url}{path}", timeout=60)
    assert r.status_code == 405 and r.headers["allow"] == allowed, (r.status_code, r.headers, r.text)
    assert r.json()["error"]["type"] == "invalid_request_error"
