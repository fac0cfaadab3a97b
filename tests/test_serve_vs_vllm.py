"""vLLM's contract, side by side: a table of requests a vLLM client sends (tests/vllm_conformance.py)
answered by vLLM 0.32's own OpenAI server (the tiny model, the service's engine settings, the
service's reasoning and tool parsers) and by the service, on the same seeds: the same status, error
``param``, and every field vLLM returns (texts and ids exactly). Each case runs on the service
without a rollout id and with one (``n > 1`` under one opens a group of rollouts, answered the same).

The two servers never generate at once: vLLM's answers first (then its server stops), then the
service's. vLLM's answers are kept outside the clone, keyed on everything they depend on (vLLM and
torch versions, the server's command line, the model's files, this table's sources): a run with the
same key reads them instead of starting vLLM's server again (``ROLLOUT_SERVICE_CACHE=off``: always
asks the server)."""

from __future__ import annotations

import json
import os
import sys
import tempfile
import uuid
from pathlib import Path

import httpx
import pytest

from serve_helpers import MODEL, WEATHER_TOOL
from vllm_conformance import Case, Outcome, differences, send

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

TITO_REQUESTS, TITO_MAX_TOKENS = 4, 12
PROMPT = "The capital of France is"
MESSAGES = [{"role": "user", "content": "Say hello to the world."}]
CONTINUED = MESSAGES + [{"role": "assistant", "content": "Hello, wor"}]
# Refused under a rollout id (400 unsupported_parameter naming the first of these the case sends).
STATELESS_ONLY = ("truncate_prompt_tokens", "continue_final_message", "add_generation_prompt", "echo",
                  "add_special_tokens")
NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}
STRICT_TOOL = {"type": "function", "function": {**WEATHER_TOOL["function"], "strict": True}}


def _probe_stop(text_per_token: list[str]) -> str:
    """A stop string that ends inside a token: the tail of one token's text and the first
    character of the next one's (vLLM cuts the text there; the ids stay whole)."""
    for i in range(1, len(text_per_token) - 1):
        a, b = text_per_token[i], text_per_token[i + 1]
        if len(a.strip()) >= 1 and len(b) >= 2 and "\ufffd" not in a + b:
            return a[-2:] + b[0]
    raise AssertionError(f"no token pair to cut inside: {text_per_token}")


