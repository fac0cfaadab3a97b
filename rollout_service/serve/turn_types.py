"""The typed boundary between the HTTP dialects and the turn runner.

A dialect (chat completions, responses, completions) turns its request into a :class:`TurnRequest`
(or a :class:`CompletionCall` for raw token-id prompts); the :class:`~rollout_service.serve.turns.TurnRunner`
answers with :class:`TokenDelta` events (streaming only) and one :class:`TurnResult`. Nothing here
knows HTTP or Serve, and everything is a plain dataclass, so the same objects cross a Serve handle
when a request is forwarded to the replica that owns its rollout.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

ToolMode = Literal["auto", "none", "required", "named"]


@dataclass(frozen=True)
class ToolChoice:
    """``tool_choice`` of any dialect in one form.

    ``mode`` auto / none / required / named; ``name`` is the forced function for ``named``;
    ``allowed`` restricts the tools the prompt lists (OpenAI's ``allowed_tools``): the model is
    sampled under exactly that prompt, so the trainer sees what the model saw.
    """

    mode: ToolMode = "auto"
    name: str | None = None
    allowed: tuple[str, ...] | None = None

    @property
    def forced(self) -> bool:
        return self.mode in ("required", "named")

    def to_dict(self) -> dict[str, Any]:
        return {"mode": self.mode, "name": self.name, "allowed": list(self.allowed) if self.allowed is not None else None}


@dataclass
class TurnRequest:
    """One model call of a rollout (or a stateless call, ``rollout_id=None``)."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    tool_choice: ToolChoice = field(default_factory=ToolChoice)
    chat_template_kwargs: dict[str, Any] | None = None
    sampling: dict[str, Any] = field(default_factory=dict)
    max_tokens: int | None = None
    top_logprobs: int = 0
    stream: bool = False
    rollout_id: str | None = None
    history_policy: Literal["fork", "reject"] | None = None
    idempotency_key: str | None = None
    want_token_strs: bool = False
    # NeMo Gym 0.7's exact-prefix extension, as sent (checked by the runner): the prompt must start
    # with these ids (the previous call's prompt + generation).
    required_prefix_token_ids: Any = None
    # Chat-completions form ({"type": "json_object"} / {"type": "json_schema", "json_schema": {...}});
    # the Responses dialect converts its ``text.format`` to it.
    response_format: dict[str, Any] | None = None
    # vLLM's structured_outputs field as sent (merged with response_format as vLLM merges them).
    structured_outputs: dict[str, Any] | None = None
    # stream_options.continuous_usage_stats: each streamed delta carries the reasoning count so far. Not
    # in the digest.
    continuous_usage: bool = False
    # vLLM's prompt truncation (serve/truncation.py): stateless calls only, not in the digest.
    truncate_prompt_tokens: int | None = None
    truncation_side: str | None = None
    # vLLM's add_generation_prompt: false / continue_final_message (chat, stateless calls only): the
    # prompt ends after the last message, or inside it. Not in the digest.
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    parallel_tool_calls: bool | None = None
    # Answer from the store if this exact call is already stored, whatever service.retry_policy says
    # (a forwarded turn run where it arrived: its owner may have stored it). Not part of the digest.
    replay_if_stored: bool = False
    # Token in, token out (/inference/v1/generate): the prompt as ids the client rendered itself;
    # ``messages`` is then empty and nothing is templated or parsed.
    prompt_token_ids: list[int] | None = None
    # X-Rollout-Group, or the group a call with n > 1 opens: the rollout's group (GET /v1/groups/{id};
    # routing.group_placement). Not in the digest.
    rollout_group: str | None = None
    # A member of a call with n > 1: the group starts on one engine whatever routing.group_placement says
    # (one prompt, prefilled there; shared through the prefix cache when it is on). Not in the digest.
    group_together: bool = False
    # X-Max-Staleness: this call's staleness bound in versions (None: rollouts.max_staleness). Admission
    # only: not in the digest.
    max_staleness: int | None = None
    # The call may reach any replica (under HAProxy, a rollout named only by X-Session-ID or metadata):
    # its in-flight claim is also kept in the store for every replica (serve/shared_claims.py). Not in
    # the digest.
    shared_claim: bool = False

    def digest(self) -> str:
        """What makes two calls the same call: everything that shapes the prompt or the sampling.

        A retry of a call whose answer was lost carries the same digest; a new call differs (at
        least by the previous answer in its messages). ``stream`` and the id/key fields are not in it.
        """
        body = {
            "messages": self.messages, "tools": self.tools, "tool_choice": self.tool_choice.to_dict(),
            "chat_template_kwargs": self.chat_template_kwargs or {}, "sampling": self.sampling,
            "max_tokens": self.max_tokens, "top_logprobs": self.top_logprobs, "history_policy": self.history_policy,
        }
        if self.required_prefix_token_ids:
            body["required_prefix_token_ids"] = self.required_prefix_token_ids
        if self.response_format is not None:
            body["response_format"] = self.response_format
        if self.structured_outputs is not None:
            body["structured_outputs"] = self.structured_outputs
        if self.parallel_tool_calls is not None:
            body["parallel_tool_calls"] = self.parallel_tool_calls
        if self.prompt_token_ids is not None:
            body["prompt_token_ids"] = self.prompt_token_ids
        raw = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)
        return hashlib.sha256(raw.encode()).hexdigest()


