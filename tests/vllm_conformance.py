"""The side-by-side table of tests/test_serve_vs_vllm.py: requests a vLLM client sends, sent to vLLM
0.32's own OpenAI server and to the service on the same seeds, and how their answers compare.

Each case is one request. ``send`` answers it as an ``Outcome`` (status, error param, the body or the
stream's chunks); ``differences`` lists every way the service's outcome differs from vLLM's: the
status, the error's ``param``, and every field vLLM returns (texts, ids and reasons exactly,
logprobs within 1e-5), except the ones that are per server (ids, timestamps, the model's name).
Fields only the service returns are allowed where they are the service's documented extensions.
Streams compare as a whole (text, ids and logprobs per choice, the finish and stop reasons, the
usage chunk) and on the last chunk of each choice (the one carrying its ``finish_reason``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import httpx

PER_SERVER = {"id", "created", "model", "system_fingerprint", "request_id"}
# The service's documented extensions (docs/data-plane.md): only these may appear where vLLM has none.
EXTENSIONS = {"generation_log_probs", "weight_versions", "rollout", "prompt_token_ids", "generation_token_ids",
              "token_strs", "reasoning_content"}
LOGPROB_TOL = 1e-5


@dataclass
class Case:
    name: str
    path: str
    body: dict[str, Any]
    headers: dict[str, str] = field(default_factory=dict)
    # "same": the service answers as vLLM does; "forced_call": the service samples a forced tool call
    # under its compact grammar (docs/data-plane.md), so the answer follows vLLM's rules for a forced
    # call (content "", the calls parsed, the finish reason) rather than its text. "constrained": vLLM's
    # server with a reasoning parser holds a completion's grammar back until the reasoning ends (a plain
    # prompt never ends it, so the grammar is ignored); the service applies it from the first token,
    # and the answer is checked against the constraint. "stateless_only": the same without a rollout id,
    # a 400 naming the field under one (a cut prompt is not the rollout's history). "cut_text_prompt": the
    # same prompt ids and usage (vLLM's server generates from the whole text of a cut text prompt).
    expect: str = "same"


@dataclass
class Outcome:
    status: int
    body: Any = None
    chunks: list[dict] | None = None

    @property
    def error(self) -> dict | None:
        return self.body.get("error") if isinstance(self.body, dict) and self.status >= 400 else None


def send(base: str, model: str, case: Case, timeout: float = 120) -> Outcome:
    body = dict(case.body, model=model)
    with httpx.Client(base_url=base, timeout=timeout, trust_env=False) as client:
        if not body.get("stream"):
            r = client.post(case.path, json=body, headers=case.headers)
            try:
                return Outcome(r.status_code, r.json())
            except ValueError:
                return Outcome(r.status_code, r.text)
        with client.stream("POST", case.path, json=body, headers=case.headers) as r:
            if r.status_code != 200:
                r.read()
                return Outcome(r.status_code, r.json())
            chunks = []
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunks.append(json.loads(line[6:]))
            return Outcome(200, None, chunks)


def differences(theirs: Outcome, ours: Outcome) -> list[str]:
    if theirs.status != ours.status:
        return [f"status: vLLM {theirs.status} {_brief(theirs)}, ours {ours.status} {_brief(ours)}"]
    if theirs.status >= 400:
        t, o = theirs.error or {}, ours.error or {}
        return [] if t.get("param") == o.get("param") else [f"error param: vLLM {t.get('param')!r}, ours {o.get('param')!r}"]
    if theirs.chunks is not None:
        t, o = stream_summary(theirs.chunks), stream_summary(ours.chunks or [])
        return last_chunks_agree(t, o) + _compare(t, o, "stream")
    return _compare(theirs.body, ours.body, "body")


def stream_summary(chunks: list[dict]) -> dict[str, Any]:
    """A stream as what a client assembles from it, plus the last chunk of each choice and the usage chunk."""
    out: dict[str, Any] = {"choices": {}, "usage_chunks": []}
    for chunk in chunks:
        if chunk.get("usage") is not None and not chunk.get("choices"):
            out["usage_chunks"].append(chunk["usage"])
            continue
        for choice in chunk.get("choices", []):
            acc = out["choices"].setdefault(str(choice["index"]), {"text": "", "reasoning": "", "token_ids": [],
                                                                    "logprobs": [], "tool_calls": 0,
                                                                    "usage_on_every_chunk": True})
            # continuous_usage_stats: every chunk carries the usage so far; the last one's is compared
            acc["usage_on_every_chunk"] &= chunk.get("usage") is not None
            delta = choice.get("delta")
            if delta is not None:  # chat
                acc["text"] += delta.get("content") or ""
                acc["reasoning"] += delta.get("reasoning") or delta.get("reasoning_content") or ""
                acc["tool_calls"] += len(delta.get("tool_calls") or [])
                for c in ((choice.get("logprobs") or {}).get("content") or []):
                    acc["logprobs"].append(c["logprob"])
            else:
                acc["text"] += choice.get("text") or ""
                acc["logprobs"] += ((choice.get("logprobs") or {}).get("token_logprobs") or [])
            acc["token_ids"] += choice.get("token_ids") or []
            if choice.get("finish_reason") is not None:
                acc["finish_reason"] = choice["finish_reason"]
                acc["stop_reason"] = choice.get("stop_reason")
                acc["last_chunk_usage"] = chunk.get("usage")
                last = delta if delta is not None else choice
                acc["last_chunk_text"] = (last.get("content") if delta is not None else last.get("text")) or ""
    return out


def last_chunks_agree(theirs: dict[str, Any], ours: dict[str, Any]) -> list[str]:
    """The last chunk of each choice carries the last engine step's text with the finish reason. An
    engine step's outputs can coalesce with the one before when the reader lags (in vLLM's server
    too), so the service's last chunk may carry more: vLLM's is a suffix of it."""
    diffs = []
    for index, t in theirs["choices"].items():
        o = ours["choices"].get(index, {})
        last_t, last_o = t.pop("last_chunk_text", ""), o.pop("last_chunk_text", "")
        if not last_o.endswith(last_t) or (last_t and not last_o):
            diffs.append(f"stream.choices.{index}.last_chunk_text: vLLM {last_t!r}, ours {last_o!r}")
    return diffs


def _compare(theirs: Any, ours: Any, where: str) -> list[str]:
    if isinstance(theirs, dict):
        if not isinstance(ours, dict):
            return [f"{where}: vLLM {_short(theirs)}, ours {_short(ours)}"]
        diffs = []
        for key, value in theirs.items():
            if key in PER_SERVER or (key == "version" and ".weight_versions[" in where):  # each server's own label
                continue
            if key not in ours:
                diffs.append(f"{where}.{key}: missing (vLLM {_short(value)})")
            else:
                diffs += _compare(value, ours[key], f"{where}.{key}")
        for key in ours.keys() - theirs.keys() - PER_SERVER - EXTENSIONS:
            if ours[key] is not None:
                diffs.append(f"{where}.{key}: only ours ({_short(ours[key])})")
        return diffs
    if isinstance(theirs, list):
        if not isinstance(ours, list) or len(ours) != len(theirs):
            return [f"{where}: vLLM {_short(theirs)}, ours {_short(ours)}"]
        return [d for i, (t, o) in enumerate(zip(theirs, ours)) for d in _compare(t, o, f"{where}[{i}]")]
    if isinstance(theirs, float) and isinstance(ours, (int, float)) and not isinstance(ours, bool):
        return [] if abs(theirs - ours) <= LOGPROB_TOL or theirs == ours else [f"{where}: vLLM {theirs}, ours {ours}"]
    return [] if theirs == ours else [f"{where}: vLLM {_short(theirs)}, ours {_short(ours)}"]


def _short(v: Any) -> str:
    s = json.dumps(v, ensure_ascii=False) if not isinstance(v, str) else repr(v)
    return s if len(s) <= 160 else s[:157] + "..."


def _brief(o: Outcome) -> str:
    e = o.error
    return _short({"param": e.get("param"), "message": e.get("message")}) if e else ""
