"""The weight-broadcast wire protocol, shared by the trainer (rank 0) and every engine worker.

Torch only: no vLLM, no Ray, so the trainer-side client imports it without an inference stack.

The group is a dedicated ``ProcessGroupGloo`` built on its own ``TCPStore`` (the trainer hosts the
store). It never touches torch's default process group: vLLM's worker owns that one, and a trainer
usually has its own (FSDP, ...). This is the same construction vLLM's stateless process-group
helpers use, minus the vLLM import.

A refit is one handshake header, the buckets, and one trailer header, all broadcasts. Every
worker posts the receives of all three (the plan says how many buckets and their sizes) before
the trainer starts, so the buckets flow back to back with no per-bucket round trip. The handshake
``[START, n]`` completes only once every worker is receiving (staging in the background while
its engine generates, or inside the refit's pause). The trailer ``[END, n]``
commits the transfer; ``[ABORT, k]`` means the trainer gave up after ``k`` buckets (the rest of the
buckets were sent as filler to keep every rank in step): every receiver drops what it got and
raises :class:`TransferAborted`, so no engine loads a partial state dict.
The bucket plan (names, dtypes, shapes, byte offsets) travels with the refit call, not over gloo.
"""

from __future__ import annotations

import datetime
import json
import socket
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

HEADER_START = 1
HEADER_ABORT = 2
HEADER_END = 3


ABORT_MESSAGE = "trainer aborted the transfer"


class TransferAborted(RuntimeError):
    """The trainer aborted the broadcast; the receiver discarded every bucket.

    The group stays in step (every rank saw the ABORT header). vLLM's collective_rpc re-raises
    worker errors as plain ``Exception`` with the message only, so callers match ``ABORT_MESSAGE``.
    """


class GroupOutOfSync(RuntimeError):
    """The trainer gave up before the workers joined the broadcast: the group must be re-created."""


@dataclass(frozen=True)
class TensorSlot:
    name: str
    dtype: str  # torch dtype name without the "torch." prefix, e.g. "float32"
    shape: tuple[int, ...]
    offset: int  # byte offset inside its bucket
    nbytes: int


@dataclass(frozen=True)
class BucketPlan:
    """Which tensor goes where. Computed by the trainer, sent to workers as JSON."""

    buckets: tuple[tuple[TensorSlot, ...], ...]

    @property
    def bucket_nbytes(self) -> list[int]:
        return [sum(s.nbytes for s in b) for b in self.buckets]

    @property
    def total_bytes(self) -> int:
        return sum(self.bucket_nbytes)

    @property
    def num_tensors(self) -> int:
        return sum(len(b) for b in self.buckets)

    def to_json(self) -> str:
        return json.dumps(
            [[[s.name, s.dtype, list(s.shape), s.offset, s.nbytes] for s in b] for b in self.buckets],
            separators=(",", ":"),
        )

    @classmethod
    def from_json(cls, text: str) -> "BucketPlan":
        return cls(
            tuple(
                tuple(TensorSlot(n, d, tuple(shape), off, nb) for n, d, shape, off, nb in bucket)
                for bucket in json.loads(text)
            )
        )


def dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


# Tensors this large are broadcast from their own memory; smaller ones are packed (the copy overlaps
# the previous bucket on the wire). Measured at 200M params: at 4 MB every 6.5 MB MLP matrix was its
# own message and the 8 small messages cost ~25-30 ms (a wake-up each on both sides, 2 cores) for
# 41 MB; packed into one bucket they cost one.
DIRECT_BYTES = 32 * 1024 * 1024


def plan_buckets(
    named_meta: Iterable[tuple[str, Any, Iterable[int], int]], bucket_bytes: int, direct_bytes: int = DIRECT_BYTES
) -> BucketPlan:
    """Greedy packing of (name, dtype, shape, nbytes) in order.

    A tensor of ``direct_bytes`` or more gets a bucket of its own, which the sender broadcasts
    straight from the tensor's memory (no packing copy: measured, packing a 200 MB bucket cost as
    much as sending it on this machine). Smaller tensors are packed up to ``bucket_bytes``.
    """
    buckets: list[list[TensorSlot]] = []
    current: list[TensorSlot] = []
    used = 0
    for name, dtype, shape, nbytes in named_meta:
        if nbytes >= direct_bytes:
            if current:
                buckets.append(current)
                current, used = [], 0
            buckets.append([TensorSlot(name, dtype_name(dtype), tuple(int(x) for x in shape), 0, int(nbytes))])
            continue
        if current and used + nbytes > bucket_bytes:
            buckets.append(current)
            current, used = [], 0
        # Keep every slot 8-byte aligned so views of any dtype are aligned.
        current.append(TensorSlot(name, dtype_name(dtype), tuple(int(x) for x in shape), used, int(nbytes)))
        used += (int(nbytes) + 7) // 8 * 8
    if current:
        buckets.append(current)
    return BucketPlan(tuple(tuple(b) for b in buckets))


