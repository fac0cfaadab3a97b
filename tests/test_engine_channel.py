"""The engine's data channel (engine.data_channel: tcp) on the real engine actor: the same
generations as a Ray actor call, bit for bit; a consumer going away aborts the request in vLLM;
the engine's refusals keep their meaning; a wrong token or a lost connection is an engine lost."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses

import pytest

from rollout_service.engine.channel import ChannelServer
from rollout_service.engine.types import ChannelAddress, EngineLost
from rollout_service.engine.types import GenerateRequest
from rollout_service.engine.sampling import SamplingOptions
from rollout_service.fleet.client import FleetClient
from rollout_service.fleet.types import FleetView, Member, is_engine_death


PROMPT = [151644, 872, 198, 9707, 11, 1879, 0, 151645, 198, 151644, 77091, 198]


def _request(seed: int, max_tokens: int = 12, **sampling) -> GenerateRequest:
    return GenerateRequest(prompt_ids=list(PROMPT), sampling=SamplingOptions.validated(seed=seed, **sampling),
                           max_tokens=max_tokens)


@pytest.fixture(scope="module")
def channel_address(engine_actor) -> ChannelAddress:
    import ray

    return ray.get(engine_actor.open_channel.remote(), timeout=60)


def _client(engine_actor, address) -> tuple[FleetClient, Member, Member]:
    over_tcp = Member(0, 0, engine_actor, 0, address)
    over_ray = Member(0, 0, engine_actor, 0, None)
    return FleetClient(None, FleetView(1, "0", (over_tcp,))), over_tcp, over_ray


async def _collect(client, member, request, stream):
    return [c async for c in client.generate(member, request, stream)]


async def test_channel_generations_equal_ray_calls(engine_actor, channel_address):
    client, tcp, ray_member = _client(engine_actor, channel_address)
    try:
        for stream in (False, True):
            for seed in (1, 2):
                req = _request(seed, top_logprobs=2)
                via_tcp = await _collect(client, tcp, dataclasses.replace(req, request_id=f"t{seed}{stream}"), stream)
                via_ray = await _collect(client, ray_member, dataclasses.replace(req, request_id=f"r{seed}{stream}"),
                                         stream)
                if not stream:
                    assert len(via_tcp) == len(via_ray) == 1
                a, b = type(via_tcp[0]).concat(via_tcp), type(via_ray[0]).concat(via_ray)
                assert len(a.token_ids) == 12 and a.token_ids == b.token_ids
                assert a.logprobs == b.logprobs  # bit-exact floats through msgpack
                assert a.top_logprobs == b.top_logprobs and len(a.top_logprobs) == 12
                assert all(isinstance(k, int) for d in a.top_logprobs for k in d)
                assert a.finish_reason == b.finish_reason == "length"
                assert [tuple(w) for w in a.weight_versions] == [tuple(w) for w in b.weight_versions]
                assert a.num_prompt_tokens == len(PROMPT)
    finally:
        client.close_channels()


async def test_a_consumer_going_away_aborts_the_request_in_the_engine(engine_actor, channel_address):
    """The engine is paused (keep) after the first chunk, so the request cannot finish by itself:
    it leaves the engine only through the abort the consumer's going away triggers."""
    client, tcp, _ = _client(engine_actor, channel_address)
    try:
        chunks = client.generate(tcp, _request(3, max_tokens=400, ignore_eos=True), True)
        first = await chunks.__anext__()
        assert first.token_ids and first.finish_reason is None
        await engine_actor.pause.remote(mode="keep")
        try:
            assert await engine_actor.num_in_flight.remote() == 1
            await chunks.aclose()  # the client went away mid-generation
            for _ in range(200):
                if await engine_actor.num_in_flight.remote() == 0:
                    break
                await asyncio.sleep(0.05)
            assert await engine_actor.num_in_flight.remote() == 0
        finally:
            await engine_actor.resume.remote()
        # The connection is still good for the next call.
        assert len((await _collect(client, tcp, _request(4, max_tokens=3), False))[0].token_ids) == 3
    finally:
        client.close_channels()


async def test_an_engine_refusal_keeps_its_meaning(engine_actor, channel_address):
    from vllm.exceptions import VLLMClientError

    from rollout_service.serve.errors import engine_refusal

    client, tcp, ray_member = _client(engine_actor, channel_address)
    too_long = GenerateRequest(prompt_ids=[100] * 2000, sampling=SamplingOptions.validated(seed=0), max_tokens=4)
    try:
        errors = []
        for member in (tcp, ray_member):
            with pytest.raises(Exception) as info:
                await _collect(client, member, dataclasses.replace(too_long, request_id=f"long-{id(member)}"), False)
            errors.append(info.value)
        tcp_error, ray_error = errors
        assert isinstance(tcp_error.cause, VLLMClientError), tcp_error
        assert not is_engine_death(tcp_error)
        mapped, expected = engine_refusal(tcp_error), engine_refusal(ray_error)
        assert mapped is not None and expected is not None
        assert (mapped.status, mapped.code) == (expected.status, expected.code) == (400, "engine_rejected_request")
        # Nothing was left running, and the channel still serves.
        assert await engine_actor.num_in_flight.remote() == 0
        assert (await _collect(client, tcp, _request(5, max_tokens=2), False))[0].token_ids
    finally:
        client.close_channels()


async def test_a_wrong_token_is_refused_as_an_engine_lost(engine_actor, channel_address):
    client, _, _ = _client(engine_actor, channel_address)
    wrong = Member(0, 0, engine_actor, 0, dataclasses.replace(channel_address, token="0" * 32))
    try:
        with pytest.raises(EngineLost) as info:
            await asyncio.wait_for(_collect(client, wrong, _request(6), False), 30)
        assert is_engine_death(info.value)
        assert await engine_actor.num_in_flight.remote() == 0
    finally:
        client.close_channels()


