"""chat.chat_template over HTTP: an app serving the model with a template other than its tokenizer's.

A second app (own route prefix, same engine: chat_template does not restart the fleet) serves the
tiny model with the shared Hermes tools template (../shared/chat-templates, read from there). A
tool rollout must be exactly on-policy under that template, /tokenize must return the ids that
template renders (not the tokenizer's), and a template that cannot express tools must give the
documented 400.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from serve_helpers import MODEL, WEATHER_TOOL, echo_assistant


SHARED_TEMPLATES = Path(__file__).resolve().parents[2] / "shared" / "chat-templates"
HERMES = SHARED_TEMPLATES / "hermes-tools.jinja"
NO_TOOLS = SHARED_TEMPLATES / "gemma-it.jinja"
FORCED = {"type": "function", "function": {"name": "get_weather"}}


def _deploy(service, name: str, chat_template: str):
    from ray import serve

    from rollout_service.serve.app import build_app

    cfg = service.config.model_copy(deep=True)
    cfg.chat.chat_template = chat_template
    cfg.service.num_affinity_replicas = 1
    serve.run(build_app(cfg), name=name, route_prefix=f"/{name}")
    return f"{service.url}/{name}"


@pytest.fixture(scope="module")
def hermes_app(service):
    from ray import serve

    url = _deploy(service, "tmpl-hermes", str(HERMES))
    yield url
    serve.delete("tmpl-hermes")


def _hermes_template(tokenizer):
    from rollout_service.onpolicy import ChatTemplate

    return ChatTemplate(tokenizer, HERMES.read_text(), name="hermes-tools")


def test_config_rejects_a_missing_template_path_and_reads_inline_jinja():
    from pydantic import ValidationError

    from rollout_service.config import ChatConfig

    with pytest.raises(ValidationError, match="neither an existing file nor inline Jinja"):
        ChatConfig(chat_template="/no/such/template.jinja")
    inline = "{% for m in messages %}{{ m.content }}{% endfor %}"
    assert ChatConfig(chat_template=inline).resolved_chat_template() == inline
    assert ChatConfig(chat_template=str(HERMES)).resolved_chat_template() == HERMES.read_text()
    assert ChatConfig().resolved_chat_template() is None


def test_template_and_parser_fields_are_not_engine_fields_and_the_old_names_still_work():
    """The engines never read them, so they are not in engine.* (whose every change restarts the
    engines); the old engine.* names are accepted for one release, with a warning."""
    import warnings

    from rollout_service.config import MOVED_TO_CHAT, ChatConfig, EngineConfig, RolloutServiceConfig

    assert set(MOVED_TO_CHAT) <= set(ChatConfig.model_fields) and not set(MOVED_TO_CHAT) & set(EngineConfig.model_fields)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = RolloutServiceConfig.model_validate({"engine": {"tool_parser": None, "chat_template": str(HERMES),
                                                              "max_num_seqs": 4}})
    assert cfg.chat.tool_parser is None and cfg.chat.chat_template == str(HERMES) and cfg.engine.max_num_seqs == 4
    assert any(issubclass(w.category, FutureWarning) and "moved to chat" in str(w.message) for w in caught)
    with pytest.raises(ValueError, match="both as engine"):
        RolloutServiceConfig.model_validate({"engine": {"tool_parser": None}, "chat": {"tool_parser": "hermes"}})


def test_tool_rollout_under_a_configured_template_is_exactly_on_policy(service, hermes_app, http, tiny_tokenizer):
    import httpx

    tmpl = _hermes_template(tiny_tokenizer)
    rid = f"tmpl-{uuid.uuid4().hex[:8]}"
    headers = {"X-Rollout-Id": rid}
    tools = [WEATHER_TOOL]
    messages = [{"role": "system", "content": "You are a weather agent."},
                {"role": "user", "content": "What's the weather in Paris?"}]
    # Turn 1 and 2 forced tool calls (answered by tool messages), turn 3 free and cut by max_tokens.
    plan = [{"tool_choice": FORCED, "max_tokens": 40}, {"tool_choice": FORCED, "max_tokens": 40}, {"max_tokens": 8}]
    with httpx.Client(base_url=hermes_app, timeout=120) as client:
        # A fresh prompt is the configured template's render, not the tokenizer's.
        first = client.post("/tokenize", json={"model": MODEL, "messages": messages, "tools": tools}).json()
        assert first["tokens"] == tmpl.prompt_ids(messages, tools=tools, chat_template_kwargs={})
        default = http.post("/tokenize", json={"model": MODEL, "messages": messages, "tools": tools}).json()
        assert default["tokens"] != first["tokens"]

        prev, expected_next = None, first["tokens"]
        for turn, kwargs in enumerate(plan, start=1):
            r = client.post("/v1/chat/completions", headers=headers, json={
                "model": MODEL, "messages": messages, "tools": tools, "seed": turn, **kwargs})
            assert r.status_code == 200, r.text
            msg = r.json()["choices"][0]["message"]
            assert msg["rollout"]["turn"] == turn and msg["rollout"]["segment"] == 0
            # /tokenize announced exactly the prompt this call used.
            assert msg["prompt_token_ids"] == expected_next
            if prev is not None:
                assert msg["rollout"]["monotonic"] is True
                base = prev["prompt_token_ids"] + prev["generation_token_ids"]
                assert msg["prompt_token_ids"][: len(base)] == base, "previous prompt + generation is not a prefix"
                # The tail is the configured template's: a Hermes tool response, not ChatML's user turn.
                tail = tiny_tokenizer.decode(msg["prompt_token_ids"][len(base):])
                assert "<tool_response>" in tail and '"name": "get_weather"' in tail
                assert tail.endswith("<|im_start|>assistant\n")
            assert msg["tool_calls"] if "tool_choice" in kwargs else True
            prev = msg
            messages.append(echo_assistant(msg))
            if turn == len(plan):
                break
            messages += [{"role": "tool", "tool_call_id": tc["id"], "name": tc["function"]["name"],
                          "content": f"sunny, {20 + i} C"} for i, tc in enumerate(msg["tool_calls"])]
            tok = client.post("/tokenize", headers=headers, json={"model": MODEL, "messages": messages,
                                                                  "tools": tools}).json()
            expected_next = tok["tokens"]
            # ... and they differ from what the default-template app would render for this conversation.
            fresh = http.post("/tokenize", json={"model": MODEL, "messages": messages, "tools": tools}).json()
            assert fresh["tokens"] != expected_next

        traj = client.get(f"/v1/rollouts/{rid}").json()
        seg = traj["segments"][0]
        assert len(traj["segments"]) == 1 and len(seg["turns"]) == len(plan)
        masked = [t for t, m in zip(seg["token_ids"], seg["loss_mask"]) if m]
        assert seg["token_ids"][: len(prev["prompt_token_ids"])] == prev["prompt_token_ids"]
        assert masked[-len(prev["generation_token_ids"]):] == prev["generation_token_ids"]

        # The template's documented refusal: a tool message without `name` cannot be expressed.
        nameless = messages[:-1] + [{"role": "user", "content": "and London?"}]
        nameless[3] = {k: v for k, v in nameless[3].items() if k != "name"}
        r = client.post("/v1/chat/completions", json={"model": MODEL, "messages": nameless, "tools": tools,
                                                      "max_tokens": 2})
        assert r.status_code == 400 and "hermes-tools.jinja" in r.json()["error"]["message"], r.text


def test_template_that_cannot_express_tools_is_a_documented_400(service):
    import httpx
    from ray import serve

    url = _deploy(service, "tmpl-notools", str(NO_TOOLS))
    try:
        messages = [{"role": "user", "content": "What's the weather in Paris?"}]
        with httpx.Client(base_url=url, timeout=120) as client:
            r = client.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 2})
            assert r.status_code == 200, r.text  # plain chat is fine under it
            r = client.post("/v1/chat/completions", json={"model": MODEL, "messages": messages,
                                                          "tools": [WEATHER_TOOL], "max_tokens": 2})
            assert r.status_code == 400, r.text
            assert "gemma-it.jinja" in r.json()["error"]["message"]
            assert "does not render tools" in r.json()["error"]["message"]
            r = client.post("/tokenize", json={"model": MODEL, "messages": messages, "tools": [WEATHER_TOOL]})
            assert r.status_code == 400, r.text
    finally:
        serve.delete("tmpl-notools")
