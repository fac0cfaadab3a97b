"""Every client mistake is a 4xx in the OpenAI error envelope, and the rollout's history is untouched.

One table of bad requests over every route (chat completions, responses, completions, tokenize,
the rollout routes) and every extension field and header: rollout ids (X-Rollout-Id, its
X-Session-ID alias, ``metadata.rollout_id``, the path), X-History-Policy, Idempotency-Key, the
echoed token data (lengths, types, ranges, bools posing as ints), tool_choice on both dialects,
token ids on every endpoint, sampling fields, sizes. Each row is one valid request with one thing
wrong; it is sent on an existing rollout, whose stored trajectory (``GET /v1/rollouts/{id}``) must
be byte-identical afterwards. A row names its status (400 malformed, 404 unknown model / rollout,
409 conflict, 413 size, 422 idempotency key reuse) and, where they are part of the contract, the
error's ``param`` and ``code``. ``test_the_base_requests_are_valid`` shows the rows fail for their
one mistake and not for the base they share.

Rows commented "was a 500" were server errors before their fix; a failure the schema fuzzer
(tests/test_serve_fuzz.py) finds belongs here too, minimized, as its own row.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

import httpx
import pytest

from serve_helpers import MODEL


VOCAB = 151936  # max(len(tokenizer), model vocab_size) of the tiny model: ids 151669..151935 are valid outputs
DROP = object()  # a field value meaning: leave this field out of the base body
TOOL = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {}}}}
RTOOL = {"type": "function", "name": "lookup", "parameters": {"type": "object", "properties": {}}}  # Responses' flat shape
BAD_SCHEMA = {"type": "object", "properties": {"city": {"type": "no-such-type"}}}  # valid JSON, no grammar compiles it


@dataclass(frozen=True)
class Rollout:
    """A rollout with one stored call, and the pieces to build its next call from."""

    id: str
    content: str
    prompt_ids: list[int]
    gen_ids: list[int]
    logprobs: list[float]

    def echoed(self, **override) -> dict[str, Any]:
        msg = {"role": "assistant", "content": self.content, "prompt_token_ids": self.prompt_ids,
               "generation_token_ids": self.gen_ids, "generation_log_probs": self.logprobs, **override}
        return {k: v for k, v in msg.items() if v is not DROP}

    def messages(self, **echo) -> list[dict[str, Any]]:
        """The next call's messages; with ``echo`` overrides, the assistant message carries echo fields."""
        assistant = self.echoed(**echo) if echo else {"role": "assistant", "content": self.content}
        return [{"role": "user", "content": "hello"}, assistant, {"role": "user", "content": "next"}]

    def input(self, **echo) -> list[dict[str, Any]]:
        """The same next call as Responses input items."""
        assistant = {"type": "message", **self.echoed(**echo)} if echo else {
            "type": "message", "role": "assistant", "content": self.content}
        return [{"role": "user", "content": "hello"}, assistant, {"role": "user", "content": "next"}]


ROUTES: dict[str, tuple[str, str, Callable[[Rollout], dict[str, Any]] | None]] = {
    "chat": ("POST", "/v1/chat/completions", lambda r: {"model": MODEL, "messages": r.messages(), "max_tokens": 2}),
    "responses": ("POST", "/v1/responses", lambda r: {"model": MODEL, "input": r.input(), "max_output_tokens": 2}),
    "completions": ("POST", "/v1/completions", lambda r: {"model": MODEL, "prompt": [9707, 11, 1879], "max_tokens": 2}),
    "tokenize": ("POST", "/tokenize", lambda r: {"model": MODEL, "messages": r.messages()}),
    "detokenize": ("POST", "/detokenize", lambda r: {"model": MODEL, "tokens": [9707, 11]}),
}


@dataclass(frozen=True)
class Bad:
    """One bad request: the route's base body with ``fields`` merged over it (a callable gets the Rollout)."""

    route: str
    fields: dict[str, Any] | Callable[[Rollout], dict[str, Any]] = field(default_factory=dict)
    headers: dict[str, str | None] = field(default_factory=dict)  # None removes the rollout header
    status: int = 400
    param: str | None = None
    code: str | None = None
    raw: bytes | None = None  # sent as the body instead (content-type: application/json)
    path: str | None = None  # GET / DELETE on the rollout routes: "GET /v1/rollouts/..."


def _body(case: Bad, r: Rollout) -> dict[str, Any]:
    base = ROUTES[case.route][2](r)
    fields = case.fields(r) if callable(case.fields) else case.fields
    return {k: v for k, v in {**base, **fields}.items() if v is not DROP}


def _send(http: httpx.Client, case: Bad, r: Rollout) -> httpx.Response:
    headers = {"X-Rollout-Id": r.id, **case.headers}
    headers = {k: v for k, v in headers.items() if v is not None}
    if case.path is not None:
        method, path = case.path.split(" ", 1)
        return http.request(method, path, headers=headers)
    method, path, _ = ROUTES[case.route]
    if case.raw is not None:
        return http.request(method, path, content=case.raw, headers={**headers, "content-type": "application/json"})
    return http.request(method, path, json=_body(case, r), headers=headers)


def _assert_envelope(r: httpx.Response, status: int, param: str | None = None, code: str | None = None) -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json"), r.headers
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"], err
    assert isinstance(err["type"], str) and err["type"], err
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err


