"""UK AISI's inspect-ai driving multi-turn conversations through rollout-service, as a user points it
at a vLLM server: inspect's own ``vllm`` provider with ``base_url`` (an existing server), its own
``ChatMessage`` history (each answer appended as inspect parsed it), its own re-serialization of
that history on every call.

The tiny model's answers are reasoning-only under the default chat template (thinking on: the text
it samples is reasoning, ``content`` null). inspect keeps such an answer as ``[ContentReasoning,
ContentText("")]`` and sends it back as ``content: "\\n"`` with the reasoning beside it: the case of
the service's edge-whitespace rule. Three conversations:

- ``thinking``: 3 calls, each answer re-sent as inspect re-serializes it;
- ``plain`` and ``inner``: thinking off (``chat_template_kwargs``), so the answers are content; the
  same first call (same seed), then ``plain`` re-sends the answer as inspect does (unchanged) and
  ``inner`` with the whitespace inside its content changed (one run of whitespace doubled).

Run by tests/test_serve_inspect_ai.py in inspect-ai's own venv (scripts/setup_test_clients.sh makes it):

    <venv>/bin/python tests/inspect_ai_thinking.py BASE_URL MODEL SEED

Prints one JSON line: per conversation, its rollout id and per call what inspect sent as the past
answers' content, what it got (content, reasoning, the logprobs it parsed).
"""

from __future__ import annotations

import asyncio
import json
import re
import sys
import uuid

from inspect_ai.model import ChatMessageAssistant, ChatMessageUser, GenerateConfig, get_model

FOLLOW_UPS = ["Think about a number.", "And another one?", "One more."]


def _changed_inside(text: str) -> str:
    """The text with its first run of whitespace between two non-space characters doubled."""
    m = re.search(r"(?<=\S)\s+(?=\S)", text)
    if m is None:
        raise SystemExit(f"no whitespace inside {text!r} to change (pick another seed)")
    return text[:m.start()] + m.group(0) * 2 + text[m.end():]


async def _conversation(model, wire: list, seed: int, calls: int, extra_body: dict | None, edit=None) -> dict:
    rid = f"inspect-{uuid.uuid4().hex[:12]}"
    config = GenerateConfig(max_tokens=8, seed=seed, logprobs=True, extra_headers={"X-Rollout-Id": rid},
                            extra_body=extra_body, max_retries=0, timeout=120)
    messages = []
    record = []
    for i in range(calls):
        messages.append(ChatMessageUser(content=FOLLOW_UPS[i]))
        out = await model.generate(messages, config=config)
        if out.error:
            raise SystemExit(f"call {i}: {out.error}")
        assert len(wire) == 1, f"call {i}: {len(wire)} requests sent"
        sent = wire.pop()["messages"]  # the body inspect sent for this call
        message: ChatMessageAssistant = out.message
        reasoning = [c.reasoning for c in message.content if c.type == "reasoning"] if isinstance(
            message.content, list) else []
        lp = out.choices[0].logprobs
        record.append({
            "sent_assistants": [m for m in sent if m["role"] == "assistant"],
            "content": message.text,
            "reasoning": reasoning[0] if reasoning else None,
            "logprobs": [t.logprob for t in lp.content] if lp else None,
        })
        if edit is not None and i == 0:
            message = ChatMessageAssistant(content=edit(message.text), model=message.model, source="generate")
        messages.append(message)
    return {"id": rid, "calls": record}


async def main(base_url: str, model_name: str, seed: int) -> None:
    model = get_model(f"vllm/{model_name}", base_url=f"{base_url}/v1", api_key="unused", lazy_init=False)
    model.api.client.max_retries = 0  # the OpenAI SDK's own retries too: one request per call
    wire: list[dict] = []

    async def capture(request) -> None:
        if request.url.path.endswith("/chat/completions"):
            wire.append(json.loads(request.content))

    model.api.http_client.event_hooks["request"].append(capture)  # the provider's own httpx client
    no_thinking = {"chat_template_kwargs": {"enable_thinking": False}}
    result = {
        "thinking": await _conversation(model, wire, seed, 3, None),
        "plain": await _conversation(model, wire, seed, 2, no_thinking),
        "inner": await _conversation(model, wire, seed, 2, no_thinking, edit=_changed_inside),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3])))
