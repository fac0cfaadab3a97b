"""The engine's data channel: generations between the data plane and an engine actor over one TCP
connection per (process, engine), instead of a Ray actor call per generation.

Why: a Ray actor call costs both sides CPU in Ray's task machinery (task spec, scheduling on the
actor's event loop, the result's serialization into a Ray object, the owner's bookkeeping), about
ten times what a socket with msgpack frames costs (docs/benchmarks.md, "Figures kept out of the
code"). The data plane makes one such
call per turn. The control plane (health, weight versions, a refit's failure path) stays on Ray
calls; a refit's three happy-path fan-outs may go over the channel too (``ctl`` frames, below),
because a refit's stall on a fleet of many engines is mostly the Ray-call cost of its fan-outs
(docs/scale.md).

Wire: every frame is a 4-byte big-endian length and a msgpack array (msgspec, the encoder vLLM
itself uses between its processes). Client to engine: ``["hello", token]`` once, then
``["gen", id, stream, request]`` and ``["cancel", id]``. Engine to client: ``["chunk", id, chunk]``
(one per batched chunk; a non-streaming call sends its whole generation as one), ``["end", id]``,
``["error", id, type, message, client_error, parameter]``; control: ``["ctl", id, method, args]``
(``method`` one of the names the engine registers, e.g. ``refit_pause``) answered by
``["result", id, value]`` or ``error``. Calls are multiplexed on the one connection. A control call
is not cancelled by its caller giving up or by the connection closing: like a Ray actor call, it
runs to its end in the engine (a half-done pause or load must not be torn). The token (random, from the engine, handed out by the fleet with the address) keeps
anything else that reaches the port out; frames are decoded as plain msgpack into typed objects,
never unpickled.

Failure semantics mirror a dead actor's: a connection that cannot be opened or is lost fails every
call on it with :class:`EngineLost`, which :func:`rollout_service.fleet.client.is_engine_death`
counts as the engine gone (the data plane retries a call that produced nothing on another engine
and tells the fleet, which probes the engine at once). A consumer that stops reading (client gone,
call cancelled) sends ``cancel``, and the engine aborts the vLLM request, as ``ray.cancel`` did.
An error raised by the engine comes back as :class:`EngineCallError` whose ``cause`` is vLLM's
client error when it was one (a 400 for the data plane), else a ``RuntimeError`` naming it.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import secrets
import socket
import struct
import sys
from typing import Any, AsyncIterator, Awaitable, Callable, Mapping

import msgspec

from rollout_service.engine.sampling import SamplingOptions, SamplingParamsError
from rollout_service.engine.types import ChannelAddress, EngineCallError, EngineLost, GenerateRequest, GenerationChunk

logger = logging.getLogger(__name__)

_HEADER = struct.Struct("!I")
MAX_FRAME = 64 << 20  # a frame carries one request's prompt ids or one chunk: far below this
CONNECT_TIMEOUT_S = 10.0
KEEPALIVE_IDLE_S, KEEPALIVE_INTERVAL_S, KEEPALIVE_COUNT = 10, 5, 3
# Errors by which the engine says it cannot serve at all (shut down, its engine core dead): the call
# is handled as on a dead engine (retried elsewhere if it produced nothing), not as a failed request.
_ENGINE_GONE = frozenset({"EngineUnavailable", "EngineDeadError"})


def _encode_request(request) -> dict[str, Any]:
    out = {"prompt_ids": request.prompt_ids, "sampling": request.sampling.model_dump(exclude_defaults=True),
           "max_tokens": request.max_tokens, "request_id": request.request_id}
    if request.batch_window_s is not None:
        out["batch_window_s"] = request.batch_window_s
    if request.rollout_id is not None:
        out["rollout_id"] = request.rollout_id
    return out


def _decode_request(raw: Any):

    if not isinstance(raw, dict):
        raise ValueError("a request must be a map")
    return GenerateRequest(prompt_ids=msgspec.convert(raw["prompt_ids"], list[int]),
                           sampling=SamplingOptions.model_validate(raw["sampling"]),
                           max_tokens=msgspec.convert(raw["max_tokens"], int),
                           request_id=msgspec.convert(raw["request_id"], str),
                           batch_window_s=msgspec.convert(raw.get("batch_window_s"), float | None),
                           rollout_id=msgspec.convert(raw.get("rollout_id"), str | None))


def _remote_error(type_name: str, message: str, client_error: bool, parameter: str | None) -> EngineCallError:
    cause: BaseException
    if client_error:
        from vllm.exceptions import VLLMValidationError

        cause = VLLMValidationError(message, parameter=parameter)
    else:
        cause = RuntimeError(f"{type_name}: {message}")
    return EngineCallError(f"the engine raised {type_name}: {message}", cause)


def _is_client_error(exc: Exception) -> bool:
    """The request was refused (a 400 for the data plane), not the engine broken. vLLM's client errors
    can only come from a process that imported vLLM; the simulated engine never does."""
    if isinstance(exc, SamplingParamsError):
        return True
    vllm_exceptions = sys.modules.get("vllm.exceptions")
    return vllm_exceptions is not None and isinstance(exc, vllm_exceptions.VLLMClientError)


def keepalive(writer: asyncio.StreamWriter) -> None:
    """TCP keepalive on a channel connection (both ends): a peer whose machine or network died
    without closing the socket is found within about KEEPALIVE_IDLE_S + KEEPALIVE_COUNT x
    KEEPALIVE_INTERVAL_S of silence, and the calls on the connection fail over."""
    sock = writer.get_extra_info("socket")
    if sock is None:
        return
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for name, value in (("TCP_KEEPIDLE", KEEPALIVE_IDLE_S), ("TCP_KEEPINTVL", KEEPALIVE_INTERVAL_S),
                            ("TCP_KEEPCNT", KEEPALIVE_COUNT)):
            if hasattr(socket, name):  # Linux; elsewhere the system's keepalive timing applies
                sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)
    except OSError as exc:  # a socket that refuses options still carries calls; the fleet's probes remain
        logger.warning("engine data channel: TCP keepalive not set: %s", exc)


def _frame(encoder: msgspec.msgpack.Encoder, msg: list) -> bytes:
    body = encoder.encode(msg)
    return _HEADER.pack(len(body)) + body


async def _read_frame(reader: asyncio.StreamReader, decoder: msgspec.msgpack.Decoder) -> Any:
    (n,) = _HEADER.unpack(await reader.readexactly(_HEADER.size))
    if n > MAX_FRAME:
        raise ValueError(f"frame of {n} bytes")
    return decoder.decode(await reader.readexactly(n))


# --------------------------------------------------------------------------------- engine side
class ChannelServer:
    """Serves an engine's generations on a TCP port (one per engine actor).

    ``generate(request)`` streams chunks, ``generate_all(request)`` returns the whole generation:
    the engine replica's own methods. Closing a call's task aborts its vLLM request (the replica's
    generators abort in their ``finally``)."""

    def __init__(self, generate: Callable[[Any], AsyncIterator], generate_all: Callable[[Any], Any],
                 control: Mapping[str, Callable[..., Awaitable[Any]]] | None = None):
        self._generate, self._generate_all = generate, generate_all
        self._control = dict(control or {})
        self._server: asyncio.AbstractServer | None = None
        self._conns: set[asyncio.Task] = set()
        self._control_calls: set[asyncio.Task] = set()  # held to their end, never cancelled
        self.control_calls = 0  # control calls served (health: which path a refit took)
        self.token = secrets.token_hex(16)
        self.address: ChannelAddress | None = None

    async def start(self, host: str) -> ChannelAddress:
        if self._server is None:
            self._server = await asyncio.start_server(self._serve, host, 0)
            port = self._server.sockets[0].getsockname()[1]
            self.address = ChannelAddress(host, port, self.token)
            logger.info("engine data channel on %s", self.address)
        return self.address

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        for task in list(self._conns):
            task.cancel()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._conns.add(asyncio.current_task())
        keepalive(writer)
        decoder, encoder = msgspec.msgpack.Decoder(), msgspec.msgpack.Encoder()
        calls: dict[int, asyncio.Task] = {}
        try:
            hello = await asyncio.wait_for(_read_frame(reader, decoder), CONNECT_TIMEOUT_S)
            if not (isinstance(hello, list) and hello[:1] == ["hello"] and len(hello) == 2
                    and isinstance(hello[1], str) and secrets.compare_digest(hello[1], self.token)):
                logger.warning("engine data channel: connection without the engine's token refused")
                return
            while True:
                msg = await _read_frame(reader, decoder)
                kind = msg[0] if isinstance(msg, list) and msg else None
                if kind == "gen" and len(msg) == 4 and isinstance(msg[1], int):
                    cid = msg[1]
                    calls[cid] = asyncio.get_running_loop().create_task(
                        self._call(cid, bool(msg[2]), msg[3], writer, encoder, calls))
                elif kind == "ctl" and len(msg) == 4 and isinstance(msg[1], int) and isinstance(msg[3], list):
                    self.control_calls += 1
                    task = asyncio.get_running_loop().create_task(self._run_control(msg[1], msg[2], msg[3], writer, encoder))
                    self._control_calls.add(task)
                    task.add_done_callback(self._control_calls.discard)
                elif kind == "cancel" and len(msg) == 2:
                    task = calls.pop(msg[1], None)
                    if task is not None:
                        task.cancel()
                else:
                    raise ValueError(f"unexpected frame {str(msg)[:80]}")
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.TimeoutError):
            pass  # the client went away: its calls are cancelled below
        except asyncio.CancelledError:
            pass
        except Exception as exc:  # a malformed frame: drop the connection, the engine goes on
            logger.warning("engine data channel: dropping a connection: %s", exc)
        finally:
            for task in calls.values():
                task.cancel()
            writer.close()
            self._conns.discard(asyncio.current_task())

    async def _call(self, cid: int, stream: bool, raw: Any, writer: asyncio.StreamWriter,
                    encoder: msgspec.msgpack.Encoder, calls: dict[int, asyncio.Task]) -> None:
        try:
            request = _decode_request(raw)
            if stream:
                chunks = self._generate(request)
                async with contextlib.aclosing(chunks):
                    async for chunk in chunks:
                        writer.write(_frame(encoder, ["chunk", cid, chunk]))
                        await writer.drain()
            else:
                writer.write(_frame(encoder, ["chunk", cid, await self._generate_all(request)]))
            writer.write(_frame(encoder, ["end", cid]))
        except asyncio.CancelledError:
            raise
        except ConnectionError:
            pass
        except Exception as exc:
            with contextlib.suppress(Exception):
                writer.write(_frame(encoder, ["error", cid, type(exc).__name__, str(exc)[:2000], _is_client_error(exc),
                                              getattr(exc, "parameter", None) or getattr(exc, "param", None)]))
        finally:
            calls.pop(cid, None)


    async def _run_control(self, cid: int, method: Any, args: list, writer: asyncio.StreamWriter,
                           encoder: msgspec.msgpack.Encoder) -> None:
        try:
            fn = self._control.get(method) if isinstance(method, str) else None
            if fn is None:
                raise ValueError(f"unknown control method {str(method)[:80]!r}")
            frame = _frame(encoder, ["result", cid, await fn(*args)])
        except Exception as exc:
            frame = _frame(encoder, ["error", cid, type(exc).__name__, str(exc)[:2000], False, None])
        if not writer.is_closing():
            with contextlib.suppress(Exception):
                writer.write(frame)


# --------------------------------------------------------------------------------- client side
class EngineChannel:
    """One connection to one engine, opened on first use; calls are multiplexed on it."""

    def __init__(self, address: ChannelAddress):
        self.address = address
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._reading: asyncio.Task | None = None
        self._connecting: asyncio.Lock | None = None
        self._calls: dict[int, asyncio.Queue] = {}
        self._ids = itertools.count(1)
        self._encoder = msgspec.msgpack.Encoder()
        self.closed = False

    async def _ensure(self) -> asyncio.StreamWriter:
        if self.closed:
            raise EngineLost(f"engine channel {self.address} is closed")
        if self._writer is not None:
            return self._writer
        if self._connecting is None:
            self._connecting = asyncio.Lock()
        async with self._connecting:
            if self._writer is None:
                try:
                    reader, writer = await asyncio.wait_for(
                        asyncio.open_connection(self.address.host, self.address.port), CONNECT_TIMEOUT_S)
                except (OSError, asyncio.TimeoutError) as exc:
                    raise EngineLost(f"engine channel {self.address} unreachable: {exc!r}") from None
                keepalive(writer)
                writer.write(_frame(self._encoder, ["hello", self.address.token]))
                self._reader, self._writer = reader, writer
                self._reading = asyncio.get_running_loop().create_task(self._read_loop(reader))
        return self._writer

    async def connect(self) -> None:
        """Open the connection now (raises EngineLost if it cannot be opened)."""
        await self._ensure()

    async def control(self, method: str, *args: Any) -> Any:
        """Run the engine's control method ``method(*args)`` (msgpack-encodable arguments and
        result) and return its result. Raises EngineLost when the connection is lost before the
        answer (the call may or may not have run) or the engine answers that it cannot serve (then
        with ``answered = True``), EngineCallError for an error in the engine.
        Giving up on the call does not cancel it in the engine."""
        writer = await self._ensure()
        cid = next(self._ids)
        queue: asyncio.Queue = asyncio.Queue()
        self._calls[cid] = queue
        try:
            writer.write(_frame(self._encoder, ["ctl", cid, method, list(args)]))
            msg = await queue.get()
        finally:
            self._calls.pop(cid, None)
        if msg[0] == "result":
            return msg[2]
        if msg[0] == "error":
            if msg[2] in _ENGINE_GONE:  # the engine answered that it cannot serve (not a lost connection)
                lost = EngineLost(f"engine {self.address}: {msg[2]}: {msg[3]}")
                lost.answered = True
                raise lost
            raise _remote_error(*msg[2:6])
        raise EngineLost(f"engine channel {self.address} {msg[1]}")

    async def _read_loop(self, reader: asyncio.StreamReader) -> None:
        decoder = msgspec.msgpack.Decoder()
        reason = "closed by the engine"
        try:
            while True:
                msg = await _read_frame(reader, decoder)
                queue = self._calls.get(msg[1])
                if queue is not None:  # else: a call already given up (its cancel crossed this frame)
                    queue.put_nowait(msg)
        except asyncio.CancelledError:
            reason = "closed"
            raise
        except (asyncio.IncompleteReadError, ConnectionError) as exc:
            reason = f"lost: {exc!r}"
        except Exception as exc:
            reason = f"unreadable: {exc!r}"
        finally:
            self._drop(reason)

    def _drop(self, reason: str) -> None:
        """The connection is gone: fail every call on it; the next call reconnects."""
        writer, self._reader, self._writer, self._reading = self._writer, None, None, None
        if writer is not None:
            writer.close()
        for queue in self._calls.values():
            queue.put_nowait(["lost", reason])

    async def call(self, request, stream: bool) -> AsyncIterator:
        """The generation's chunks (one for a non-streaming call). Closing the iterator before its
        end cancels the call in the engine, which aborts the vLLM request."""

        writer = await self._ensure()
        cid = next(self._ids)
        queue: asyncio.Queue = asyncio.Queue()
        self._calls[cid] = queue
        finished = False
        try:
            writer.write(_frame(self._encoder, ["gen", cid, stream, _encode_request(request)]))
            while True:
                msg = await queue.get()
                kind = msg[0]
                if kind == "chunk":
                    yield msgspec.convert(msg[2], GenerationChunk)
                elif kind == "end":
                    finished = True
                    return
                elif kind == "error":
                    finished = True
                    if msg[2] in _ENGINE_GONE:
                        raise EngineLost(f"engine {self.address}: {msg[2]}: {msg[3]}")
                    raise _remote_error(*msg[2:6])
                else:  # lost
                    finished = True
                    raise EngineLost(f"engine channel {self.address} {msg[1]}")
        finally:
            self._calls.pop(cid, None)
            if not finished and self._writer is writer and not writer.is_closing():
                with contextlib.suppress(Exception):
                    writer.write(_frame(self._encoder, ["cancel", cid]))

    def close(self) -> None:
        self.closed = True
        if self._reading is not None:
            self._reading.cancel()
        self._drop("closed: the engine left the fleet")
