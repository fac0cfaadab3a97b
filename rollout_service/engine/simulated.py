"""The simulated engine (``engine.backend: simulated``): the engine actor's interfaces, no model.

For capacity planning and load tests of the service around the engines (fleet, refit controller,
routing, Serve, Redis) at cluster scale on one machine, never for training: its tokens mean
nothing. What is real: the data channel (the same :class:`ChannelServer`, token ids in, ids +
logprobs + weight-version spans out, streamed in batched chunks), abort, pause (keep / wait /
abort) and resume, weight-version labels, the refit path (it joins the trainer's gloo group and
receives every bucket, or reads the object-store state dict or the checkpoint directory, then keeps
only a digest of the bytes), health and load reports, process info, death by signal.

What is modelled (:class:`~rollout_service.config.SimulatedEngineConfig`): a scheduler that runs
steps of ``decode_step_s + decode_step_s_per_seq * batch`` seconds plus ``prefill_s_per_token``
for each prompt token the prefix cache does not hold, at most ``max_num_seqs`` sequences at once,
and a KV cache of ``kv_capacity_tokens`` shared by the running sequences and an LRU prefix cache of
``block_size``-token blocks, salted by the weight version as the real engine's is.

Sampling is deterministic: a request's ids and logprobs follow from its seed and prompt (greedy:
from the prompt alone), drawn below the model's first added token, so no sampled id is a special
token. Stop strings and structured outputs need a tokenizer and a grammar; a request that asks for
them is refused as a client error naming the parameter. The weights' "checksum" is a digest of the
bytes received (or of a checkpoint directory's file names, sizes and times): equal digests mean the
same weights reached both engines, as the real engine's checksum does.

Imports neither torch nor vLLM, except torch when weights arrive as tensors (the gloo group, an
object-store state dict): a trainer that sends bytes brings torch with them.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import math
import os
import random
import struct
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator

from rollout_service.config import EngineConfig
from rollout_service.engine.batching import batched
from rollout_service.engine.channel import ChannelServer
from rollout_service.engine.refit_steps import RefitSteps
from rollout_service.engine.sampling import SamplingParamsError
from rollout_service.engine.simulated_worker import SimulatedWorker
from rollout_service.engine.types import (ABORT_MEMORY_S, EngineUnavailable, GenerateRequest, GenerationChunk, ScoreRequest, ScoreResult,
                                          spans_up_to)


def _sample_vocab(model_dir: str) -> int:
    """Ids below the model's first added (special or marker) token, within its vocabulary."""
    root = Path(model_dir)
    vocab = int(json.loads((root / "config.json").read_text()).get("vocab_size", 32_000))
    try:
        added = json.loads((root / "tokenizer_config.json").read_text()).get("added_tokens_decoder") or {}
        first_added = min((int(k) for k in added), default=vocab)
    except (OSError, ValueError):
        first_added = vocab
    return max(2, min(vocab, first_added))


class _PrefixCache:
    """LRU of KV blocks keyed by a hash chain over (salt, block tokens), as vLLM's prefix cache."""

    def __init__(self, capacity_blocks: int, block_size: int):
        self.capacity = capacity_blocks
        self.block_size = block_size
        self.blocks: OrderedDict[int, None] = OrderedDict()

    def chain(self, salt: str, ids: list[int]) -> list[int]:
        out, h, b = [], hash(salt), self.block_size
        for i in range(0, len(ids) - len(ids) % b, b):
            h = hash((h, tuple(ids[i:i + b])))
            out.append(h)
        return out

    def hit_blocks(self, chain: list[int]) -> int:
        n = 0
        for h in chain:
            if h not in self.blocks:
                break
            self.blocks.move_to_end(h)
            n += 1
        return n

    def insert(self, chain: list[int], reserved_blocks: int) -> None:
        for h in chain:
            self.blocks[h] = None
            self.blocks.move_to_end(h)
        while self.blocks and len(self.blocks) > max(0, self.capacity - reserved_blocks):
            self.blocks.popitem(last=False)


