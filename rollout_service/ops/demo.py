"""``rollout-service demo``: a multi-turn, tool-using rollout through the official ``openai`` SDK.

Prints each call, then the trainer's view of the rollout and the on-policy check: every prompt is
the previous prompt + generation + tail (no re-tokenization), and the stored logprobs match a
transformers float32 recompute of the final sequence.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": ["Paris", "London", "Tokyo"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}


def run_rollout(base_url: str, turns: int = 4, api_key: str | None = None, rollout_id: str | None = None,
                log=print) -> dict[str, Any]:
    """Drive the rollout; return {rollout_id, calls, trajectory, continuity_ok}."""
    import httpx
    import openai

    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key=api_key or "none", max_retries=2, timeout=300)
    model = client.models.list().data[0].id
    rid = rollout_id or f"demo-{uuid.uuid4().hex[:8]}"
    headers = {"X-Rollout-Id": rid}
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a weather agent. Use the tool, then answer."},
        {"role": "user", "content": "What's the weather in Paris, and should I wear skinny jeans?"},
    ]
    calls = []
    continuity_ok = True
    for turn in range(1, turns + 1):
        kwargs: dict[str, Any] = {"max_tokens": 32}
        if turn % 2 == 1:  # odd turns: force a tool call (in the model's own <tool_call> format); even: free text
            kwargs.update(tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=64)
        out = client.chat.completions.create(model=model, messages=messages, tools=[WEATHER_TOOL], seed=turn,
                                             extra_headers=headers, **kwargs)
        msg = out.choices[0].message.model_dump()
        if calls:
            prev = calls[-1]
            base = prev["prompt_token_ids"] + prev["generation_token_ids"]
            ok = msg["prompt_token_ids"][: len(base)] == base
            continuity_ok &= ok
        else:
            ok = True
        calls.append(msg)
        shown = msg["tool_calls"][0]["function"] if msg.get("tool_calls") else (msg.get("content") or msg.get("reasoning_content") or "")
        log(f"turn {turn}: prompt {len(msg['prompt_token_ids'])} ids (prefix of previous prompt+generation: {ok}), "
            f"generated {len(msg['generation_token_ids'])} ids, finish={out.choices[0].finish_reason}, "
            f"output={json.dumps(shown, ensure_ascii=False)[:100]}")
        assistant = {"role": "assistant", "content": msg.get("content") or ""}
        if msg.get("tool_calls"):
            assistant["tool_calls"] = [{"id": tc["id"], "type": "function", "function": tc["function"]} for tc in msg["tool_calls"]]
            messages.append(assistant)
            for tc in msg["tool_calls"]:
                city = json.loads(tc["function"]["arguments"]).get("city", "?")
                messages.append({"role": "tool", "tool_call_id": tc["id"], "content": f"{city}: 18 C, light rain"})
        else:
            messages += [assistant, {"role": "user", "content": "Thanks. And tomorrow?"}]
    headers_auth = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    trajectory = httpx.get(f"{base_url}/v1/rollouts/{rid}", headers=headers_auth, timeout=60).json()
    return {"rollout_id": rid, "calls": calls, "trajectory": trajectory, "continuity_ok": continuity_ok}


def logprob_parity(trajectory: dict[str, Any], model_path: str) -> tuple[int, float]:
    """Max |engine logprob - transformers float32 logprob| over free-running generated tokens."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    n, worst = 0, 0.0
    for seg in trajectory["segments"]:
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([seg["token_ids"]])).logits[0].float(), dim=-1)
        for turn in seg["turns"]:
            if turn.get("constrained"):
                continue  # sampled under a grammar (a forced call): from the masked distribution
            for pos in range(turn["gen_start"], turn["gen_end"]):
                worst = max(worst, abs(seg["logprobs"][pos] - logp[pos - 1, seg["token_ids"][pos]].item()))
                n += 1
    return n, worst


def run_demo(base_url: str = "http://127.0.0.1:8000", turns: int = 4, api_key: str | None = None) -> int:
    import httpx

    print(f"[demo] rollout against {base_url}")
    result = run_rollout(base_url, turns=turns, api_key=api_key)
    traj = result["trajectory"]
    for seg in traj["segments"]:
        gen = sum(seg["loss_mask"])
        print(f"[demo] trajectory {result['rollout_id']}: segment {seg['index']}: {len(seg['token_ids'])} ids, "
              f"{gen} generated (loss_mask=1), {len(seg['turns'])} turns, weight versions {seg['weight_versions']}")
    masked = [t for s in traj["segments"] for t, m in zip(s["token_ids"], s["loss_mask"]) if m]
    generated = [t for c in result["calls"] for t in c["generation_token_ids"]]
    exact = masked == generated
    print(f"[demo] prompt continuity (prompt_k == prompt_k-1 + gen_k-1 + tail): {result['continuity_ok']}")
    print(f"[demo] loss-masked ids == generated ids, in order: {exact}")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    root = httpx.get(f"{base_url}/v1/models", headers=headers, timeout=30).json()["data"][0]["root"]
    try:
        n, worst = logprob_parity(traj, root)
        print(f"[demo] logprob parity vs transformers float32: {n} tokens, max |Δ| = {worst:.2e} "
              f"({'OK' if worst <= 1e-4 else 'MISMATCH'})")
        parity_ok = worst <= 1e-4
    except OSError as exc:
        print(f"[demo] logprob parity skipped: model {root} is not readable here ({exc})")
        parity_ok = True
    return 0 if (result["continuity_ok"] and exact and parity_ok) else 1
