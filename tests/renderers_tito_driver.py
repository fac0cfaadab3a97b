"""Drive prime-rl's token-in client against a running rollout-service: ``renderers.client.generate``,
the function verifiers 0.4's train client (``TrainClient.get_response``) calls for every model call,
with the next turn's prompt built as TrainClient builds it, ``Renderer.bridge_to_next_turn`` over the
previous prompt + completion and the new messages (a tool result), ``X-Session-ID`` per rollout.

Run by tests/test_serve_tokens.py in a process of its own with ``PYTHONPATH`` set to the directory
scripts/setup_test_clients.sh installs renderers into. Prints JSON: per rollout, each call's prompt ids, whether
it was bridged, completion ids and logprobs, finish reason.

    python tests/renderers_tito_driver.py BASE_URL MODEL_DIR MODEL ROLLOUTS TURNS
"""

from __future__ import annotations

import asyncio
import json
import sys
import uuid

TOOLS = [{"name": "lookup", "description": "Look a word up.",
          "parameters": {"type": "object", "properties": {"word": {"type": "string"}}, "required": ["word"]}}]


async def rollout(client, renderer, model: str, index: int, turns: int) -> dict:
    from renderers.client import generate

    sid = f"renderers-{uuid.uuid4().hex[:8]}-{index}"
    messages = [{"role": "system", "content": "You look words up."},
                {"role": "user", "content": f"What does word {index} mean?"}]
    calls, prompt_ids = [], None
    for turn in range(turns):
        result = await generate(client=client, renderer=renderer, messages=messages, model=model, tools=TOOLS,
                                prompt_ids=prompt_ids, sampling_params={"max_tokens": 10, "temperature": 1.0,
                                                                        "seed": 100 * index + turn},
                                extra_headers={"X-Session-ID": sid})
        calls.append({"prompt_ids": result["prompt_ids"], "bridged": prompt_ids is not None,
                      "completion_ids": result["completion_ids"], "completion_logprobs": result["completion_logprobs"],
                      "finish_reason": result["finish_reason"]})
        tail = [{"role": "tool", "tool_call_id": f"call-{turn}", "content": f"result {turn} for word {index}"}]
        bridged = renderer.bridge_to_next_turn(result["prompt_ids"], result["completion_ids"], tail, tools=TOOLS)
        if bridged is None:  # TrainClient then renders the whole conversation again
            calls[-1]["unbridgeable"] = True
            break
        prompt_ids = list(bridged.token_ids)
        messages = messages + [{"role": "assistant", "content": result["content"] or ""}] + tail
    return {"session_id": sid, "calls": calls}


async def main(base_url: str, model_dir: str, model: str, rollouts: int, turns: int) -> list[dict]:
    from openai import AsyncOpenAI
    from renderers import Qwen3RendererConfig, create_renderer
    from transformers import AutoTokenizer

    renderer = create_renderer(AutoTokenizer.from_pretrained(model_dir), Qwen3RendererConfig())
    client = AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120)
    try:
        return await asyncio.gather(*(rollout(client, renderer, model, i, turns) for i in range(rollouts)))
    finally:
        await client.close()


if __name__ == "__main__":
    base, model_dir, model, n, t = sys.argv[1:6]
    print(json.dumps(asyncio.run(main(base, model_dir, model, int(n), int(t)))))