@dataclass
class _Seq:
    request: GenerateRequest
    rng: random.Random
    salt: str
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    generated: list[int] = field(default_factory=list)
    spans: list[list] = field(default_factory=list)  # [version, start, end]
    cached_tokens: int = 0
    stop_reason: int | None = None
    done: bool = False

    @property
    def kv_tokens(self) -> int:
        return len(self.request.prompt_ids) + len(self.generated)


class SimulatedEngine(RefitSteps):
    """The engine actor's public interface (see :class:`~rollout_service.engine.replica.EngineReplica`)
    over the timing model above. Run it with ``create_engine_actor`` and ``engine.backend: simulated``."""

    def __init__(self, config: EngineConfig, index: int = 0, initial_weight_version: str = "0",
                 model_path: str | None = None):
        self.config = config
        self._model_path = model_path or config.model  # resolved by the creator (None: resolved here)
        self.index = index
        self._version = initial_weight_version
        self._started = False
        self._startup_s: float | None = None
        self._channel: ChannelServer | None = None
        self._worker: SimulatedWorker | None = None
        self._waiting: deque[_Seq] = deque()
        self._running: list[_Seq] = []
        self._by_id: dict[str, _Seq] = {}
        self._aborted_rollouts: dict[str, float] = {}  # as EngineReplica's: rollout id -> when aborted
        self._num_aborted = 0
        self._paused = False
        self._num_pauses = 0  # pauses that landed since start (health: a staging failure pauses none)
        self._num_resumes = 0  # resumes since start (health: an engine resumed twice was resumed early once)
        self._work = asyncio.Event()
        self._resumed = asyncio.Event()
        self._resumed.set()
        self._between_steps = asyncio.Event()
        self._between_steps.set()
        self._loop_task: asyncio.Task | None = None
        self._vocab = 2
        self._cache: _PrefixCache | None = None
        self.stats = {"steps": 0, "prompt_tokens": 0, "cached_tokens": 0, "generated_tokens": 0}
        self._faults: dict[str, list] = {}  # control-plane method -> [when, calls left] (inject_fault)
        self._delays: dict[str, list] = {}  # control-plane method -> [seconds, calls left] (inject_delay)

    # ----------------------------------------------------------------- life cycle
    async def start(self) -> float:
        if not self._started:
            t0 = time.perf_counter()
            time.sleep(self.config.sim.start_s)  # blocking, as a model load: the actor answers nothing meanwhile
            model = self._model_path or self.config.resolved_model()
            self._vocab = _sample_vocab(model)
            self._worker = SimulatedWorker(model)
            sim = self.config.sim
            self._cache = _PrefixCache(sim.kv_capacity_tokens // sim.block_size, sim.block_size)
            self._loop_task = asyncio.get_running_loop().create_task(self._scheduler())
            self._started = True
            self._startup_s = time.perf_counter() - t0
        return self._startup_s or 0.0

    async def open_channel(self, host: str | None = None):
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
        if self._loop_task is not None:
            self._loop_task.cancel()
            self._loop_task = None
        for seq in [*self._waiting, *self._running]:
            self._finish(seq, "abort")
        self._started = False

    def _check_started(self) -> None:
        if not self._started:
            raise EngineUnavailable(f"engine {self.index} is not started")

    # ----------------------------------------------------------------- data plane
    async def generate(self, request: GenerateRequest, batch_window_s: float | None = None) -> AsyncIterator[GenerationChunk]:
        if batch_window_s is None:
            batch_window_s = request.batch_window_s
        window = self.config.stream_batch_window_s if batch_window_s is None else batch_window_s
        chunks = self._generation(request, final_only=False)
        if window > 0:
            chunks = batched(chunks, window, GenerationChunk.concat)
        async with contextlib.aclosing(chunks):
            async for chunk in chunks:
                yield chunk

    async def score(self, request: ScoreRequest) -> ScoreResult:
        """No teacher-forced scoring: the simulated engine's logprobs come from a seed, not a model
        (the parity canary counts such turns as skipped, ``engine_cannot_score``)."""
        self._check_started()
        return ScoreResult(weight_version=self._version, engine_index=self.index, supported=False)

    async def generate_all(self, request: GenerateRequest) -> GenerationChunk:
        async with contextlib.aclosing(self._generation(request, final_only=True)) as chunks:
            async for chunk in chunks:
                if chunk.finish_reason is not None:
                    return chunk
        raise EngineUnavailable(f"engine {self.index} ended request {request.request_id} without a final output")

    async def _generation(self, request: GenerateRequest, final_only: bool) -> AsyncIterator[GenerationChunk]:
        self._check_started()
        s = request.sampling
        if s.stop:
            raise SamplingParamsError("stop", "the simulated engine has no tokenizer: stop strings are not supported")
        if s.structured_outputs:
            raise SamplingParamsError("structured_outputs", "the simulated engine does not implement structured outputs")
        if s.prompt_logprobs is not None:
            raise SamplingParamsError("prompt_logprobs", "the simulated engine has no model to score a prompt with")
        if len(request.prompt_ids) + request.max_tokens > self.config.max_model_len:
            raise SamplingParamsError("max_tokens", f"prompt ({len(request.prompt_ids)} tokens) + max_tokens "
                                      f"({request.max_tokens}) exceeds max_model_len {self.config.max_model_len}")
        if request.request_id in self._by_id:
            raise SamplingParamsError("request_id", f"request id {request.request_id} is already running")
        aborted_at = self._aborted_rollouts.get(request.rollout_id) if request.rollout_id is not None else None
        if aborted_at is not None and time.monotonic() - aborted_at <= ABORT_MEMORY_S:
            yield GenerationChunk(token_ids=[], logprobs=[], top_logprobs=[] if s.top_logprobs else None,
                                  finish_reason="abort", weight_version=self._version, weight_versions=[],
                                  num_prompt_tokens=len(request.prompt_ids), engine_index=self.index)
            return
        seq = _Seq(request, self._rng(request),
                   f"weights-{self._version}" if self.config.enable_prefix_caching else f"no-cache-{id(request)}")
        self._by_id[request.request_id] = seq
        self._waiting.append(seq)
        self._work.set()
        ids: list[int] = []
        lps: list[float] = []
        tops: list[dict[int, float]] | None = [] if s.top_logprobs else None
        passed = 0  # ids handed over in earlier chunks
        try:
            while True:
                item = await seq.queue.get()
                if isinstance(item, str):  # the finish reason
                    chunk = self._chunk(seq, ids, lps, tops)
                    chunk.finish_reason = item
                    chunk.stop_reason = seq.stop_reason
                    chunk.weight_versions = [tuple(span) for span in seq.spans]
                    chunk.num_cached_tokens = seq.cached_tokens
                    yield chunk
                    return
                tid, lp, top = item
                ids.append(tid)
                lps.append(lp)
                if tops is not None:
                    tops.append(top)
                if final_only or (not seq.queue.empty() and isinstance(seq.queue._queue[0], str)):
                    continue  # the finishing chunk carries the last token, as the real engine's does
                chunk = self._chunk(seq, ids, lps, tops)
                passed += len(ids)
                chunk.weight_versions = spans_up_to(seq.spans, passed)
                yield chunk
                ids, lps, tops = [], [], None if tops is None else []
        finally:
            if not seq.done:
                self._finish(seq, "abort", counted=False)

    def _chunk(self, seq: _Seq, ids, lps, tops) -> GenerationChunk:
        return GenerationChunk(token_ids=list(ids), logprobs=list(lps), top_logprobs=tops, weight_version=self._version,
                               num_prompt_tokens=len(seq.request.prompt_ids), engine_index=self.index)

    @staticmethod
    def _rng(request: GenerateRequest) -> random.Random:
        s = request.sampling
        h = hashlib.blake2b(struct.pack(f"<{len(request.prompt_ids)}q", *request.prompt_ids), digest_size=16)
        if s.temperature > 0:
            h.update(b"seed" + (str(s.seed).encode() if s.seed is not None else os.urandom(16)))
        return random.Random(h.digest())

    def _sample(self, seq: _Seq) -> tuple[int, float, dict[int, float] | None]:
        rng, want_top = seq.rng, seq.request.sampling.top_logprobs
        tid = rng.randrange(self._vocab)
        lp = math.log(rng.uniform(0.05, 1.0))
        top = None
        if want_top:
            top = {tid: lp}
            below = lp
            while len(top) < want_top:
                below -= rng.uniform(0.01, 2.0)
                top.setdefault(rng.randrange(self._vocab), below)
        return tid, lp, top

    def _finish(self, seq: _Seq, reason: str, counted: bool = True) -> None:
        if seq.done:
            return
        seq.done = True
        if reason == "abort" and counted:
            self._num_aborted += 1
        self._by_id.pop(seq.request.request_id, None)
        with contextlib.suppress(ValueError):
            self._waiting.remove(seq)
        with contextlib.suppress(ValueError):
            self._running.remove(seq)
        if reason != "abort" and self._cache is not None:
            ids = [*seq.request.prompt_ids, *seq.generated]
            self._cache.insert(self._cache.chain(seq.salt, ids), self._reserved_blocks())
        seq.queue.put_nowait(reason)

    def _reserved_blocks(self) -> int:
        return -(-sum(s.kv_tokens for s in self._running) // self.config.sim.block_size)

    # ------------------------------------------------------------------ scheduler
    async def _scheduler(self) -> None:
        sim = self.config.sim
        while True:
            await self._resumed.wait()
            if not (self._waiting or self._running):
                self._work.clear()
                await self._work.wait()
                continue
            self._between_steps.clear()
            try:
                prefill = 0
                used = sum(s.kv_tokens for s in self._running)
                while self._waiting and len(self._running) < self.config.max_num_seqs:
                    seq = self._waiting[0]
                    need = seq.kv_tokens + 1
                    if self._running and used + need > sim.kv_capacity_tokens:
                        break  # the KV cache is full: it waits for running sequences to finish
                    self._waiting.popleft()
                    chain = self._cache.chain(seq.salt, seq.request.prompt_ids)
                    seq.cached_tokens = self._cache.hit_blocks(chain) * sim.block_size
                    if seq.cached_tokens >= len(seq.request.prompt_ids):  # the last token is always computed
                        seq.cached_tokens = max(0, len(seq.request.prompt_ids) - 1)
                    prefill += len(seq.request.prompt_ids) - seq.cached_tokens
                    self.stats["prompt_tokens"] += len(seq.request.prompt_ids)
                    self.stats["cached_tokens"] += seq.cached_tokens
                    self._cache.insert(chain, self._reserved_blocks())
                    self._running.append(seq)
                    used += need
                step = sim.decode_step_s + sim.decode_step_s_per_seq * len(self._running) + sim.prefill_s_per_token * prefill
                await asyncio.sleep(step)
                version = self._version
                self.stats["steps"] += 1
                for seq in list(self._running):
                    if seq.done:
                        continue
                    tid, lp, top = self._sample(seq)
                    pos = len(seq.generated)
                    seq.generated.append(tid)
                    if seq.spans and seq.spans[-1][0] == version:
                        seq.spans[-1][2] = pos + 1
                    else:
                        seq.spans.append([version, pos, pos + 1])
                    seq.queue.put_nowait((tid, lp, top))
                    self.stats["generated_tokens"] += 1
                    s = seq.request.sampling
                    if tid in s.stop_token_ids:
                        seq.stop_reason = tid
                        self._finish(seq, "stop")
                    elif len(seq.generated) >= seq.request.max_tokens:
                        self._finish(seq, "length")
            finally:
                self._between_steps.set()

    async def abort(self, request_id: str) -> None:
        seq = self._by_id.get(request_id)
        if seq is not None:
            self._finish(seq, "abort")

    async def abort_rollout(self, rollout_id: str) -> int:
        """As ``EngineReplica.abort_rollout``: every running request of ``rollout_id`` ends with abort."""
        now = time.monotonic()
        self._aborted_rollouts[rollout_id] = now
        for rid, at in list(self._aborted_rollouts.items()):
            if now - at > ABORT_MEMORY_S:
                del self._aborted_rollouts[rid]
        seqs = [s for s in self._by_id.values() if s.request.rollout_id == rollout_id]
        for seq in seqs:
            self._finish(seq, "abort")
        return len(seqs)

    # -------------------------------------------------------------- fault injection
    FAULTABLE = ("pause", "resume", "set_weight_version", "rs_stage_path", "rs_load_staged", "rs_commit",
                 "rs_rollback", "rs_discard_staged")

    def inject_fault(self, method: str, when: str = "after", times: int = 1) -> None:
        """Make the next ``times`` calls of a control-plane ``method`` (:attr:`FAULTABLE`; the
        ``rs_*`` names are worker methods reached through ``collective_rpc``) raise a RuntimeError,
        ``before`` doing their work or ``after`` it (the call took effect, the caller sees an error):
        the faults a refit's failure path must survive, for drills and tests. ``times=0`` clears it."""
        if method not in self.FAULTABLE:
            raise ValueError(f"can inject faults into {', '.join(self.FAULTABLE)}; got {method!r}")
        if when not in ("before", "after"):
            raise ValueError(f"when must be before or after, got {when!r}")
        if times > 0:
            self._faults[method] = [when, times]
        else:
            self._faults.pop(method, None)

    def inject_delay(self, method: str, seconds: float, times: int = 1) -> None:
        """Make the next ``times`` calls of ``method`` (:attr:`FAULTABLE`) take ``seconds`` longer
        before their work (a slow step: one just under its deadline, for the lease drills);
        ``times=0`` clears it. Combines with :meth:`inject_fault` (slow, then failed)."""
        if method not in self.FAULTABLE:
            raise ValueError(f"can inject delays into {', '.join(self.FAULTABLE)}; got {method!r}")
        if times > 0:
            self._delays[method] = [float(seconds), times]
        else:
            self._delays.pop(method, None)

    async def _delay(self, method: str) -> None:
        delay = self._delays.get(method)
        if delay is None:
            return
        delay[1] -= 1
        if delay[1] <= 0:
            del self._delays[method]
        await asyncio.sleep(delay[0])

    def _fault(self, method: str, when: str) -> None:
        fault = self._faults.get(method)
        if fault is None or fault[0] != when:
            return
        fault[1] -= 1
        if fault[1] <= 0:
            del self._faults[method]
        raise RuntimeError(f"injected fault: {method} failed {when} its work on engine {self.index}")

    # -------------------------------------------------------------- control plane
    async def pause(self, mode: str = "keep", clear_cache: bool = False) -> float:
        """keep: in-flight sequences freeze until resume; wait: they finish first; abort: they end."""
        if mode not in ("keep", "wait", "abort"):
            raise ValueError(f"pause mode must be keep, wait or abort, got {mode!r}")
        self._check_started()
        await self._delay("pause")
        self._fault("pause", "before")
        t0 = time.perf_counter()
        if mode == "wait":
            while self._waiting or self._running:
                await asyncio.sleep(0.005)
        self._resumed.clear()
        await self._between_steps.wait()  # the step under way ends (its tokens carry the old version)
        if mode == "abort":
            for seq in [*self._waiting, *self._running]:
                self._finish(seq, "abort")
        self._paused = True
        self._num_pauses += 1
        self._fault("pause", "after")
        return time.perf_counter() - t0

    async def resume(self) -> float:
        self._check_started()
        await self._delay("resume")
        self._fault("resume", "before")
        self._paused = False
        self._num_resumes += 1
        self._resumed.set()
        self._fault("resume", "after")
        return 0.0

    async def is_paused(self) -> bool:
        return self._paused

    async def set_weight_version(self, version: str) -> None:
        self._check_started()
        await self._delay("set_weight_version")
        self._fault("set_weight_version", "before")
        self._version = version
        self._fault("set_weight_version", "after")

    def weight_version(self) -> str:
        return self._version

    async def collective_rpc(self, method: str, args: tuple = (), kwargs: dict | None = None, timeout: float | None = None):
        """The worker methods of the real engine's extension that the weight paths use; one worker."""
        self._check_started()
        fn = getattr(self._worker, method, None) if method.startswith("rs_") else None
        if fn is None:
            raise NotImplementedError(f"the simulated engine has no worker method {method!r}")
        # A background stage faults as the staging method it runs (rs_stage_path, ...) would.
        faulted = args[0] if method == "rs_stage_begin" and args and args[0] in self.FAULTABLE else method
        await self._delay(faulted)
        self._fault(faulted, "before")
        call = asyncio.to_thread(fn, *args, **(kwargs or {}))
        result = [await (asyncio.wait_for(call, timeout) if timeout else call)]
        self._fault(faulted, "after")
        return result

    async def reset_prefix_cache(self) -> bool:
        self._cache.blocks.clear()
        return True

    def num_in_flight(self) -> int:
        return len(self._by_id)

    def in_flight_versions(self) -> dict[str, str]:
        return {rid: (s.spans[0][0] if s.spans else self._version) for rid, s in self._by_id.items()}

    def num_aborted(self) -> int:
        return self._num_aborted

    async def stage_weights_from_object_store(self, refs: list, timeout: float | None = None) -> list[dict[str, Any]]:
        if not refs:
            raise ValueError("need one object ref of a state dict")
        self._check_started()
        state = await refs[0]
        return [await asyncio.to_thread(self._worker.stage_object, state)]

    async def object_store_stage(self, refs: list) -> tuple[str, list]:
        if not refs:
            raise ValueError("need one object ref of a state dict")
        self._check_started()
        state = await refs[0]
        if isinstance(state, dict) and set(state) == {"path"}:
            return "rs_stage_path", [state["path"]]
        self._worker.pending = [state]
        return "sim_object", []

    def release_object_store_stage(self, method: str, args: list) -> None:
        self._worker.pending = []

    async def export_weights(self, timeout: float | None = None) -> tuple[str, dict[str, Any]]:
        self._check_started()
        return self._version, self._worker.export()

    async def health(self) -> dict[str, Any]:
        self._check_started()
        return {
            "index": self.index,
            "ready": True,
            "paused": self._paused,
            "pauses": self._num_pauses,
            "resumes": self._num_resumes,
            "weight_version": self._version,
            "in_flight": len(self._by_id),
            "startup_s": self._startup_s,
            "pid": os.getpid(),
            "control_calls": self._channel.control_calls if self._channel is not None else 0,
            "backend": "simulated",
            "running": len(self._running),
            "waiting": len(self._waiting),
            "kv_tokens": sum(s.kv_tokens for s in self._running),
            **self.stats,
        }

    def process_info(self) -> dict[str, Any]:
        import psutil
        import ray

        me = psutil.Process()
        return {"node_id": ray.get_runtime_context().get_node_id(), "processes": [(me.pid, me.create_time())]}

    def tokenizer_path(self) -> str:
        return self._model_path or self.config.resolved_model()

    def engine_config(self) -> dict[str, Any]:
        """The config this engine runs (a restarted fleet adopting it takes it over)."""
        return self.config.model_dump()