@pytest.fixture(scope="module")
def rollout(http) -> Rollout:
    rid = f"bad-{uuid.uuid4().hex[:8]}"
    r = http.post("/v1/chat/completions", headers={"X-Rollout-Id": rid},
                  json={"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4, "seed": 3})
    assert r.status_code == 200, r.text
    m = r.json()["choices"][0]["message"]
    return Rollout(rid, m["content"] or "", m["prompt_token_ids"], m["generation_token_ids"], m["generation_log_probs"])


def _echo_rows(route: str, name: str, echo: Callable[[Rollout], dict[str, Any]], param: str, code: str | None):
    """An echo mistake in stateless mode (the echo is the state) and on a stored rollout (still a 400)."""
    key = "input" if route == "responses" else "messages"
    build = (lambda r: {key: r.input(**echo(r))}) if route == "responses" else (lambda r: {key: r.messages(**echo(r))})
    return [
        pytest.param(Bad(route, build, param=param, code=code), id=f"{route}-echo-{name}-stored"),
        pytest.param(Bad(route, build, headers={"X-Rollout-Id": None}, param=param, code=code),
                     id=f"{route}-echo-{name}-stateless"),
    ]


G = "messages[1].generation_token_ids"
P = "messages[1].prompt_token_ids"
L = "messages[1].generation_log_probs"
ECHO_ROWS = [
    # (name, echo override, param, code): the core's InvalidEcho (code invalid_echo) or the strict edge types
    ("fewer-logprobs-than-ids", lambda r: {"generation_log_probs": r.logprobs[:-1]}, L, "invalid_echo"),
    ("more-logprobs-than-ids", lambda r: {"generation_log_probs": r.logprobs + [-0.5]}, L, "invalid_echo"),
    ("gen-id-out-of-vocab", lambda r: {"generation_token_ids": r.gen_ids[:-1] + [VOCAB]}, G, "invalid_echo"),
    ("gen-id-huge", lambda r: {"generation_token_ids": r.gen_ids[:-1] + [2**70]}, G, "invalid_echo"),
    ("gen-id-negative", lambda r: {"generation_token_ids": [-1] + r.gen_ids[1:]}, G, "invalid_echo"),
    ("prompt-id-negative", lambda r: {"prompt_token_ids": [-1] + r.prompt_ids[1:]}, P, "invalid_echo"),
    ("prompt-id-out-of-vocab", lambda r: {"prompt_token_ids": r.prompt_ids + [VOCAB + 7]}, P, "invalid_echo"),
    ("prompt-empty", lambda r: {"prompt_token_ids": []}, P, "invalid_echo"),
    ("gen-ids-without-prompt-ids", lambda r: {"prompt_token_ids": DROP}, P, "invalid_echo"),
    ("prompt-ids-without-gen-ids", lambda r: {"generation_token_ids": DROP, "generation_log_probs": DROP}, G,
     "invalid_echo"),
]
ECHO_TYPE_ROWS = [  # JSON types the chat model refuses before the core sees them (pydantic strict)
    ("gen-ids-bool", lambda r: {"generation_token_ids": [True] * len(r.gen_ids)}, G + "[0]", None),
    ("gen-ids-numeric-strings", lambda r: {"generation_token_ids": [str(t) for t in r.gen_ids]}, G + "[0]", None),
    ("gen-ids-floats", lambda r: {"generation_token_ids": [float(t) for t in r.gen_ids]}, G + "[0]", None),
    ("gen-ids-not-a-list", lambda r: {"generation_token_ids": r.gen_ids[0]}, G, None),
    ("logprobs-bool", lambda r: {"generation_log_probs": [False] * len(r.gen_ids)}, L + "[0]", None),
    ("logprobs-strings", lambda r: {"generation_log_probs": ["-0.5"] * len(r.gen_ids)}, L + "[0]", None),
]
RESPONSES_ECHO_TYPE_ROWS = [  # Responses items are plain objects: the core's own type checks answer
    ("gen-ids-bool", lambda r: {"generation_token_ids": [True] * len(r.gen_ids)}, G, "invalid_echo"),
    ("gen-ids-floats", lambda r: {"generation_token_ids": [float(t) for t in r.gen_ids]}, G, "invalid_echo"),
    ("logprobs-bool", lambda r: {"generation_log_probs": [False] * len(r.gen_ids)}, L, "invalid_echo"),
    ("logprobs-not-a-list", lambda r: {"generation_log_probs": "x"}, L, "invalid_echo"),
]


def _rows():
    rows = []
    for name, echo, param, code in ECHO_ROWS:
        for route in ("chat", "responses", "tokenize"):
            rows += _echo_rows(route, name, echo, param, code)
    for name, echo, param, code in ECHO_TYPE_ROWS:
        rows += _echo_rows("chat", name, echo, param, code)
    for name, echo, param, code in RESPONSES_ECHO_TYPE_ROWS:
        rows += _echo_rows("responses", name, echo, param, code)
    return rows


def p(case: Bad, id: str):
    return pytest.param(case, id=id)


NO_ROLLOUT = {"X-Rollout-Id": None}
ROWS = _rows() + [
    # ---------------------------------------------------------------- X-History-Policy
    *[p(Bad(route, headers={"X-History-Policy": value}, param="X-History-Policy", code="invalid_history_policy"),
        id=f"{route}-history-policy-{label}")
      for route in ("chat", "responses", "tokenize")
      for label, value in (("bogus", "bogus"), ("empty", ""), ("typo", "forks"), ("list", "fork, reject"))],
    # ---------------------------------------------------------------- rollout ids: headers, alias, body, path
    *[p(Bad(route, headers={header: value, **({} if header == "X-Rollout-Id" else NO_ROLLOUT)}, param=header,
            code="invalid_rollout_id"), id=f"{route}-{header}-{label}")
      for route in ("chat", "responses", "tokenize")
      for header in ("X-Rollout-Id", "X-Session-ID")
      for label, value in (("empty", ""), ("too-long", "r" * 300), ("empty-part", "a//b"), ("dot-part", "a/.."), ("space", "a b"),
                           ("braces", "x{y}"), ("non-ascii", "r\u00e9".encode()))],
    *[p(Bad(route, headers={"X-Rollout-Group": value}, param="X-Rollout-Group", code="invalid_rollout_id"),
        id=f"{route}-rollout-group-{label}")
      for route in ("chat", "responses", "tokenize")
      for label, value in (("empty", ""), ("too-long", "g" * 300), ("empty-part", "a//b"), ("space", "a b"))],
    *[p(Bad(route, lambda r: {"metadata": {"rollout_id": value}}, headers=NO_ROLLOUT, param="metadata.rollout_id",
            code="invalid_rollout_id"), id=f"{route}-metadata-rollout-id-{label}")
      for route in ("chat", "responses", "tokenize")
      for label, value in (("int", 5), ("null", None), ("list", ["a"]), ("object", {"id": "a"}), ("empty", ""),
                           ("too-long", "r" * 300), ("bad-chars", "a b{}"), ("bool", True))],
    *[p(Bad(route, headers={"X-Session-ID": "another-rollout"}, param="X-Session-ID"), id=f"{route}-session-id-differs")
      for route in ("chat", "responses", "tokenize")],
    p(Bad("chat", path="GET /v1/rollouts/a%20b", param="rollout_id", code="invalid_rollout_id"), id="get-rollout-bad-chars"),
    p(Bad("chat", path="GET /v1/rollouts/" + "r" * 300, param="rollout_id", code="invalid_rollout_id"),
      id="get-rollout-too-long"),
    p(Bad("chat", path="DELETE /v1/rollouts/a%7Bb%7D", param="rollout_id", code="invalid_rollout_id"),
      id="delete-rollout-bad-chars"),
    p(Bad("chat", path="DELETE /v1/rollouts/" + "r" * 300, param="rollout_id", code="invalid_rollout_id"),
      id="delete-rollout-too-long"),
    p(Bad("chat", path="GET /v1/rollouts/no-such-rollout-4711", status=404, code="rollout_not_found"),
      id="get-rollout-unknown"),
    p(Bad("chat", path="DELETE /v1/rollouts/no-such-rollout-4711", status=404, code="rollout_not_found"),
      id="delete-rollout-unknown"),
    # ---------------------------------------------------------------- Idempotency-Key
    *[p(Bad(route, headers={"Idempotency-Key": value}, param="Idempotency-Key"), id=f"{route}-idempotency-key-{label}")
      for route in ("chat", "responses")
      for label, value in (("empty", ""), ("too-long", "k" * 256))],
    # ---------------------------------------------------------------- echo fields in the wrong place
    p(Bad("chat", {"messages": [{"role": "user", "content": "x", "prompt_token_ids": [1], "generation_token_ids": [2]}]},
          headers=NO_ROLLOUT, param="messages[0].prompt_token_ids", code="invalid_echo"), id="chat-echo-on-user-message"),
    p(Bad("responses", {"input": [{"role": "user", "content": "x", "generation_token_ids": [2]}]},
          param="input[0].generation_token_ids", code="invalid_echo"), id="responses-echo-on-user-item"),
    p(Bad("responses", lambda r: {"input": r.input() + [{"type": "function_call_output", "call_id": "c", "output": "o",
                                                          "prompt_token_ids": [1]}]},
          param="input[3].prompt_token_ids", code="invalid_echo"), id="responses-echo-on-function-call-output"),
    # ---------------------------------------------------------------- tool_choice, chat
    p(Bad("chat", {"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "other"}}},
          param="tool_choice"), id="chat-tool-choice-names-a-function-not-in-tools"),
    p(Bad("chat", {"tool_choice": {"type": "function", "function": {"name": "lookup"}}}, param="tool_choice"),
      id="chat-tool-choice-named-without-tools"),
    p(Bad("chat", {"tool_choice": "required"}, param="tool_choice"), id="chat-tool-choice-required-without-tools"),
    p(Bad("chat", {"tools": [TOOL], "tool_choice": "sometimes"}, param="tool_choice"), id="chat-tool-choice-bogus-string"),
    p(Bad("chat", {"tools": [TOOL], "tool_choice": 1}, param="tool_choice"), id="chat-tool-choice-int"),
    p(Bad("chat", {"tools": [TOOL], "tool_choice": ["auto"]}, param="tool_choice"), id="chat-tool-choice-list"),
    p(Bad("chat", {"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": 5}}}, param="tool_choice"),
      id="chat-tool-choice-name-not-a-string"),
    *[p(Bad("chat", {"tools": [TOOL], "tool_choice": {"type": kind, kind: {}}}, param="tool_choice",
                code="unsupported_tool_choice"), id=f"chat-tool-choice-{kind}")
      for kind in ("file_search", "web_search", "custom", "code_interpreter")],
    p(Bad("chat", {"tools": [TOOL], "tool_choice": {"type": "allowed_tools", "allowed_tools": {
        "mode": "auto", "tools": [{"type": "function", "function": {"name": "unknown"}}]}}}, param="tool_choice"),
      id="chat-allowed-tools-names-an-unknown-tool"),
    p(Bad("chat", {"tools": [TOOL], "tool_choice": {"type": "allowed_tools", "allowed_tools": {
        "mode": "auto", "tools": [{"type": "function", "function": "lookup"}]}}}, param="tool_choice"),
      id="chat-allowed-tools-function-not-an-object"),  # was a 500 (AttributeError)
    p(Bad("chat", {"tools": [TOOL], "tool_choice": {"type": "allowed_tools", "allowed_tools": {
        "mode": "auto", "tools": ["lookup"]}}}, param="tool_choice"), id="chat-allowed-tools-entry-a-string"),
    p(Bad("chat", {"tools": [TOOL], "tool_choice": {"type": "allowed_tools", "allowed_tools": {
        "mode": "auto", "tools": []}}}, param="tool_choice"), id="chat-allowed-tools-empty"),
    p(Bad("chat", {"tools": [TOOL], "tool_choice": {"type": "allowed_tools", "allowed_tools": {
        "mode": "never", "tools": [TOOL]}}}, param="tool_choice"), id="chat-allowed-tools-bad-mode"),
    p(Bad("chat", {"tools": [TOOL], "tool_choice": {"type": "allowed_tools", "allowed_tools": {
        "mode": "auto", "tools": [{"type": "file_search"}]}}}, param="tool_choice"), id="chat-allowed-tools-hosted-tool"),
    # ---------------------------------------------------------------- tool_choice, responses
    p(Bad("responses", {"tools": [RTOOL], "tool_choice": {"type": "function", "name": "other"}}, param="tool_choice"),
      id="responses-tool-choice-names-a-function-not-in-tools"),
    p(Bad("responses", {"tool_choice": {"type": "function", "name": "lookup"}}, param="tool_choice"),
      id="responses-tool-choice-named-without-tools"),
    p(Bad("responses", {"tool_choice": "required"}, param="tool_choice"), id="responses-tool-choice-required-without-tools"),
    p(Bad("responses", {"tools": [RTOOL], "tool_choice": "sometimes"}, param="tool_choice"),
      id="responses-tool-choice-bogus-string"),
    p(Bad("responses", {"tools": [RTOOL], "tool_choice": ["auto"]}, param="tool_choice"), id="responses-tool-choice-list"),
    p(Bad("responses", {"tools": [RTOOL], "tool_choice": {"type": "function"}}, param="tool_choice"),
      id="responses-tool-choice-function-without-name"),
    *[p(Bad("responses", {"tools": [RTOOL], "tool_choice": {"type": kind}}, param="tool_choice",
                code="unsupported_tool_choice"), id=f"responses-tool-choice-{kind}")
      for kind in ("file_search", "web_search_preview", "computer_use_preview", "custom", "mcp", "image_generation")],
    p(Bad("responses", {"tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": [{"type": "function",
                                                                                            "name": "lookup"}]}},
          param="tool_choice"), id="responses-allowed-tools-without-tools"),
    p(Bad("responses", {"tools": [RTOOL], "tool_choice": {"type": "allowed_tools", "mode": "auto",
                                                          "tools": [{"type": "function", "name": "unknown"}]}},
          param="tool_choice"), id="responses-allowed-tools-names-an-unknown-tool"),
    p(Bad("responses", {"tools": [RTOOL], "tool_choice": {"type": "allowed_tools", "mode": "auto",
                                                          "tools": [{"type": "function", "function": "lookup"}]}},
          param="tool_choice"), id="responses-allowed-tools-function-not-an-object"),  # was a 500 (AttributeError)
    p(Bad("responses", {"tools": [RTOOL], "tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": "lookup"}},
          param="tool_choice"), id="responses-allowed-tools-not-a-list"),
    p(Bad("responses", {"tools": [RTOOL], "tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": []}},
          param="tool_choice"), id="responses-allowed-tools-empty"),
    p(Bad("responses", {"tools": [RTOOL], "tool_choice": {"type": "allowed_tools", "mode": ["auto"],
                                                          "tools": [{"type": "function", "name": "lookup"}]}},
          param="tool_choice"), id="responses-allowed-tools-mode-not-a-string"),
    p(Bad("responses", {"tools": [RTOOL], "tool_choice": {"type": "allowed_tools", "mode": "auto",
                                                          "tools": [{"type": "file_search"}]}},
          param="tool_choice"), id="responses-allowed-tools-hosted-tool"),
    # ---------------------------------------------------------------- tools
    p(Bad("chat", {"tools": [{"type": "custom", "custom": {"name": "x"}}]}, param="tools[0].type"), id="chat-tools-custom"),
    p(Bad("chat", {"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]},
          param="tools[0].function.parameters"), id="chat-tools-parameters-not-an-object"),
    p(Bad("chat", {"tools": [{"type": "function", "function": {"name": ""}}]}, param="tools[0].function.name"),
      id="chat-tools-empty-name"),
    p(Bad("chat", {"tools": [{"type": "function", "function": {"name": "f", "strict": "yes"}}]},
          param="tools[0].function.strict"), id="chat-tools-strict-not-a-bool"),
    p(Bad("responses", {"tools": [{"type": "file_search", "vector_store_ids": ["v"]}]}, param="tools[0]"),
      id="responses-tools-file-search"),
    p(Bad("responses", {"tools": [{"type": "function", "function": "lookup"}]}, param="tools[0].name"),
      id="responses-tools-function-a-string"),  # was a 500 (AttributeError)
    p(Bad("responses", {"tools": [{"type": "function", "name": "f", "parameters": "x"}]}, param="tools[0].parameters"),
      id="responses-tools-parameters-not-an-object"),  # was a 500 after generating (vLLM request model)
    p(Bad("responses", {"tools": [{"type": "function", "name": "f", "description": 5}]}, param="tools[0].description"),
      id="responses-tools-description-not-a-string"),  # was a 500 after generating
    p(Bad("responses", {"tools": [{"type": "function", "name": "f", "strict": "yes"}]}, param="tools[0].strict"),
      id="responses-tools-strict-not-a-bool"),
    # a forced tool call whose parameters no grammar compiles: the engine refuses it (was a 500)
    p(Bad("chat", {"tools": [{"type": "function", "function": {"name": "f", "parameters": BAD_SCHEMA}}],
                   "tool_choice": "required"}, code="engine_rejected_request"), id="chat-forced-tool-schema-uncompilable"),
    p(Bad("chat", {"tools": [{"type": "function", "function": {"name": "f", "parameters": BAD_SCHEMA}}],
                   "tool_choice": {"type": "function", "function": {"name": "f"}}, "stream": True},
          code="engine_rejected_request"), id="chat-named-tool-schema-uncompilable-streamed"),
    p(Bad("responses", {"tools": [{"type": "function", "name": "f", "parameters": BAD_SCHEMA}], "tool_choice": "required",
                        "stream": True}, code="engine_rejected_request"), id="responses-forced-tool-schema-uncompilable"),
    # ---------------------------------------------------------------- Responses input
    p(Bad("responses", {"input": []}, param="input"), id="responses-input-empty"),
    p(Bad("responses", {"input": ["x"]}, param="input"), id="responses-input-item-a-string"),
    p(Bad("responses", {"input": [{"type": "telepathy"}]}, param="input[0].type"), id="responses-input-unknown-item"),
    p(Bad("responses", {"input": [{"role": "user", "content": 5}]}, param="input[0].content"),
      id="responses-input-content-int"),
    p(Bad("responses", {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
          param="input[0].content"), id="responses-input-image"),
    p(Bad("responses", {"input": [{"type": "reasoning", "summary": [{"type": "summary_text", "text": 5}]},
                                  {"role": "user", "content": "x"}]}, param="input[0].summary"),
      id="responses-reasoning-text-not-a-string"),  # was a 500 (TypeError in join)
    p(Bad("responses", {"input": [{"role": "user", "content": "x"}, {"type": "function_call", "name": "f",
                                                                    "arguments": {}, "call_id": "c"}]},
          param="input[1].arguments"), id="responses-function-call-arguments-not-a-string"),
    p(Bad("responses", {"previous_response_id": "resp_123"}, param="previous_response_id"),
      id="responses-previous-response-id"),
    p(Bad("responses", {"instructions": 5}, param="instructions"), id="responses-instructions-int"),
    # ---------------------------------------------------------------- chat messages
    p(Bad("chat", {"messages": [{"role": "wizard", "content": "x"}]}, param="messages[0].role"), id="chat-role-unknown"),
    p(Bad("chat", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
          param="messages[0].content"), id="chat-content-image"),
    p(Bad("chat", lambda r: {"messages": r.messages() + [{"role": "tool", "tool_call_id": "c"}]}, param="messages[3]"),
      id="chat-tool-message-without-content"),
    p(Bad("chat", {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": 5}}]}, {"role": "user", "content": "y"}]},
          param="messages[1].tool_calls[0].function.arguments"), id="chat-tool-call-arguments-int"),
    p(Bad("chat", {"chat_template_kwargs": {"messages": []}}), id="chat-template-kwargs-shadow-messages"),
    p(Bad("chat", {"chat_template_kwargs": "x"}, param="chat_template_kwargs"), id="chat-template-kwargs-string"),
    # ---------------------------------------------------------------- token ids on /v1/completions
    p(Bad("completions", {"prompt": [-1]}, param="prompt"), id="completions-negative-id"),
    p(Bad("completions", {"prompt": [9707, VOCAB]}, param="prompt"), id="completions-id-out-of-vocab"),
    p(Bad("completions", {"prompt": [2**70]}, param="prompt"), id="completions-id-huge"),
    p(Bad("completions", {"prompt": []}, param="prompt"), id="completions-empty-ids"),
    p(Bad("completions", {"prompt": [[]]}, param="prompt"), id="completions-empty-nested"),
    p(Bad("completions", {"prompt": [[[1]]]}, param="prompt"), id="completions-nested-too-deep"),
    p(Bad("completions", {"prompt": [1, "a"]}, param="prompt"), id="completions-ids-and-text-mixed"),
    p(Bad("completions", {"prompt": [True, False]}, param="prompt"), id="completions-bool-ids"),
    p(Bad("completions", {"prompt": [1.0, 2.0]}, param="prompt"), id="completions-float-ids"),
    p(Bad("completions", {"prompt": ""}, param="prompt"), id="completions-empty-text"),
    p(Bad("completions", {"prompt": None}, param="prompt"), id="completions-null-prompt"),
    p(Bad("completions", {"prompt": [9707, VOCAB], "stream": True}, param="prompt"), id="completions-out-of-vocab-streamed"),
    p(Bad("completions", {"logprobs": True}, param="logprobs"), id="completions-logprobs-bool"),
    p(Bad("completions", {"logprobs": -1}, param="top_logprobs"), id="completions-logprobs-negative"),
    p(Bad("completions", {"logprobs": 21}, param="top_logprobs"), id="completions-logprobs-over-max"),
    # ---------------------------------------------------------------- stop_token_ids, every generating route
    *[p(Bad(route, {"stop_token_ids": value}, param=param), id=f"{route}-stop-token-ids-{label}")
      for route in ("chat", "responses", "completions")
      for label, value, param in (("negative", [-1], "stop_token_ids"), ("out-of-vocab", [VOCAB], "stop_token_ids"),
                                  ("huge", [2**70], "stop_token_ids"), ("bool", [True], "stop_token_ids[0]"),
                                  ("string", ["5"], "stop_token_ids[0]"), ("not-a-list", 5, "stop_token_ids"))],
    # ---------------------------------------------------------------- sampling fields: types and ranges
    *[p(Bad(route, {name: value}, param=param), id=f"{route}-{name}-{label}")
      for route in ("chat", "responses", "completions")
      for name, label, value, param in (
          ("temperature", "bool", True, "temperature"), ("temperature", "string", "0.5", "temperature"),
          ("temperature", "negative", -0.1, "temperature"), ("temperature", "too-high", 2.5, "temperature"),
          ("top_p", "zero", 0, "top_p"), ("top_p", "above-one", 1.5, "top_p"), ("top_k", "below-minus-one", -2, "top_k"),
          ("top_k", "fraction", 1.5, "top_k"), ("top_k", "bool", True, "top_k"), ("min_p", "above-one", 2, "min_p"),
          ("seed", "huge", 2**70, "body.seed"), ("seed", "string", "5", "seed"), ("n", "two", 2, "n"), ("n", "zero", 0, "n"),
          ("presence_penalty", "too-high", 3, "presence_penalty"),
          ("frequency_penalty", "too-low", -3, "frequency_penalty"),
          ("repetition_penalty", "zero", 0, "repetition_penalty"), ("stop", "int", 5, "stop"),
          ("stop", "too-many", ["a"] * 17, "stop"), ("stop", "empty-string", [""], "stop"),
          ("ignore_eos", "int", 1, "ignore_eos"), ("skip_special_tokens", "string", "no", "skip_special_tokens"),
          ("stream", "string", "yes", "stream"),
      ) if not (route in ("completions", "chat") and (name, label) == ("n", "two"))],  # both answer n choices
    p(Bad("completions", {"n": 65}, param="n"), id="completions-n-over-max"),
    p(Bad("completions", {"prompt": ["a"] * 1025}, param="prompt"), id="completions-too-many-prompts"),
    p(Bad("chat", {"logprobs": "yes"}, param="logprobs"), id="chat-logprobs-string"),
    p(Bad("chat", {"logprobs": 1}, param="logprobs"), id="chat-logprobs-int"),
    p(Bad("chat", {"logprobs": True, "top_logprobs": 21}, param="top_logprobs"), id="chat-top-logprobs-over-max"),
    p(Bad("chat", {"logprobs": True, "top_logprobs": -1}, param="top_logprobs"), id="chat-top-logprobs-negative"),
    p(Bad("chat", {"top_logprobs": 2}), id="chat-top-logprobs-without-logprobs"),
    p(Bad("chat", raw=b'{"model":"tiny-qwen3","messages":[{"role":"user","content":"x"}],"temperature":NaN}',
          param="temperature"), id="chat-temperature-nan"),
    p(Bad("chat", raw=b'{"model":"tiny-qwen3","messages":[{"role":"user","content":"x"}],"top_p":Infinity}',
          param="top_p"), id="chat-top-p-infinity"),
    # ---------------------------------------------------------------- fields the service does not honour
    # Unknown fields are accepted, but these (OpenAI's and vLLM's) would be answered as if not sent:
    # another distribution, prompt or output than asked for (each was a silent 200).
    *[p(Bad(route, {name: value}, param=name, code="unsupported_parameter"), id=f"{route}-unhonoured-{name}")
      for route in ("chat", "responses", "completions")
      for name, value in (("logit_bias", {"9707": 5}), ("min_tokens", 1), ("allowed_token_ids", [9707]),
                          ("bad_words", ["hello"]), ("best_of", 2), ("use_beam_search", True),
                          ("guided_regex", "[a-z"), ("priority", 3),
                          ("cache_salt", "tenant-a"), ("vllm_xargs", {"a": 1}), ("thinking_token_budget", 8),
                          ("spaces_between_special_tokens", False))],
    # served on chat and completions as vLLM serves them (tests/test_serve_vs_vllm.py); Responses has them not
    *[p(Bad("responses", {name: value}, param=name, code="unsupported_parameter"), id=f"responses-unhonoured-{name}")
      for name, value in (("prompt_logprobs", 1), ("include_reasoning", False),
                          ("structured_outputs", {"regex": "[a-z]+"}), ("truncate_prompt_tokens", 2))],
    # a cut prompt is not the rollout's history: refused under a rollout id (served without one)
    p(Bad("chat", {"truncate_prompt_tokens": 2}, param="truncate_prompt_tokens", code="unsupported_parameter"),
      id="chat-truncate-under-a-rollout"),
    *[p(Bad(route, fields, param=param), id=f"{route}-{label}") for route in ("chat", "completions")
      for label, fields, param in (
          ("truncate-below-minus-one", {"truncate_prompt_tokens": -2}, "body.truncate_prompt_tokens"),
          ("truncation-side-unknown", {"truncate_prompt_tokens": 2, "truncation_side": "middle"},
           "body.truncation_side"))],
    p(Bad("completions", {"structured_outputs": {"choice": ["a"], "regex": "b"}}, param="structured_outputs"),
      id="completions-structured-outputs-two-kinds"),
    p(Bad("completions", {"truncate_prompt_tokens": 0, "echo": True}), id="completions-truncate-to-nothing"),
    *[p(Bad(route, {"logprobs": logprobs, "logprob_token_ids": ids}, param="logprob_token_ids"),
        id=f"{route}-logprob-token-ids-{label}") for route, logprobs in (("chat", True), ("completions", 1))
      for label, ids in (("out-of-vocabulary", [10**7]), ("too-many", list(range(129))))],
    p(Bad("completions", {"logprob_token_ids": [1]}, param="logprob_token_ids"),
      id="completions-logprob-token-ids-without-logprobs"),
    p(Bad("completions", {"logprob_token_ids": [1], "logprobs": 1, "echo": True, "max_tokens": 0},
          param="logprob_token_ids"), id="completions-logprob-token-ids-echo-nothing-generated"),
    p(Bad("responses", {"logprob_token_ids": [1]}, param="logprob_token_ids", code="unsupported_parameter"),
      id="responses-unhonoured-logprob_token_ids"),
    p(Bad("chat", {"truncate_prompt_tokens": 0}, headers={"X-Rollout-Id": None}), id="chat-truncate-to-nothing"),
    *[p(Bad(route, fields, param="prompt_logprobs"), id=f"{route}-prompt-logprobs-{label}")
      for route in ("chat", "completions")
      for label, fields in (("below-minus-one", {"prompt_logprobs": -2}), ("over-max", {"prompt_logprobs": 21}),
                            ("string", {"prompt_logprobs": "1"}), ("streamed", {"prompt_logprobs": 1, "stream": True}))],
    *[p(Bad("chat", {name: value}, param=name, code="unsupported_parameter"), id=f"chat-unhonoured-{name}")
      for name, value in (("chat_template", "{{ messages }}"), ("documents", [{"title": "t", "text": "x"}]),
                          ("functions", [{"name": "lookup", "parameters": {}}]), ("function_call", "auto"),
                          ("modalities", ["text", "audio"]), ("audio", {"voice": "alloy", "format": "wav"}),
                          ("prediction", {"type": "content", "content": "x"}), ("web_search_options", {}))],
    # vLLM's prompt forms: served without a rollout id (tests/test_serve_vs_vllm.py), refused under one
    *[p(Bad("chat", fields, param=param, code="unsupported_parameter"), id=f"chat-{label}-under-a-rollout")
      for label, fields, param in (
          ("no-generation-prompt", {"add_generation_prompt": False}, "add_generation_prompt"),
          ("continue-final-message", {"add_generation_prompt": False, "continue_final_message": True},
           "continue_final_message"),
          ("echo", {"echo": True}, "echo"))],
    p(Bad("chat", {"add_generation_prompt": False, "required_prefix_token_ids": [151644]}, param="add_generation_prompt",
          code="unsupported_parameter", headers={"X-Rollout-Id": None}), id="chat-no-generation-prompt-with-a-prefix"),
    *[p(Bad("chat", fields, headers={"X-Rollout-Id": None}), id=f"chat-continue-final-message-{label}")
      for label, fields in (("with-generation-prompt", {"continue_final_message": True, "add_generation_prompt": True}),
                            ("with-the-default-generation-prompt", {"continue_final_message": True}))],
    *[p(Bad("completions", {name: value}, param=name, code="unsupported_parameter"), id=f"completions-unhonoured-{name}")
      for name, value in (("suffix", "x"), ("response_format", {"type": "json_object"}))],
    p(Bad("completions", {"echo": 1}, param="echo"), id="completions-echo-not-a-bool"),
    p(Bad("completions", {"echo": True, "stream": True, "logprobs": 1}, param="echo", code="unsupported_parameter"),
      id="completions-echo-logprobs-streamed"),
    *[p(Bad("responses", {name: value}, param=name, code="unsupported_parameter"), id=f"responses-unhonoured-{name}")
      for name, value in (("background", True), ("conversation", "conv_1"), ("prompt", {"id": "pmpt_1"}),
                          ("truncation", "auto"), ("max_tool_calls", 2), ("include", ["file_search_call.results"]))],
    p(Bad("responses", {"include": "reasoning.encrypted_content"}, param="include"), id="responses-include-not-a-list"),
    p(Bad("responses", {"top_logprobs": 3}, param="top_logprobs"), id="responses-top-logprobs-without-include"),
    *[p(Bad("responses", {"include": ["message.output_text.logprobs"], "top_logprobs": v}, param="top_logprobs"),
        id=f"responses-top-logprobs-{label}") for label, v in (("over-max", 21), ("negative", -1), ("string", "2"))],
    *[p(Bad("tokenize", {name: value}, param=name, code="unsupported_parameter"), id=f"tokenize-unhonoured-{name}")
      for name, value in (("chat_template", "{{ messages }}"),)],
    # vLLM's forms: served without a rollout id (tests/test_serve_vs_vllm.py), refused under one
    *[p(Bad("tokenize", fields, param=param, code="unsupported_parameter"), id=f"tokenize-{param}-under-a-rollout")
      for fields, param in (({"add_generation_prompt": False}, "add_generation_prompt"),
                            ({"add_special_tokens": True}, "add_special_tokens"),
                            ({"continue_final_message": True, "add_generation_prompt": False}, "continue_final_message"))],
    *[p(Bad("detokenize", fields, param=param, status=status), id=f"detokenize-{label}")
      for label, fields, param, status in (
          ("negative-id", {"tokens": [9707, -1]}, "tokens[1]", 400), ("id-past-int64", {"tokens": [2**63]}, "tokens[0]", 400),
          ("id-past-the-tokenizers-range", {"tokens": [9707, 2**32]}, "tokens[1]", 400),
          ("bool-id", {"tokens": [True]}, "tokens[0]", 400), ("not-a-list", {"tokens": "9707"}, "tokens", 400),
          ("no-tokens", {"tokens": DROP}, "tokens", 400), ("unknown-model", {"model": "other"}, "model", 404))],
    p(Bad("tokenize", {"continue_final_message": True}, headers={"X-Rollout-Id": None}),
      id="tokenize-continue-final-message-with-the-default-generation-prompt"),
    *[p(Bad("chat", {"reasoning_effort": v}, param="reasoning_effort"), id=f"chat-reasoning-effort-{label}")
      for label, v in (("unknown", "extreme"), ("int", 1))],
    p(Bad("responses", {"reasoning": {"effort": "extreme"}}, param="reasoning.effort"), id="responses-reasoning-effort-unknown"),
    # ---------------------------------------------------------------- max tokens: types, ranges, context
    *[p(Bad(route, {name: value}, param=param, code=code), id=f"{route}-{name}-{label}")
      for route, name in (("chat", "max_tokens"), ("chat", "max_completion_tokens"), ("responses", "max_output_tokens"),
                          ("completions", "max_tokens"))
      for label, value, param, code in (
          ("zero", 0, "max_tokens", None), ("negative", -1, "max_tokens", None), ("bool", True, name, None),
          ("string", "2", name, None), ("fraction", 2.5, name, None),
          ("beyond-context", 5000, "max_tokens", "context_length_exceeded"),
          ("huge", 10**30, "max_tokens", "context_length_exceeded"),
      )],
    # ---------------------------------------------------------------- model
    *[p(Bad(route, {"model": "gpt-9"}, status=404, param="model", code="model_not_found"), id=f"{route}-unknown-model")
      for route in ("chat", "responses", "completions", "tokenize")],
    *[p(Bad(route, {"model": 5}, param="model"), id=f"{route}-model-int") for route in ("chat", "responses", "completions")],
    *[p(Bad(route, {"model": DROP}, param="model"), id=f"{route}-model-missing") for route in ("chat", "responses", "completions")],
    # ---------------------------------------------------------------- bodies that are not a request
    *[p(Bad(route, raw=raw), id=f"{route}-body-{label}")
      for route in ("chat", "responses", "completions", "tokenize")
      for label, raw in (("not-json", b"{not json"), ("array", b"[1, 2]"), ("null", b"null"), ("string", b'"x"'),
                         ("invalid-utf8", b'{"model": "tiny-qwen3", "prompt": "\xff"}'),
                         ("nested-too-deep", b'{"metadata": {"a": ' + b"[" * 5000 + b"]" * 5000 + b"}}"))],
    # a lone UTF-16 surrogate is valid JSON but no text (was a 500: UnicodeEncodeError hashing the request)
    p(Bad("chat", raw=b'{"model":"tiny-qwen3","max_tokens":2,"messages":[{"role":"user","content":"\\ud800"}]}',
          code="invalid_unicode"), id="chat-lone-surrogate-in-content"),
    p(Bad("chat", raw=b'{"model":"\\udfff","messages":[{"role":"user","content":"x"}]}', code="invalid_unicode"),
      id="chat-lone-surrogate-in-model"),
    p(Bad("responses", raw=b'{"model":"tiny-qwen3","input":"\\ud83d"}', code="invalid_unicode"),
      id="responses-lone-surrogate"),
    p(Bad("completions", raw=b'{"model":"tiny-qwen3","prompt":"a\\udc00b"}', code="invalid_unicode"),
      id="completions-lone-surrogate"),
    p(Bad("tokenize", raw=b'{"prompt":"\\ud800"}', code="invalid_unicode"), id="tokenize-lone-surrogate"),
    p(Bad("tokenize", {"prompt": "x"}, param=None), id="tokenize-prompt-and-messages"),
    p(Bad("tokenize", {"messages": DROP}), id="tokenize-neither-prompt-nor-messages"),
    # ---------------------------------------------------------------- required_prefix_token_ids (NeMo Gym 0.7)
    *[p(Bad(route, {"required_prefix_token_ids": value}, headers=headers, param="required_prefix_token_ids",
            code="invalid_required_prefix"), id=f"{route}-required-prefix-{label}-{mode}")
      for route in ("chat", "tokenize")
      for mode, headers in (("stored", {}), ("stateless", NO_ROLLOUT))
      for label, value in (("bool", [151644, True]), ("float", [151644, 1.0]), ("numeric-string", ["151644"]),
                           ("null-entry", [151644, None]), ("negative", [151644, -1]), ("out-of-vocab", [VOCAB]),
                           ("huge", [2**70]), ("not-a-list", 151644), ("object", {"ids": [1]}))],
    *[p(Bad("responses", {"required_prefix_token_ids": value}, headers=headers, param="required_prefix_token_ids",
            code="invalid_required_prefix"), id=f"responses-required-prefix-{label}-{mode}")
      for mode, headers in (("stored", {}), ("stateless", NO_ROLLOUT))
      for label, value in (("bool", [151644, True]), ("out-of-vocab", [VOCAB]), ("not-a-list", "151644"))],
    p(Bad("tokenize", {"messages": DROP, "prompt": "hi", "required_prefix_token_ids": [151644]},
          param="required_prefix_token_ids"), id="tokenize-required-prefix-with-a-prompt"),
    # Malformed on the prompt form, where a prefix does not apply: refused as malformed, never ignored.
    *[p(Bad("tokenize", {"messages": DROP, "prompt": "hi", "required_prefix_token_ids": value},
            param="required_prefix_token_ids", code="invalid_required_prefix"),
        id=f"tokenize-prompt-form-required-prefix-{label}")
      for label, value in (("false", False), ("zero", 0), ("empty-string", ""), ("object", {}), ("bool-entry", [True]))],
    *[p(Bad(route, {"messages": [{"role": "user", "content": "x"}], "required_prefix_token_ids": [151644, 872]},
            headers=NO_ROLLOUT, param="required_prefix_token_ids", code="prefix_not_continuable"),
        id=f"{route}-required-prefix-without-assistant-message") for route in ("chat", "tokenize")],
    *[p(Bad(route, lambda r: {"messages": r.messages()[:2], "required_prefix_token_ids": r.prompt_ids + r.gen_ids},
            headers=NO_ROLLOUT, param="required_prefix_token_ids", code="prefix_not_continuable"),
        id=f"{route}-required-prefix-nothing-after-assistant") for route in ("chat", "tokenize")],
    *[p(Bad(route, lambda r: {"messages": r.messages(content=r.content),
                              "required_prefix_token_ids": r.prompt_ids + r.gen_ids[:-1]},
            headers=NO_ROLLOUT, param="required_prefix_token_ids", code="prefix_not_continuable"),
        id=f"{route}-required-prefix-differs-from-echo") for route in ("chat", "tokenize")],
    *[p(Bad(route, lambda r: {"required_prefix_token_ids": [9707] + r.prompt_ids + r.gen_ids}, status=409,
            param="required_prefix_token_ids", code="prefix_mismatch"), id=f"{route}-required-prefix-not-stored-ids")
      for route in ("chat", "tokenize")],
    # ---------------------------------------------------------------- size
    *[p(Bad(route, {"metadata": {"pad": "x" * (9 * 1024 * 1024)}}, status=413, code="request_too_large"),
        id=f"{route}-body-over-limit") for route in ("chat", "completions")],
]


@pytest.mark.parametrize("case", ROWS)
def test_a_client_mistake_is_a_4xx_envelope_and_changes_nothing(http, rollout, case: Bad):
    before = http.get(f"/v1/rollouts/{rollout.id}")
    assert before.status_code == 200
    r = _send(http, case, rollout)
    _assert_envelope(r, case.status, case.param, case.code)
    assert http.get(f"/v1/rollouts/{rollout.id}").content == before.content


def test_the_base_requests_are_valid(http, rollout):
    """The rows' shared bases succeed, so each row fails for its own mistake (fresh rollouts: the
    table's rollout stays as it was)."""
    for route in ("chat", "responses", "completions", "tokenize", "detokenize"):
        case = Bad(route)
        r = _send(http, case, Rollout(f"base-{uuid.uuid4().hex[:8]}", *(getattr(rollout, k) for k in (
            "content", "prompt_ids", "gen_ids", "logprobs"))))
        assert r.status_code == 200, (route, r.text)
    stateless = {"X-Rollout-Id": None}
    for route, key in (("chat", "messages"), ("responses", "input"), ("tokenize", "messages")):
        echo = {key: rollout.input(content=rollout.content) if key == "input" else rollout.messages(content=rollout.content)}
        r = _send(http, Bad(route, echo, headers=stateless), rollout)
        assert r.status_code == 200, (route, r.text)
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": [VOCAB - 1], "max_tokens": 1,
                                           "stop_token_ids": [VOCAB - 1]})
    assert r.status_code == 200, r.text  # the top of the vocabulary is inside it