def bucket_size(bucket: tuple[TensorSlot, ...]) -> int:
    last = bucket[-1]
    return (last.offset + last.nbytes + 7) // 8 * 8


def plan_for_state_dict(params: Mapping[str, Any], bucket_bytes: int, direct_bytes: int = DIRECT_BYTES) -> BucketPlan:
    return plan_buckets(
        ((n, t.dtype, tuple(t.shape), t.numel() * t.element_size()) for n, t in params.items()),
        bucket_bytes,
        direct_bytes,
    )


# ------------------------------------------------------------------------------------------ group
def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def open_group(host: str, port: int, world_size: int, rank: int, group_name: str, timeout_s: float):
    """A dedicated gloo group (rank 0 hosts the TCPStore). Blocks until all ranks joined."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(host, port, world_size, rank == 0, timeout=timeout, wait_for_workers=False)
    prefixed = dist.PrefixStore(f"rollout-service/{group_name}", store)
    pg = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
    return GlooGroup(pg=pg, store=store, rank=rank, world_size=world_size, name=group_name)


@dataclass
class GlooGroup:
    pg: Any
    store: Any  # kept alive: rank 0's store is the rendezvous server
    rank: int
    world_size: int
    name: str

    def broadcast_async(self, tensor):
        import torch.distributed as dist

        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        return self.pg.broadcast([tensor], opts)

    def broadcast(self, tensor) -> None:
        self.broadcast_async(tensor).wait()


# ------------------------------------------------------------------------------------ send / recv
def _header(code: int, index: int):
    import torch

    return torch.tensor([code, index], dtype=torch.int64)


def send_header(group: GlooGroup, code: int, index: int, *, poll: Callable[[], None] | None = None,
                poll_interval_s: float = 0.02) -> None:
    """Broadcast a header. ``poll`` is called while waiting (it may raise to give up).

    The wait wakes on the broadcast's completion (a future callback), not on a sleep-poll tick: the
    first header is the handshake, and every millisecond between the workers joining and the
    trainer noticing it used to be added to the transfer. ``poll`` runs every ``poll_interval_s``.
    """
    work = group.broadcast_async(_header(code, index))
    if poll is None:
        work.wait()
        return
    import threading

    done = threading.Event()
    try:
        work.get_future().add_done_callback(lambda _fut: done.set())
    except Exception:  # pragma: no cover - a backend without futures: fall back to a short tick
        poll_interval_s = 0.002
    while not work.is_completed():
        poll()
        done.wait(poll_interval_s)
    work.wait()


class PackBuffers:
    """Trainer-side send buffers kept across refits: two per bucket size (a bucket is packed while
    the previous one of that size is on the wire). Reuse saves the page faults of fresh buffers."""

    def __init__(self):
        self._bufs: dict[tuple[int, int], Any] = {}

    def get(self, nbytes: int, index: int):
        import torch

        key = (nbytes, index % 2)
        if key not in self._bufs:
            self._bufs[key] = torch.zeros(nbytes, dtype=torch.uint8)
        return self._bufs[key]

    def clear(self) -> None:
        self._bufs.clear()


def pack_bucket(params: Mapping[str, Any], bucket: tuple[TensorSlot, ...], out=None):
    """One flat uint8 buffer holding the bucket's tensors at their offsets (one copy per tensor)."""
    import torch

    buf = out if out is not None else torch.empty(bucket_size(bucket), dtype=torch.uint8)
    for slot in bucket:
        t = params[slot.name].detach()
        if t.device.type != "cpu":
            t = t.to("cpu")
        buf[slot.offset : slot.offset + slot.nbytes].copy_(t.contiguous().reshape(-1).view(torch.uint8))
    return buf


def _direct_view(params: Mapping[str, Any], bucket: tuple[TensorSlot, ...]):
    """The bytes of a single-tensor bucket, without a copy, when the tensor allows it."""
    import torch

    if len(bucket) != 1:
        return None
    slot = bucket[0]
    t = params[slot.name].detach()
    if t.device.type != "cpu" or not t.is_contiguous() or slot.nbytes != bucket_size(bucket) or slot.nbytes == 0:
        return None
    return t.reshape(-1).view(torch.uint8)