@dataclass
class CompletionCall:
    """A raw completion: token ids (or text) in, no chat template, no rollout semantics."""

    prompt: list[int] | str
    sampling: dict[str, Any] = field(default_factory=dict)
    max_tokens: int | None = None
    top_logprobs: int = 0
    stream: bool = False
    want_token_strs: bool = False
    echo: bool = False  # the answer's text (and logprobs) start with the prompt's
    echo_text: bool = True  # with echo: the prompt's text too (vLLM leaves it out with return_token_ids)
    discard_output: bool = False  # echo with max_tokens 0: one token generated and left out, as vLLM does
    structured_outputs: dict[str, Any] | None = None  # StructuredOutputsParams fields, as vLLM read them
    truncate_prompt_tokens: int | None = None  # serve/truncation.py
    truncation_side: str | None = None
    max_tokens_given: bool = True  # the request named max_tokens (truncate_prompt_tokens -1 keeps room for one)


@dataclass
class TokenDelta:
    """Newly generated ids of a streaming call and the text they completed (reasoning / content)."""

    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[dict[int, float]] | None = None
    reasoning: str = ""
    content: str = ""
    token_strs: list[dict[int, str]] | None = None  # per position: the sampled id's text and its alternatives'
    prompt_token_ids: list[int] | None = None  # on a call's first delta only (streamed first, as vLLM does)
    # TurnRequest.continuous_usage: the reasoning parser's count over the ids generated so far
    reasoning_tokens: int | None = None


@dataclass
class TurnResult:
    """The whole answer of one call, as stored (``replayed``: returned from the store for a retry)."""

    prompt_token_ids: list[int]
    generation_token_ids: list[int]
    generation_log_probs: list[float]
    finish_reason: str
    message: dict[str, Any]  # role, content, reasoning_content, tool_calls (OpenAI shape)
    weight_versions: list[dict[str, Any]]
    rollout: dict[str, Any] | None = None  # {id, turn, segment, monotonic, replayed}
    stop_reason: int | str | None = None
    top_logprobs: list[dict[int, float]] | None = None
    text: str = ""  # completions: the decoded generation
    engine_index: int | None = None
    token_strs: list[dict[int, str]] | None = None  # per position: the sampled id's text and its alternatives'
    replayed: bool = False
    replica: str | None = None  # the replica that ran the turn (its owner, or where a fallback ran it)
    # Forwarded, given up, run where it arrived; why: 'not-accepted' in time, or its stream went 'silent'
    forward_fallback: str | None = None
    reasoning_tokens: int | None = None  # generated ids inside reasoning, counted by the reasoning parser
    prompt_logprobs: list[dict[str, dict[str, Any]] | None] | None = None  # vLLM's shape, when asked
    echo: dict[str, Any] | None = None  # completions' echo: {"text": the prompt's, "first_token": its first token's}
    discard_output: bool = False  # echo with max_tokens 0: the generated token is not in the text

    @property
    def usage(self) -> dict[str, int]:
        p, c = len(self.prompt_token_ids), len(self.generation_token_ids)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


@dataclass
class TurnAccepted:
    """First event of a forwarded turn: the owning replica has started it (the forwarding side's
    proof that the hop delivered the call; see ``service.forward_accept_timeout_s``)."""

    replica: str


@dataclass
class TurnHeartbeat:
    """Sent by the owner of a forwarded turn while the turn is quiet (waiting for the engine, a
    long non-streamed generation): the forwarding side's proof that the stream is still alive
    (``service.forward_heartbeat_s``). Never reaches a client."""


@dataclass
class TurnError:
    """A ServiceError as data, so it crosses a Serve handle with its status and envelope intact."""

    status: int
    envelope: dict[str, Any]


def as_dict(obj: Any) -> dict[str, Any]:
    return asdict(obj)
