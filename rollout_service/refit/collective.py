"""The weight-broadcast wire protocol, shared by the trainer (rank 0) and every engine worker.

Torch only: no vLLM, no Ray, so the trainer-side client imports it without an inference stack.

The group is a dedicated ``ProcessGroupGloo`` built on its own ``TCPStore`` (the trainer hosts the
store). It never touches torch's default process group: vLLM's worker owns that one, and a trainer
usually has its own (FSDP, ...). This is the same construction vLLM's stateless process-group
helpers use, minus the vLLM import.

A refit is a sequence of buckets. Before each bucket the trainer broadcasts a small header
(``[code, bucket_index]``); ``DATA`` means one flat ``uint8`` buffer of the bucket's size follows,
``ABORT`` means the trainer gave up: every receiver drops what it got and raises
:class:`TransferAborted`, so no engine loads a partial state dict. The first header doubles as the
readiness handshake (the broadcast completes only once every worker is receiving, i.e. paused).
The bucket plan (names, dtypes, shapes, byte offsets) travels with the refit call, not over gloo.
"""

from __future__ import annotations

import datetime
import json
import socket
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

HEADER_DATA = 1
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
    """Trainer-side send buffers kept across refits: two per bucket size (bucket i+1 is packed
    while bucket i is on the wire). Reuse saves the page faults of fresh buffers on every refit."""

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
) -> int:
    """Trainer side. Packs bucket i+1 while bucket i is on the wire. Returns bytes sent.

    ``poll`` runs while waiting for the workers to join the first header (it raises to give up,
    e.g. when the controller already failed; the group is then out of sync). If ``on_bucket``
    (called after each bucket is on the wire) or packing raises after the workers joined, they are
    all told to abort, so none keeps a partial state dict, and the exception propagates. The
    trailing ``END`` header is what commits the transfer on the worker side.
    """
    sent = 0
    pending = None
    joined = False
    try:
        for i, bucket in enumerate(plan.buckets):
            # Buffer i % 2 is free: bucket i-2 completed before bucket i-1 was started.
            buf = _direct_view(params, bucket)
            if buf is None:
                buf = pack_bucket(params, bucket, buffers.get(bucket_size(bucket), i) if buffers is not None else None)
            if pending is not None:
                pending.wait()
                pending = None
                if on_bucket is not None:
                    on_bucket(i - 1)
            if not joined:
                # The handshake: wait (polling) until every worker is receiving.
                send_header(group, HEADER_DATA, i, poll=poll)
                joined = True
            else:
                # A worker that reads DATA always posts the bucket's receive next, so the data can be
                # queued right behind the header: no trainer wake-up between the two.
                group.broadcast_async(_header(HEADER_DATA, i))
            pending = group.broadcast_async(buf)
            sent += buf.numel()
        if pending is not None:
            pending.wait()
            pending = None
            if on_bucket is not None:
                on_bucket(len(plan.buckets) - 1)
        send_header(group, HEADER_END, len(plan.buckets), poll=None if joined else poll)
    except BaseException as exc:
        if not joined:
            raise GroupOutOfSync(f"workers never joined the broadcast: {exc!r}") from exc
        if pending is not None:
            pending.wait()
        send_header(group, HEADER_ABORT, -1)
        raise
    return sent


def receive_buckets(group: GlooGroup, plan: BucketPlan, buffers: list | None = None) -> tuple[list[tuple[str, Any]], list]:
    """Worker side: (name, tensor) pairs as views into the received buffers (no extra copy), and
    the buffers. ``buffers`` (one per bucket, right sizes) are reused instead of allocating."""
    import torch

    out: list[tuple[str, Any]] = []
    received: list = []
    # The trainer follows every bucket with a header (the next bucket's, END or ABORT), so the next
    # header's receive is posted together with the bucket's: one wake-up per bucket, not two.
    header = torch.empty(2, dtype=torch.int64)
    header_work = group.broadcast_async(header)
    for i, bucket in enumerate(plan.buckets):
        header_work.wait()
        code, index = int(header[0]), int(header[1])
        if code == HEADER_ABORT:
            raise TransferAborted(f"{ABORT_MESSAGE} after {i} of {len(plan.buckets)} buckets")
        if code != HEADER_DATA or index != i:
            raise RuntimeError(f"weight broadcast out of sync: expected bucket {i}, got header {code},{index}")
        size = bucket_size(bucket)
        reuse = buffers[i] if buffers is not None and i < len(buffers) else None
        buf = reuse if reuse is not None and reuse.numel() == size else torch.empty(size, dtype=torch.uint8)
        data_work = group.broadcast_async(buf)
        header = torch.empty(2, dtype=torch.int64)
        header_work = group.broadcast_async(header)
        data_work.wait()
        received.append(buf)
        for slot in bucket:
            dtype = getattr(torch, slot.dtype)
            out.append((slot.name, buf[slot.offset : slot.offset + slot.nbytes].view(dtype).view(slot.shape)))
    header_work.wait()
    if int(header[0]) != HEADER_END:
        raise TransferAborted(f"{ABORT_MESSAGE} after all {len(plan.buckets)} buckets")
    return out, received