def table(completion_stop: str, chat_stop: str) -> list[Case]:
    cmpl = {"prompt": PROMPT, "max_tokens": 8, "seed": 11, "temperature": 1.0}
    chat = {"messages": MESSAGES, "max_tokens": 8, "seed": 12, "temperature": 1.0, **NO_THINK}
    C, H, T, K = "/v1/completions", "/v1/chat/completions", "/inference/v1/generate", "/tokenize"
    cases = [
        Case("completion", C, cmpl),
        Case("completion_return_token_ids", C, {**cmpl, "return_token_ids": True}),
        Case("completion_logprobs_0", C, {**cmpl, "logprobs": 0}),
        Case("completion_logprobs_2", C, {**cmpl, "logprobs": 2}),
        Case("completion_logprob_token_ids", C, {**cmpl, "logprobs": 1, "logprob_token_ids": [9707, 11]}),
        Case("completion_logprob_token_ids_echo", C, {**cmpl, "logprobs": 1, "logprob_token_ids": [9707, 11, 13],
                                                      "echo": True}),
        Case("completion_logprob_token_ids_without_logprobs", C, {**cmpl, "logprob_token_ids": [9707]}),
        Case("completion_stream", C, {**cmpl, "stream": True}),
        Case("completion_stream_usage", C, {**cmpl, "stream": True, "stream_options": {"include_usage": True}}),
        Case("completion_stream_continuous_usage", C, {**cmpl, "stream": True, "stream_options": {
            "include_usage": True, "continuous_usage_stats": True}}),
        Case("completion_stream_options_without_stream", C, {**cmpl, "stream_options": {"include_usage": True}}),
        Case("completion_seed_out_of_range", C, {**cmpl, "seed": 2**64}),
        Case("completion_logit_bias_out_of_vocab", C, {**cmpl, "logit_bias": {"999999": 1}}),
        Case("completion_stop", C, {**cmpl, "temperature": 0.0, "max_tokens": 12, "stop": [completion_stop]}),
        Case("completion_stop_included", C, {**cmpl, "temperature": 0.0, "max_tokens": 12, "stop": [completion_stop],
                                             "include_stop_str_in_output": True}),
        Case("completion_stop_stream", C, {**cmpl, "temperature": 0.0, "max_tokens": 12, "stop": [completion_stop],
                                           "stream": True}),
        Case("completion_prompt_logprobs", C, {**cmpl, "prompt_logprobs": 2}),
        Case("completion_prompt_logprobs_stream", C, {**cmpl, "prompt_logprobs": 1, "stream": True}),
        Case("completion_echo", C, {**cmpl, "echo": True}),
        Case("completion_echo_logprobs", C, {**cmpl, "echo": True, "logprobs": 1}),
        Case("completion_echo_max_tokens_0", C, {**cmpl, "echo": True, "max_tokens": 0, "logprobs": 0}),
        Case("completion_echo_stream", C, {**cmpl, "echo": True, "stream": True}),
        Case("completion_echo_stream_token_ids", C, {**cmpl, "echo": True, "stream": True, "return_token_ids": True}),
        Case("completion_n", C, {**cmpl, "n": 3, "logprobs": 1}),
        Case("completion_n_stream", C, {**cmpl, "n": 2, "stream": True, "stream_options": {"include_usage": True}}),
        Case("completion_prompts", C, {**cmpl, "prompt": [PROMPT, "Once upon a time"], "n": 2}),
        Case("completion_prompts_stream", C, {**cmpl, "prompt": [[785, 6722, 315], [9707, 11]], "stream": True,
                                              "stream_options": {"include_usage": True}}),
        Case("completion_structured_choice", C, {**cmpl, "structured_outputs": {"choice": ["Paris", "London"]},
                                                 "logprobs": 1}, expect="constrained"),
        Case("completion_structured_regex_stream", C, {**cmpl, "structured_outputs": {"regex": "[a-z]{3} [0-9]{2}"},
                                                       "stream": True}, expect="constrained"),
        Case("completion_structured_two_kinds", C, {**cmpl, "structured_outputs": {"choice": ["a"], "regex": "b"}}),
        # a text prompt: vLLM 0.32's server reports the cut prompt's ids but generates from (and echoes) the
        # whole text; the service generates from the cut prompt (the same ids): checked on the ids
        Case("completion_truncate", C, {**cmpl, "truncate_prompt_tokens": 3, "return_token_ids": True},
             expect="cut_text_prompt"),
        Case("completion_truncate_ids", C, {**cmpl, "prompt": [785, 6722, 315, 9625, 374], "truncate_prompt_tokens": 3,
                                            "return_token_ids": True}),
        # (with echo, vLLM's server echoes the whole prompt's text beside the cut prompt's logprobs; the
        # service echoes the cut prompt: docs/data-plane.md)
        Case("completion_truncate_ids_right", C, {**cmpl, "prompt": [785, 6722, 315, 9625, 374], "logprobs": 1,
                                                  "truncate_prompt_tokens": 2, "truncation_side": "right"}),
        Case("completion_truncate_whole_context", C, {**cmpl, "truncate_prompt_tokens": -1}),

        Case("completion_truncate_beyond_context", C, {**cmpl, "truncate_prompt_tokens": 10**6}),
        Case("completion_truncate_below_minus_one", C, {**cmpl, "truncate_prompt_tokens": -2}),
        Case("completion_truncation_side_unknown", C, {**cmpl, "truncate_prompt_tokens": 3, "truncation_side": "mid"}),
        Case("chat", H, chat),
        # a truncated prompt is not a rollout's history: under a rollout id, 400 (docs/data-plane.md)
        Case("chat_truncate_left", H, {**chat, "truncate_prompt_tokens": 7, "truncation_side": "left",
                                       "return_token_ids": True}, expect="stateless_only"),
        Case("chat_truncate", H, {**chat, "truncate_prompt_tokens": 5}, expect="stateless_only"),
        # vLLM's prompt forms: stateless only (a prompt that is not the rollout's next history); the
        # tiny model's template keeps the final message's spacing, so the cut is right after its text
        Case("chat_continue_final", H, {**chat, "messages": CONTINUED, "add_generation_prompt": False,
                                        "continue_final_message": True}, expect="stateless_only"),
        Case("chat_continue_final_echo", H, {**chat, "messages": CONTINUED, "add_generation_prompt": False,
                                             "continue_final_message": True, "echo": True, "logprobs": True},
             expect="stateless_only"),
        Case("chat_continue_final_echo_stream", H, {**chat, "messages": CONTINUED, "add_generation_prompt": False,
                                                    "continue_final_message": True, "echo": True, "stream": True,
                                                    "stream_options": {"include_usage": True}}, expect="stateless_only"),
        Case("chat_no_generation_prompt", H, {**chat, "add_generation_prompt": False}, expect="stateless_only"),
        Case("chat_echo_of_a_user_message", H, {**chat, "echo": True}, expect="stateless_only"),
        Case("chat_continue_and_generation_prompt", H, {**chat, "messages": CONTINUED, "add_generation_prompt": True,
                                                        "continue_final_message": True}),
        Case("chat_continue_default_generation_prompt", H, {**chat, "messages": CONTINUED,
                                                            "continue_final_message": True}),
        # a message's text parts: one per line in the prompt, as vLLM joins them
        Case("chat_text_parts", H, {**chat, "messages": [{"role": "user", "content": [
            {"type": "text", "text": "Say hello"}, {"type": "text", "text": "to the world."}]}],
            "return_token_ids": True}),
        Case("chat_continue_final_text_parts_echo", H, {**chat, "messages": MESSAGES + [{"role": "assistant", "content": [
            {"type": "text", "text": "Hello,"}, {"type": "text", "text": "wor"}]}], "add_generation_prompt": False,
            "continue_final_message": True, "echo": True, "return_token_ids": True}, expect="stateless_only"),
        Case("tokenize_chat", K, {"messages": MESSAGES, "return_token_strs": True}),
        Case("tokenize_chat_no_generation_prompt", K, {"messages": MESSAGES, "add_generation_prompt": False},
             expect="stateless_only"),
        Case("tokenize_chat_continue_final", K, {"messages": CONTINUED, "add_generation_prompt": False,
                                                 "continue_final_message": True}, expect="stateless_only"),
        Case("tokenize_chat_special_tokens", K, {"messages": MESSAGES, "add_special_tokens": True},
             expect="stateless_only"),
        Case("tokenize_chat_continue_and_generation_prompt", K, {"messages": CONTINUED, "continue_final_message": True,
                                                                 "add_generation_prompt": True}),
        Case("detokenize", "/detokenize", {"tokens": [785, 6722, 315, 9625, 374]}),
        Case("detokenize_special_tokens", "/detokenize", {"tokens": [151644, 872, 198, 9707, 151645]}),
        Case("detokenize_out_of_vocabulary", "/detokenize", {"tokens": [785, 10**7]}),
        Case("chat_structured_choice", H, {**chat, "structured_outputs": {"choice": ["yes", "no"]}, "logprobs": True}),
        Case("chat_structured_json", H, {**chat, "max_tokens": 24, "structured_outputs": {"json": {
            "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}),
        Case("chat_structured_regex_stream", H, {**chat, "structured_outputs": {"regex": "[a-z]{2}-[0-9]{3}"},
                                                 "stream": True, "stream_options": {"include_usage": True}}),
        Case("chat_structured_two_kinds", H, {**chat, "structured_outputs": {"choice": ["a"], "regex": "b"}}),
        # under a rollout id: a group of rollouts (R/0, R/1, ...), answered as vLLM answers n
        Case("chat_n", H, {**chat, "n": 3, "logprobs": True}),
        Case("chat_n_stream", H, {**chat, "n": 2, "stream": True, "stream_options": {"include_usage": True}}),
        Case("chat_prompt_logprobs", H, {**chat, "prompt_logprobs": 1}),
        Case("chat_thinking", H, {**chat, "chat_template_kwargs": {"enable_thinking": True}, "max_tokens": 12}),
        Case("chat_thinking_stream", H, {**chat, "chat_template_kwargs": {"enable_thinking": True}, "max_tokens": 12,
                                         "stream": True, "stream_options": {"include_usage": True}}),
        Case("chat_hidden_reasoning", H, {**chat, "chat_template_kwargs": {"enable_thinking": True},
                                          "include_reasoning": False, "logprobs": True, "max_tokens": 12}),
        Case("chat_logprobs", H, {**chat, "logprobs": True, "top_logprobs": 2}),
        Case("chat_logprob_token_ids", H, {**chat, "logprobs": True, "logprob_token_ids": [9707, 11, 13]}),
        Case("chat_stream_logprob_token_ids", H, {**chat, "logprobs": True, "logprob_token_ids": [9707, 0],
                                                  "stream": True}),
        Case("chat_logprob_token_ids_without_logprobs", H, {**chat, "logprob_token_ids": [9707]}),
        Case("chat_stream_usage", H, {**chat, "stream": True, "stream_options": {"include_usage": True}}),
        Case("chat_stream_logprobs", H, {**chat, "stream": True, "logprobs": True, "top_logprobs": 2}),
        Case("chat_stream_continuous_usage", H, {**chat, "stream": True, "stream_options": {
            "include_usage": True, "continuous_usage_stats": True}}),
        Case("chat_thinking_stream_continuous_usage", H, {**chat, "chat_template_kwargs": {"enable_thinking": True},
                                                          "max_tokens": 12, "stream": True, "stream_options": {
                                                              "include_usage": True, "continuous_usage_stats": True}}),
        Case("chat_stream_options_without_stream", H, {**chat, "stream_options": {"include_usage": True}}),
        Case("chat_stop", H, {**chat, "temperature": 0.0, "max_tokens": 12, "stop": [chat_stop]}),
        Case("chat_stop_included", H, {**chat, "temperature": 0.0, "max_tokens": 12, "stop": [chat_stop],
                                       "include_stop_str_in_output": True}),
        Case("chat_stop_stream", H, {**chat, "temperature": 0.0, "max_tokens": 12, "stop": [chat_stop], "stream": True}),
        # A forced call: the service samples it under a compact grammar (engine.compact_structured_json:
        # at most one whitespace character in a row inside the call; vLLM's leaves it unbounded and the
        # tiny model fills it), so the generations differ: vLLM's rules for a forced call are checked, and the cut
        # call (before any whitespace) exactly.
        Case("chat_tool_required", H, {**chat, "max_tokens": 64, "tools": [STRICT_TOOL], "tool_choice": "required",
                                       "parallel_tool_calls": False}, expect="forced_call"),
        Case("chat_tool_named", H, {**chat, "max_tokens": 64, "tools": [STRICT_TOOL],
                                    "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
             expect="forced_call"),
        Case("chat_tool_required_cut", H, {**chat, "max_tokens": 6, "tools": [STRICT_TOOL], "tool_choice": "required"}),
        # the token route's n (under a rollout id: a group, as chat's). Without logprobs: the route's
        # logprob entries differ from vLLM's in rank and token (test_the_token_route_answers_as_vllms_own
        # compares their ids and values)
        Case("tokens_n", T, {"token_ids": [785, 6722, 315, 9625, 374], "return_token_ids": True, "sampling_params": {
            "n": 3, "seed": 5, "max_tokens": 8, "temperature": 1.0}}),
        Case("tokens_n_stream", T, {"token_ids": [785, 6722, 315], "stream": True, "stream_options": {
            "include_usage": True}, "sampling_params": {"n": 2, "seed": 6, "max_tokens": 6, "ignore_eos": True}}),
    ]
    return cases


CASE_NAMES = [c.name for c in table("x", "y")]


def _reference_cache(server_cmd: list[str], port: int, model_dir: Path) -> Path | None:
    """Where vLLM's answers to this table are kept between runs (like the client venvs, outside the
    clone: ``$ROLLOUT_SERVICE_CACHE/vllm-reference/<key>.json``; ``ROLLOUT_SERVICE_CACHE=off``: never).
    The key covers everything those answers are a function of: the versions of vLLM and of what it
    renders, tokenizes and samples with, the environment its server inherits (``VLLM_*``, thread
    counts), the server's command line (its port aside), the model's files, and the sources of the
    table, of the requests sent and of the server's start. Any change to one of them asks vLLM's server again."""
    import hashlib
    from importlib.metadata import PackageNotFoundError, version

    root = os.environ.get("ROLLOUT_SERVICE_CACHE", str(Path.home() / ".cache" / "rollout-service"))
    if root == "off":
        return None
    h = hashlib.sha256()
    here, scripts = Path(__file__).resolve().parent, Path(__file__).resolve().parents[1] / "scripts"
    cmd = [a.replace(str(model_dir), "<model>") for a in server_cmd[1:] if a != str(port)]
    # What renders, tokenizes, samples and constrains on vLLM's side, and the environment its server inherits.
    def installed(dist: str) -> str:
        try:
            return version(dist)
        except PackageNotFoundError:
            return "-"

    import vllm

    versions = [vllm.__version__] + [f"{d}={installed(d)}" for d in ("torch", "transformers", "tokenizers", "jinja2",
                                                                      "xgrammar")]
    env = sorted((k, v) for k, v in os.environ.items() if k.startswith(("VLLM_", "OMP_", "MKL_", "TOKENIZERS_")))
    for part in (json.dumps(versions), json.dumps(env), json.dumps(cmd)):
        h.update(part.encode() + b"\0")
    for path in [Path(__file__), here / "vllm_conformance.py", here / "serve_helpers.py", scripts / "compare_tito_vllm.py",
                 scripts / "bench_service_vs_vllm.py", *sorted(p for p in model_dir.rglob("*") if p.is_file())]:
        h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return Path(root).expanduser() / "vllm-reference" / f"{h.hexdigest()[:32]}.json"


@pytest.fixture(scope="module")
def vllm_side(service, tiny_model_dir, tiny_tokenizer):
    """vLLM's answers to the table (and the stop strings probed from its greedy output), from vLLM's
    own server, or from a run of it on the same inputs (``_reference_cache``)."""
    from bench_service_vs_vllm import SERVED_NAME, VLLMServer
    from compare_tito_vllm import requests, run_all

    cfg = service.config
    with tempfile.TemporaryDirectory(prefix="vllm-contract-") as tmp:
        server = VLLMServer(cfg.engine, str(tiny_model_dir), Path(tmp) / "vllm.log")
        # --enable-scale-out: vLLM's token-in-token-out route too (the TITO test below shares this server)
        server.cmd += ["--enable-auto-tool-choice", "--tool-call-parser", cfg.chat.tool_parser, "--enable-scale-out"]
        cache = _reference_cache(server.cmd, server.port, Path(tiny_model_dir))
        if cache is not None and cache.exists():
            data = json.loads(cache.read_text())
            print(f"vLLM's answers from {cache} (a run of its server on these exact inputs)")
            return ({c.name: c for c in table(*data["stops"])}, {k: Outcome(**v) for k, v in data["answers"].items()},
                    data["tito"])
        try:
            server.start(timeout=300)
            stops = []
            for path, body in (("/v1/completions", {"prompt": PROMPT}),
                               ("/v1/chat/completions", {"messages": MESSAGES, **NO_THINK})):
                probe = send(server.url, SERVED_NAME, Case("probe", path, {**body, "max_tokens": 12, "temperature": 0.0,
                                                                           "return_token_ids": True}))
                ids = probe.body["choices"][0]["token_ids"]
                stops.append(_probe_stop([tiny_tokenizer.decode([t]) for t in ids]))
            cases = {c.name: c for c in table(*stops)}
            answers = {name: send(server.url, SERVED_NAME, case) for name, case in cases.items()}
            tito = run_all(server.url, SERVED_NAME, requests(TITO_REQUESTS, TITO_MAX_TOKENS))
        finally:
            server.stop()
        # Kept only when vLLM answered every case as a server does (no 5xx), written whole or not at all.
        if cache is not None and all(a.status < 500 for a in answers.values()):
            cache.parent.mkdir(parents=True, exist_ok=True)
            part = cache.with_suffix(f".{os.getpid()}.part")
            part.write_text(json.dumps({"stops": stops, "answers": {k: vars(v) for k, v in answers.items()},
                                        "tito": tito}))
            part.replace(cache)
    return cases, answers, tito


@pytest.mark.parametrize("under_rollout", [False, True], ids=["plain", "rollout"])
@pytest.mark.parametrize("name", CASE_NAMES)
def test_the_service_answers_as_vllms_own_server(service, vllm_side, name, under_rollout):
    cases, answers, _ = vllm_side
    case = cases[name]
    if under_rollout:
        case = Case(case.name, case.path, case.body, {**case.headers, "X-Rollout-Id": f"contract-{uuid.uuid4().hex[:12]}"},
                    case.expect)
    ours = send(service.url, MODEL, case)
    n = case.body.get("n") or case.body.get("sampling_params", {}).get("n", 1)
    if under_rollout and n > 1 and ours.status == 200 and case.path != "/v1/completions":  # each choice its own rollout
        rid = case.headers["X-Rollout-Id"]
        if not case.body.get("stream") and case.path != "/inference/v1/generate":
            assert [c["message"]["rollout"]["id"] for c in ours.body["choices"]] == [f"{rid}/{j}" for j in range(n)]
        group = httpx.get(f"{service.url}/v1/groups/{rid}").json()
        assert [m["id"] for m in group["members"]] == [f"{rid}/{j}" for j in range(n)], group
    if case.expect == "forced_call":
        named = isinstance(case.body["tool_choice"], dict)
        assert answers[name].status == ours.status == 200, ours.body
        choice = ours.body["choices"][0]
        assert choice["message"]["content"] == "" and choice["message"]["tool_calls"], choice
        assert {c["function"]["name"] for c in choice["message"]["tool_calls"]} == {"get_weather"}
        assert choice["finish_reason"] == ("stop" if named else "tool_calls"), choice
        return
    if case.expect == "stateless_only" and under_rollout:
        param = next(p for p in STATELESS_ONLY if p in case.body)
        assert ours.status == 400 and ours.error["param"] == param, ours.body
        assert ours.error["code"] == "unsupported_parameter"
        return
    if case.expect == "cut_text_prompt":
        assert answers[name].status == ours.status == 200, ours.body
        theirs = answers[name].body["choices"][0]
        assert ours.body["choices"][0]["prompt_token_ids"] == theirs["prompt_token_ids"]
        assert ours.body["usage"]["prompt_tokens"] == answers[name].body["usage"]["prompt_tokens"]
        return
    if case.expect == "constrained":
        import re

        assert answers[name].status == ours.status == 200, ours.body
        spec = case.body["structured_outputs"]
        if ours.chunks is not None:
            text = "".join(c["choices"][0]["text"] for c in ours.chunks if c.get("choices"))
        else:
            text = ours.body["choices"][0]["text"]
            assert len(ours.body["choices"][0]["logprobs"]["tokens"]) == ours.body["usage"]["completion_tokens"]
        assert text in spec["choice"] if "choice" in spec else re.fullmatch(spec["regex"], text), text
        return
    diffs = differences(answers[name], ours)
    assert not diffs, "\n".join(diffs)


def test_a_stop_string_cuts_the_text_not_the_recorded_turn(service, http, vllm_side, tiny_tokenizer):
    """Under a rollout id the answer's text is vLLM's (cut before the stop string, inside a token),
    the stored turn keeps every sampled id and marks the cut, and the next call, which sends the cut
    text back, continues the rollout monotonically on those ids."""
    cases, _, _ = vllm_side
    body = dict(cases["chat_stop"].body, model=MODEL)
    stop = body["stop"][0]
    rid = f"stop-{uuid.uuid4().hex[:12]}"
    first = http.post("/v1/chat/completions", json=body, headers={"X-Rollout-Id": rid}).json()
    choice = first["choices"][0]
    ids = choice["message"]["generation_token_ids"]
    whole = tiny_tokenizer.decode(ids, skip_special_tokens=True)
    assert choice["stop_reason"] == stop and choice["finish_reason"] == "stop"
    assert stop in whole and not choice["message"]["content"].endswith(stop)
    assert whole.startswith(choice["message"]["content"]) and len(whole) > len(choice["message"]["content"]) + len(stop) - 1
    turn = http.get(f"/v1/rollouts/{rid}").json()["segments"][0]["turns"][0]
    assert turn["answer"]["text_cut"] == {"stop": stop, "included": False}
    messages = body["messages"] + [{"role": "assistant", "content": choice["message"]["content"]},
                                   {"role": "user", "content": "And again."}]
    second = http.post("/v1/chat/completions", json={**body, "messages": messages, "stop": None},
                       headers={"X-Rollout-Id": rid}).json()
    assert second["choices"][0]["message"]["rollout"]["monotonic"] is True
    prompt = second["choices"][0]["message"]["prompt_token_ids"]
    assert prompt[len(first["choices"][0]["message"]["prompt_token_ids"]):][:len(ids)] == ids


def test_the_token_route_answers_as_vllms_own(service, vllm_side):
    """The token-in-token-out route against vLLM's own (``POST /inference/v1/generate``, the same
    server): the same requests (each with its seed, streamed and not, temperatures and top_p that
    differ, 1-3 alternatives) give the same ids bit for bit, the same logprobs within 1e-6 and the
    same alternatives. scripts/compare_tito_vllm.py is the longer run."""
    from compare_tito_vllm import requests, run_all

    reqs = requests(TITO_REQUESTS, TITO_MAX_TOKENS)
    theirs = [tuple(t) for t in vllm_side[2]]
    ours = run_all(service.url, MODEL, reqs)
    assert {r["stream"] for r in reqs} == {True, False}
    for body, (ids_v, lps_v, tops_v), (ids_s, lps_s, tops_s) in zip(reqs, theirs, ours):
        assert len(ids_v) == TITO_MAX_TOKENS
        assert ids_s == ids_v, body
        assert lps_s == pytest.approx(lps_v, abs=1e-6), body
        assert [[t for t, _ in row] for row in tops_s] == [[t for t, _ in row] for row in tops_v], body
        assert all(len(row) >= 1 for row in tops_v)
        assert [lp for row in tops_s for _, lp in row] == pytest.approx([lp for row in tops_v for _, lp in row], abs=1e-6)
