"""Per-turn CPU cost of the on-policy core (build_prompt + finish_turn + apply) vs turn number.

A 200-call tool-using rollout on the project's ChatML template with the real Qwen tokenizer;
each call's request carries the whole message history (as OpenAI clients send it). Prints a
markdown table of the median CPU time at turns 1, 10, 50, 200 over --reps rollouts, plus the
cost of the naive full re-render for comparison.

    .venv/bin/python scripts/bench_turn_cost.py --reps 7
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

from rollout_service.onpolicy import ChatTemplate, RolloutState, build_prompt, finish_turn, render_message
from rollout_service.models.tiny_model import build_tokenizer

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city.",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
CHECKPOINTS = (1, 10, 50, 200)


def one_rollout(tmpl, tok, turns):
    state = RolloutState("bench")
    messages = [{"role": "system", "content": "You are a careful agent."}, {"role": "user", "content": "Plan a trip to Paris."}]
    cost, naive = {}, {}
    for k in range(1, turns + 1):
        tool_turn = k % 2 == 1
        if tool_turn:
            gen_text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
            assistant = {"role": "assistant", "content": "", "tool_calls": [
                {"id": f"c{k}", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}
        else:
            gen_text = f"Step {k}: it is sunny, so we walk along the Seine and visit museum number {k}."
            assistant = {"role": "assistant", "content": gen_text}
        gen = tok.encode(gen_text, add_special_tokens=False) + [151645]
        t0 = time.thread_time_ns()
        plan = build_prompt(state, messages, tools=TOOLS, template=tmpl)
        delta = finish_turn(state, plan, gen_ids=gen, logprobs=[-0.1] * len(gen), finish_reason="stop", assistant_message=assistant)
        delta.apply(state)
        t1 = time.thread_time_ns()
        if k in CHECKPOINTS:
            cost[k] = (t1 - t0) / 1e6
            t2 = time.thread_time_ns()
            tmpl.encode(tmpl.render([render_message(m) for m in messages], tools=TOOLS, add_generation_prompt=True))
            naive[k] = (time.thread_time_ns() - t2) / 1e6
        messages.append(assistant)
        if tool_turn:
            messages.append({"role": "tool", "tool_call_id": f"c{k}", "content": json.dumps({"city": "Paris", "sky": "sunny", "t": 20 + k % 5})})
        else:
            messages.append({"role": "user", "content": f"Good. What next after step {k}?"})
    return cost, naive, len(state.current.token_ids)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--turns", type=int, default=200)
    args = ap.parse_args()
    tok = build_tokenizer()
    tmpl = ChatTemplate(tok)
    one_rollout(tmpl, tok, 5)  # warm-up (template compile, tokenizer caches)
    runs = [one_rollout(tmpl, tok, args.turns) for _ in range(args.reps)]
    print(f"machine: {platform.machine()} {platform.processor() or ''} python {platform.python_version()}; "
          f"reps={args.reps}; final segment length {runs[0][2]} tokens")
    print("| turn | on-policy core, median CPU ms | ratio to turn 1 | naive full re-render + tokenize, ms |")
    print("|---:|---:|---:|---:|")
    base = statistics.median(r[0][1] for r in runs)
    for k in CHECKPOINTS:
        if k > args.turns:
            continue
        med = statistics.median(r[0][k] for r in runs)
        nav = statistics.median(r[1][k] for r in runs)
        print(f"| {k} | {med:.3f} | {med / base:.2f}x | {nav:.3f} |")


if __name__ == "__main__":
    main()
