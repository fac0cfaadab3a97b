"""A whole verifiers 0.4 environment trained through rollout-service: prime-rl's path, end to end.

A taskset and an in-process harness (this module is the plugin verifiers loads by id, so it exports
both), run by verifiers' own machinery: ``SingleAgentEnv`` over the taskset, ``env.serving()`` (its
interception server), ``env.run_slot`` per rollout, and the model reached through verifiers'
**train client** (``TrainClientConfig``: prompts rendered to token ids by renderers' Qwen3 renderer,
``POST {root}/inference/v1/generate`` with ``X-Session-ID`` = the trace id). The harness is the
agent: it talks OpenAI chat to the interception endpoint verifiers hands it (the contract a harness
program follows), several calls per rollout, offering a tool and answering each call with a follow-up
user message; the environment scores each trace with a ``@vf.reward``.

Run by tests/test_serve_verifiers_env.py in verifiers' own venv (scripts/setup_test_clients.sh makes it):

    <venv>/bin/python tests/verifiers_tito_env.py BASE_URL MODEL_DIR MODEL ROLLOUTS CALLS SEED

Prints one JSON line: per trace, its id, reward, errors, model calls and branches (token ids,
sampled mask, logprobs), for the test to compare with ``GET /v1/rollouts/{trace id}``.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys

import verifiers.v1 as vf
from verifiers.v1.runtimes import ProgramResult

TOOLS = [{"type": "function", "function": {
    "name": "lookup", "description": "Look a word up.",
    "parameters": {"type": "object", "properties": {"word": {"type": "string"}}, "required": ["word"]}}}]
CALLS_ENV = "ROLLOUT_SERVICE_PROBE_CALLS"


class ProbeTask(vf.Task):
    @vf.reward
    async def answered(self, trace) -> float:
        """1 when every call of the agent got an answer (the tiny model's text means nothing)."""
        calls = sum(len(b.calls) for b in trace.branches)
        return 1.0 if calls == int(os.environ.get(CALLS_ENV, "3")) else 0.0


class ProbeTaskset(vf.Taskset[ProbeTask]):
    def load(self):
        for i in range(64):
            yield ProbeTask(vf.TaskData(system_prompt="You look words up.", prompt=f"What does word {i} mean?"),
                            self.config.task)


class ProbeHarnessConfig(vf.HarnessConfig):
    pass


class ProbeHarness(vf.Harness[ProbeHarnessConfig]):
    """The agent loop in-process (verifiers' contract: every model call through ``endpoint``)."""

    APPENDS_SYSTEM_PROMPT = True
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, tool_interception_url=None):
        from openai import AsyncOpenAI

        system, prompt = self.resolve_prompt(data)
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
        client = AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0, timeout=120)
        try:
            for call in range(int(os.environ.get(CALLS_ENV, "3"))):
                r = await client.chat.completions.create(model=ctx.model, messages=messages, tools=TOOLS)
                msg = r.choices[0].message
                messages.append(msg.model_dump(exclude_none=True))  # the answer as given (tool calls included)
                if msg.tool_calls:  # each call gets its result, as an agent loop does
                    messages += [{"role": "tool", "tool_call_id": c.id, "content": f"meaning {call}"}
                                 for c in msg.tool_calls]
                else:
                    messages.append({"role": "user", "content": f"And word {call + 1}?"})
        finally:
            await client.close()
        return ProgramResult(exit_code=0, stdout="", stderr="")


__all__ = ["ProbeTaskset", "ProbeHarness"]


async def main(base_url: str, model_dir: str, model: str, rollouts: int, seed: int) -> list[dict]:
    from renderers import Qwen3RendererConfig

    os.environ.setdefault("ROLLOUT_SERVICE_API_KEY", "unused")
    config = vf.SingleAgentEnvConfig(
        taskset={"id": "verifiers_tito_env"},
        agent=vf.AgentConfig(runtime=vf.SubprocessConfig()))
    env = vf.SingleAgentEnv(config)
    def context(i: int) -> vf.ModelContext:  # a seed per rollout: a reproducible run, different answers
        return vf.ModelContext(
            model=model,
            client=vf.TrainClientConfig(base_url=f"{base_url}/v1", api_key_var="ROLLOUT_SERVICE_API_KEY",
                                        renderer=Qwen3RendererConfig(), renderer_model_name=model_dir),
            sampling=vf.SamplingConfig(temperature=1.0, max_tokens=8, seed=seed + i))

    tasks = list(env.taskset.take(rollouts))
    async with env.serving():
        episodes = await asyncio.gather(*(env.run_slot(slot, context(i))
                                          for i, t in enumerate(tasks) for slot in env.slots(t)))
    out = []
    for ep in episodes:
        for trace in ep.traces:
            out.append({
                "id": trace.id, "ok": trace.ok, "errors": [str(e) for e in ep.errors], "reward": trace.reward,
                "branches": [{"token_ids": b.token_ids, "sampled_mask": b.sampled_mask, "logprobs": b.logprobs,
                              "calls": len(b.calls)} for b in trace.branches]})
    return out


if __name__ == "__main__":
    base, model_dir, model, n, calls, seed = sys.argv[1:7]
    os.environ[CALLS_ENV] = calls
    print(json.dumps(asyncio.run(main(base, model_dir, model, int(n), int(seed)))))