async def test_a_lost_connection_fails_its_calls_and_the_next_call_reconnects():
    """A channel server in this process whose generation never ends: closing the server's side of
    the connection (the engine process dying) fails the call in flight as EngineLost; so does a
    port nobody listens on; a member leaving the fleet's view closes its channel."""
    started = asyncio.Event()

    async def forever(request):
        started.set()
        await asyncio.sleep(3600)
        yield  # pragma: no cover

    async def never(request):
        await asyncio.sleep(3600)

    server = ChannelServer(forever, never)
    address = await server.start("127.0.0.1")
    member = Member(0, 0, None, 0, address)
    client = FleetClient(None, FleetView(1, "0", (member,)))
    try:
        call = asyncio.ensure_future(_collect(client, member, _request(7), True))
        await asyncio.wait_for(started.wait(), 10)
        for task in list(server._conns):
            task.cancel()  # the engine's end of the connection goes away
        with pytest.raises(EngineLost):
            await asyncio.wait_for(call, 10)

        # The next call reconnects; the member then leaves the view: its call fails at once.
        started.clear()
        call = asyncio.ensure_future(_collect(client, member, _request(8), True))
        await asyncio.wait_for(started.wait(), 10)
        client._set_view(FleetView(2, "0", ()))
        with pytest.raises(EngineLost):
            await asyncio.wait_for(call, 10)
        assert not client.channels
    finally:
        server.close()
        client.close_channels()

    nobody = Member(1, 0, None, 0, ChannelAddress("127.0.0.1", address.port, address.token))
    with contextlib.suppress(Exception):
        await asyncio.sleep(0.1)  # the server's port is closed now
    with pytest.raises(EngineLost):
        await asyncio.wait_for(_collect(FleetClient(None, FleetView(3, "0", (nobody,))), nobody, _request(9), False), 20)


async def test_both_ends_of_a_channel_connection_use_tcp_keepalive():
    """A peer whose machine or network dies without closing the socket is found by TCP keepalive
    (the channel's idle / interval / count), not never: set on the engine's and the client's end."""
    import socket

    from rollout_service.engine import channel as ch

    accepted: list = []

    async def one(request):
        yield None  # pragma: no cover

    async def whole(request):
        return None  # pragma: no cover

    server = ChannelServer(one, whole)
    address = await server.start("127.0.0.1")
    real_serve = server._serve

    async def spy(reader, writer):
        accepted.append(writer.get_extra_info("socket"))
        await real_serve(reader, writer)

    server._server.close()
    server._server = await asyncio.start_server(spy, "127.0.0.1", address.port)
    channel = ch.EngineChannel(address)
    try:
        await channel._ensure()
        deadline = asyncio.get_running_loop().time() + 5
        while not accepted:
            assert asyncio.get_running_loop().time() < deadline
            await asyncio.sleep(0.01)
        for sock in (channel._writer.get_extra_info("socket"), accepted[0]):
            assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == ch.KEEPALIVE_IDLE_S
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL) == ch.KEEPALIVE_INTERVAL_S
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT) == ch.KEEPALIVE_COUNT
    finally:
        channel.close()
        server.close()


async def test_control_calls_answer_run_to_their_end_and_refuse_unknown_methods():
    """``ctl`` frames (a refit's phases over the channel): the result comes back; an error in the
    engine keeps its type; an unregistered method is refused; a caller that gives up (deadline)
    or a connection that closes does not cancel the call in the engine (as with a Ray call); a
    lost connection fails the call in flight as EngineLost."""
    from rollout_service.engine.channel import EngineChannel
    from rollout_service.engine.types import EngineCallError

    finished, started, release = [], asyncio.Event(), asyncio.Event()

    async def add(a, b):
        return {"sum": a + b, "args": [a, b]}

    async def fail():
        raise RuntimeError("injected fault: pause failed before its work")

    async def slow(tag):
        started.set()
        await release.wait()
        finished.append(tag)
        return tag

    async def unused(request):
        yield None  # pragma: no cover

    server = ChannelServer(unused, unused, {"add": add, "fail": fail, "slow": slow})
    address = await server.start("127.0.0.1")
    channel = EngineChannel(address)
    try:
        assert await channel.control("add", 2, 3) == {"sum": 5, "args": [2, 3]}
        with pytest.raises(EngineCallError, match="injected fault") as err:
            await channel.control("fail")
        assert isinstance(err.value.cause, RuntimeError) and not is_engine_death(err.value)
        with pytest.raises(EngineCallError, match="unknown control method"):
            await channel.control("refit_pause")
        # the caller's deadline passes: the engine still runs the call to its end
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(channel.control("slow", "a"), 0.2)
        release.set()
        await asyncio.sleep(0.2)
        assert finished == ["a"]
        # the connection closes mid-call: the caller sees EngineLost, the engine still finishes it
        started.clear(), release.clear()
        call = asyncio.ensure_future(channel.control("slow", "b"))
        await asyncio.wait_for(started.wait(), 10)
        for task in list(server._conns):
            task.cancel()
        with pytest.raises(EngineLost):
            await asyncio.wait_for(call, 10)
        release.set()
        await asyncio.sleep(0.2)
        assert finished == ["a", "b"]
        assert await channel.control("add", 1, 1) == {"sum": 2, "args": [1, 1]}  # reconnected
    finally:
        channel.close()
        server.close()