INERT = {  # the refused fields' defaults, as clients that spell every field send them: accepted
    "chat": {"logit_bias": {}, "min_tokens": 0, "best_of": 1, "use_beam_search": False, "length_penalty": 1.0,
             "prompt_logprobs": None, "priority": 0, "include_reasoning": True, "spaces_between_special_tokens": True,
             "add_generation_prompt": True, "continue_final_message": False, "add_special_tokens": False,
             "echo": False, "chat_template": None, "functions": [], "modalities": ["text"], "bad_words": [],
             "user": "u-1", "store": False, "service_tier": "auto", "request_id": "r-1"},
    "responses": {"background": False, "truncation": "disabled", "top_logprobs": 0, "include": ["reasoning.encrypted_content"],
                  "reasoning": {"summary": "auto"}, "priority": 0, "store": False, "user": "u-1"},
    "completions": {"echo": False, "suffix": None, "best_of": 1, "min_tokens": 0, "logit_bias": None, "user": "u-1"},
    "tokenize": {"add_generation_prompt": True, "add_special_tokens": False, "chat_template": None,
                 "continue_final_message": False},
}


@pytest.mark.parametrize("route", sorted(INERT))
def test_refused_fields_at_their_defaults_are_accepted(http, route):
    r = _send(http, Bad(route, INERT[route], headers=NO_ROLLOUT), Rollout("unused", "", [], [], []))
    assert r.status_code == 200, r.text