def send_buckets(
    group: GlooGroup,
    params: Mapping[str, Any],
    plan: BucketPlan,
    *,
    on_bucket: Callable[[int], None] | None = None,
    poll: Callable[[], None] | None = None,
    buffers: PackBuffers | None = None,
    timings: dict[str, float] | None = None,
) -> int:
    """Trainer side: handshake, every bucket posted back to back, trailer. Returns bytes sent.

    ``poll`` runs while waiting for the workers to join the handshake (it raises to give up, e.g.
    when the controller already failed; the group is then out of sync). After the handshake every
    bucket is posted without waiting for the previous one (large tensors straight from their
    memory, small ones packed into one of two reused buffers per size, the packing overlapping the
    wire), so the bytes flow as in a raw broadcast. ``on_bucket(i)`` runs once bucket ``i`` is on
    the wire. If ``on_bucket`` or the packing raises, the broadcast is still completed (unsent
    buckets as filler) and the trailer says ABORT: every worker drops what it got, no engine keeps
    a partial state dict, and the exception propagates. The trailer ``END`` is what commits the
    transfer. ``timings`` (if given) gets ``handshake_s`` (waiting for the workers to join) and
    ``send_s`` (handshake done -> END sent: the bytes' time on the wire).
    """
    n = len(plan.buckets)
    works: list = []  # one per posted bucket
    on_wire = 0  # buckets known to be on the wire (in order)
    pack_busy: dict[tuple[int, int], int] = {}  # pack buffer -> index of the bucket using it

    def drain(upto: int) -> None:
        nonlocal on_wire
        while on_wire <= upto:
            works[on_wire].wait()
            on_wire += 1
            if on_bucket is not None:
                on_bucket(on_wire - 1)

    joined = False
    t0 = time.perf_counter()
    try:
        send_header(group, HEADER_START, n, poll=poll)  # the handshake: every worker is receiving
        joined = True
        t_joined = time.perf_counter()
        for i, bucket in enumerate(plan.buckets):
            buf = _direct_view(params, bucket)
            if buf is None:
                key = (bucket_size(bucket), i % 2)
                if key in pack_busy:
                    drain(pack_busy[key])  # that buffer's previous bucket must be on the wire
                pack_busy[key] = i
                buf = pack_bucket(params, bucket, buffers.get(*key) if buffers is not None else None)
            works.append(group.broadcast_async(buf))
        drain(n - 1)
        send_header(group, HEADER_END, n)
        if timings is not None:
            timings.update(handshake_s=t_joined - t0, send_s=time.perf_counter() - t_joined)
    except BaseException as exc:
        if not joined:
            raise GroupOutOfSync(f"workers never joined the broadcast: {exc!r}") from exc
        _complete_with_filler(group, plan, works)
        send_header(group, HEADER_ABORT, on_wire)
        raise
    return plan.total_bytes


def _complete_with_filler(group: GlooGroup, plan: BucketPlan, works: list) -> None:
    """Every worker posted a receive per bucket: the ones never sent get filler bytes (discarded)."""
    import torch

    sizes = [bucket_size(b) for b in plan.buckets[len(works):]]
    if sizes:
        filler = torch.empty(max(sizes), dtype=torch.uint8)
        works = works + [group.broadcast_async(filler[:size]) for size in sizes]
    for w in works:
        try:
            w.wait()
        except Exception:  # pragma: no cover - the ABORT trailer (or its timeout) reports the failure
            pass


def allocate_receive_buffers(plan: BucketPlan, spare: list | None = None) -> list:
    """One uint8 buffer per bucket, ``spare`` ones reused where their size fits (no receive is
    posted: a failed allocation leaves the group in step)."""
    import torch

    out = []
    for i, bucket in enumerate(plan.buckets):
        size = bucket_size(bucket)
        reuse = spare[i] if spare is not None and i < len(spare) else None
        out.append(reuse if reuse is not None and reuse.numel() == size else torch.empty(size, dtype=torch.uint8))
    return out


def receive_buckets(group: GlooGroup, plan: BucketPlan, buffers: list | None = None) -> tuple[list[tuple[str, Any]], list]:
    """Worker side: (name, tensor) pairs as views into the received buffers (no extra copy), and
    the buffers. ``buffers`` (one per bucket, right sizes) are reused instead of allocating.

    The handshake's, every bucket's and the trailer's receives are all posted at once, before the
    trainer starts: gloo's threads then take each bucket as soon as the previous one is in, with
    no Python wake-up between buckets.
    """
    import torch

    n = len(plan.buckets)
    received = allocate_receive_buffers(plan, buffers)  # before any receive is posted
    header = torch.empty(2, dtype=torch.int64)
    header_work = group.broadcast_async(header)
    data_works = [group.broadcast_async(buf) for buf in received]
    trailer = torch.empty(2, dtype=torch.int64)
    trailer_work = group.broadcast_async(trailer)
    header_work.wait()
    if (int(header[0]), int(header[1])) != (HEADER_START, n):
        raise RuntimeError(f"weight broadcast out of sync: expected a {n}-bucket handshake, got {header.tolist()}")
    for w in data_works:
        w.wait()
    trailer_work.wait()
    code, count = int(trailer[0]), int(trailer[1])
    if code == HEADER_ABORT:
        raise TransferAborted(f"{ABORT_MESSAGE} after {count} of {n} buckets")
    if (code, count) != (HEADER_END, n):
        raise RuntimeError(f"weight broadcast out of sync: expected END after {n} buckets, got {trailer.tolist()}")
    out: list[tuple[str, Any]] = []
    for bucket, buf in zip(plan.buckets, received):
        for slot in bucket:
            dtype = getattr(torch, slot.dtype)
            out.append((slot.name, buf[slot.offset : slot.offset + slot.nbytes].view(dtype).view(slot.shape)))
    return out, received
