"""How often does the naive baseline (re-render + re-tokenize the full history each call) feed the
model a different prompt than the on-policy core? Same generated conversations for both.

Conversations are random but seeded: sampled-looking generations (text tokenized in random pieces,
as a sampler produces them), tool calls in the model's own formatting, reasoning blocks, some turns
cut by max_tokens without the end-of-turn token. The client echoes messages the way OpenAI
clients do (parsed content / tool_calls; reasoning dropped).

    .venv/bin/python scripts/bench_naive_baseline.py --rollouts 20 --turns 20
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from rollout_service.onpolicy import ChatTemplate, RolloutState, build_prompt, finish_turn, parse_output, render_message
from rollout_service.models.tiny_model import build_tokenizer

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city.",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]}}}]
WORDS = [" Skinny", " understatement", " weather", "man", " the", " forecast", " 42", " Paris", " sunny", "!", " é", " 東京", "\n"]
SHARED = Path(__file__).resolve().parents[2] / "shared" / "chat-templates"


def sampled_ids(rng, tok, text):
    """Text tokenized in random pieces: a non-canonical tokenization, as sampling produces."""
    ids, i = [], 0
    while i < len(text):
        j = min(len(text), i + rng.randint(1, 6))
        ids += tok.encode(text[i:j], add_special_tokens=False)
        i = j
    return ids


def generation(rng, tok, thinking):
    parts = []
    if thinking and rng.random() < 0.5:
        parts.append("<think>\n" + "".join(rng.choices(WORDS, k=rng.randint(2, 8))).strip() + "\n</think>\n\n")
    if rng.random() < 0.4:
        args = {"city": rng.choice(["Paris", "Oslo"]), "days": rng.randint(1, 5)}
        if rng.random() < 0.5:
            args = dict(reversed(list(args.items())))
        sep = rng.choice(["", "\n", " "])
        body = json.dumps({"name": "get_weather", "arguments": args}, separators=rng.choice([(",", ":"), (", ", ": ")]))
        parts.append(f"<tool_call>{sep}{body}{sep}</tool_call>")
    else:
        parts.append("".join(rng.choices(WORDS, k=rng.randint(3, 12))).strip())
    cut = rng.random() < 0.15 and not parts[-1].startswith("<tool_call>")
    ids = []
    for p in parts:
        ids += sampled_ids(rng, tok, p) if not p.startswith("<") else tok.encode(p, add_special_tokens=False)
    return (ids[: max(1, len(ids) - 2)] if cut else ids + [151645]), ("length" if cut else "stop")


def run(tmpl, tok, rng, turns, kwargs, thinking):
    state, msgs = RolloutState("b"), [{"role": "user", "content": "Plan my week."}]
    differ = total = 0
    for k in range(turns):
        plan = build_prompt(state, msgs, tools=TOOLS, chat_template_kwargs=kwargs, template=tmpl)
        if k > 0:
            naive = tmpl.encode(tmpl.render([render_message(m) for m in msgs], tools=TOOLS, add_generation_prompt=True, chat_template_kwargs=kwargs))
            total += 1
            differ += naive != plan.prompt_ids
        gen, finish = generation(rng, tok, thinking)
        out = parse_output(gen, tokenizer=tok, reasoning_parser="qwen3" if thinking else None, tool_parser="hermes", tools=TOOLS)
        finish_turn(state, plan, gen_ids=gen, logprobs=[0.0] * len(gen), finish_reason=finish, assistant_message=out.to_message()).apply(state)
        msg = {"role": "assistant", "content": out.content or ""}
        if out.tool_calls:
            msg["tool_calls"] = out.tool_calls
            msgs.append(msg)
            for tc in out.tool_calls:
                msgs.append({"role": "tool", "tool_call_id": tc["id"], "name": "get_weather", "content": "sunny"})
        else:
            msgs.append(msg)
            msgs.append({"role": "user", "content": "And then?"})
    return differ, total


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rollouts", type=int, default=20)
    ap.add_argument("--turns", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    tok = build_tokenizer()
    setups = [
        ("chatml_rollout (ours), thinking", ChatTemplate(tok), {}, True),
        ("chatml_rollout (ours), drop_past_reasoning", ChatTemplate(tok), {"drop_past_reasoning": True}, True),
        ("chatml_rollout (ours), no reasoning", ChatTemplate(tok), {"enable_thinking": True}, False),
        ("qwen3-reasoning-drop", ChatTemplate(tok, (SHARED / "qwen3-reasoning-drop.jinja").read_text()), {}, True),
        ("hermes-tools", ChatTemplate(tok, (SHARED / "hermes-tools.jinja").read_text()), {}, False),
    ]
    print("| template / setting | turns compared | naive prompt differs | % |")
    print("|---|---:|---:|---:|")
    all_d = all_t = 0
    for label, tmpl, kwargs, thinking in setups:
        rng = random.Random(args.seed)
        d = t = 0
        for _ in range(args.rollouts):
            dd, tt = run(tmpl, tok, rng, args.turns, kwargs, thinking)
            d, t = d + dd, t + tt
        all_d, all_t = all_d + d, all_t + t
        print(f"| {label} | {t} | {d} | {100 * d / t:.1f} |")
    print(f"| **all** | {all_t} | {all_d} | **{100 * all_d / all_t:.1f}** |")


if __name__ == "__main__":
    main()
