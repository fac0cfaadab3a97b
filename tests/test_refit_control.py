"""How the refit controller reaches an engine (rollout_service.refit.control), with a real Ray actor
for the engine's life and a real channel server for its control connection: calls go over the
channel only in ``channel`` mode and when the connection answered its check; a lost connection is
classified by asking Ray — an engine that lives is in an unknown state (ControlLost, not an engine
death), one that died is reported dead; the engine saying it cannot serve is an engine death."""

from __future__ import annotations

import asyncio

import pytest

from rollout_service.engine.channel import ChannelServer
from rollout_service.fleet.types import Member, is_engine_death
from rollout_service.refit.control import ControlLost, EngineControl


async def _unused(request):
    yield None  # pragma: no cover


@pytest.fixture
def actor(ray_session):
    import ray

    class _Alive:  # defined here: Ray ships it by value (the workers cannot import this test module)
        def num_in_flight(self) -> int:
            return 0

        def refit_pause(self, clear_cache: bool) -> dict:
            return {"in_flight": 0, "aborted": 0, "seconds": 0.0, "by": "ray"}

    handle = ray.remote(_Alive).options(num_cpus=0).remote()
    ray.get(handle.num_in_flight.remote(), timeout=60)
    yield handle
    ray.kill(handle, no_restart=True)


async def test_the_path_a_call_takes_and_how_a_lost_connection_is_classified(actor):
    import ray

    started, release = asyncio.Event(), asyncio.Event()

    async def ready():
        return True

    async def pause(clear_cache):
        return {"in_flight": 0, "aborted": 0, "seconds": 0.0, "by": "channel"}

    async def apply(*args):
        started.set()
        await release.wait()
        return {"ok": True}

    async def gone(timeout):
        from rollout_service.engine.types import EngineUnavailable

        raise EngineUnavailable("engine 0 errored: its core died")

    server = ChannelServer(_unused, _unused, {"refit_ready": ready, "refit_pause": pause, "refit_apply": apply,
                                              "refit_commit_resume": gone})
    address = await server.start("127.0.0.1")
    member = Member(0, 0, actor, 0, address)
    control = EngineControl("channel")
    try:
        await control.prepare([member], timeout=10)
        assert (await control.call(member, "refit_pause", False))["by"] == "channel"
        assert (await control.call(member, "refit_pause", False, ray_only=True))["by"] == "ray"

        # the engine answers that it cannot serve: an engine death, without asking Ray
        with pytest.raises(Exception) as err:
            await control.call(member, "refit_commit_resume", 1.0)
        assert is_engine_death(err.value)

        # the connection drops mid-apply while the actor lives: unknown state, not a death
        call = asyncio.ensure_future(control.call(member, "refit_apply", {}, "v1", None, 1.0))
        await asyncio.wait_for(started.wait(), 10)
        for task in list(server._conns):
            task.cancel()
        with pytest.raises(ControlLost):
            await asyncio.wait_for(call, 30)
        assert not is_engine_death(ControlLost("x"))
        release.set()

        # the same with the actor dead: reported as Ray reports a dead actor
        await control.prepare([member], timeout=10)  # reconnected and checked
        started.clear(), release.clear()
        call = asyncio.ensure_future(control.call(member, "refit_apply", {}, "v2", None, 1.0))
        await asyncio.wait_for(started.wait(), 10)
        ray.kill(actor, no_restart=True)  # the engine's process dies (here, before its connection drops)
        for _ in range(100):
            try:
                await actor.num_in_flight.remote()
                await asyncio.sleep(0.1)
            except Exception:
                break
        for task in list(server._conns):
            task.cancel()
        with pytest.raises(Exception) as err:
            await asyncio.wait_for(call, 30)
        assert not isinstance(err.value, ControlLost) and is_engine_death(err.value), repr(err.value)
        release.set()

        # ray mode: no channel is used (and the open ones are closed)
        control.mode = "ray"
        await control.prepare([member], timeout=10)
        assert control.channel(member) is None
    finally:
        control.close()
        server.close()


async def test_an_engine_whose_channel_does_not_answer_its_check_is_reached_by_ray(actor):
    """A wrong token (or a dead port) fails the check before the pause: that engine's phases go by
    Ray calls instead of failing the refit."""
    server = ChannelServer(_unused, _unused, {})
    address = await server.start("127.0.0.1")
    from rollout_service.engine.types import ChannelAddress

    member = Member(0, 0, actor, 0, ChannelAddress(address.host, address.port, "not-the-token"))
    control = EngineControl("channel")
    try:
        await control.prepare([member], timeout=5)
        assert control.channel(member) is None
        assert (await control.call(member, "refit_pause", False))["by"] == "ray"
    finally:
        control.close()
        server.close()