def test_reasoning_effort_reaches_the_chat_template_as_vllm_sends_it(http, rollout):
    """``reasoning_effort`` (chat) and ``reasoning.effort`` (Responses) are template kwargs, as in
    vLLM's server: "none" turns thinking off (the template's empty think block ends the prompt), and
    an explicit ``enable_thinking`` wins."""
    think_off = http.post("/tokenize", json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                             "chat_template_kwargs": {"enable_thinking": False}}).json()["tokens"]
    think_on = http.post("/tokenize", json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}).json()["tokens"]
    assert think_off != think_on
    for route, fields, expected in (
        ("chat", {"reasoning_effort": "none"}, think_off),
        ("chat", {"reasoning_effort": "high"}, think_on),
        ("chat", {"reasoning_effort": "none", "chat_template_kwargs": {"enable_thinking": True}}, think_on),
        ("responses", {"reasoning": {"effort": "none"}}, think_off),
        ("responses", {"reasoning": {"effort": "low", "summary": "auto"}}, think_on),
    ):
        key = "messages" if route == "chat" else "input"
        body = {**_body(Bad(route), rollout), key: [{"role": "user", "content": "hi"}], **fields}
        r = http.post(ROUTES[route][1], json=body, headers={"X-Rollout-Id": f"effort-{uuid.uuid4().hex[:8]}"})
        assert r.status_code == 200, r.text
        rid = r.request.headers["x-rollout-id"]
        prompt = http.get(f"/v1/rollouts/{rid}").json()["segments"][0]["token_ids"][:len(expected)]
        assert prompt == expected, (route, fields)


def test_an_edited_history_under_reject_is_409_and_changes_nothing(http, rollout):
    before = http.get(f"/v1/rollouts/{rollout.id}").content
    edited = rollout.messages()
    edited[0] = {"role": "user", "content": "hello, edited"}
    for route, body in (("chat", {"messages": edited}),
                        ("responses", {"input": [edited[0], *rollout.input()[1:]]})):
        r = _send(http, Bad(route, body, headers={"X-History-Policy": "reject"}), rollout)
        err = _assert_envelope(r, 409, code="non_monotonic_history")
        assert err["param"].startswith("messages[0]"), err
    assert http.get(f"/v1/rollouts/{rollout.id}").content == before


def test_an_idempotency_key_reused_for_another_request_is_422_and_changes_nothing(http, rollout):
    rid = f"bad-idem-{uuid.uuid4().hex[:8]}"
    key = {"X-Rollout-Id": rid, "Idempotency-Key": f"k-{uuid.uuid4().hex}"}
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}
    assert http.post("/v1/chat/completions", json=body, headers=key).status_code == 200
    before = http.get(f"/v1/rollouts/{rid}").content
    r = http.post("/v1/chat/completions", json={**body, "max_tokens": 3}, headers=key)
    _assert_envelope(r, 422, param="Idempotency-Key", code="idempotency_key_reused")
    assert http.get(f"/v1/rollouts/{rid}").content == before
