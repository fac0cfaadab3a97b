"""The control plane heals: the fleet actor and the refit controller, killed with SIGKILL, are
restarted by Ray; the fleet's new incarnation adopts the running engines (same processes, same
weights), the data plane keeps serving on its last view meanwhile and re-attaches, a trainer's
next refit works on the same handle, and a refit cut short by its controller's death ends with
every engine resumed on one version. ``/health`` says 503 when the fleet is gone for good.

On simulated engines (engine.backend: simulated): real Ray actors and processes, killed by real
signals; what is tested is the fleet's and the controller's life cycle, not the engine's.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import threading
import time

import httpx
import pytest
import ray

APP = "heal"
ENGINES = 4


def _config(tiny_model_dir, redis_url):
    from rollout_service.config import RolloutServiceConfig

    return RolloutServiceConfig.model_validate({
        "engine": {"model": str(tiny_model_dir), "backend": "simulated", "num_engines": ENGINES,
                   "num_cpus_per_engine": 0, "max_num_seqs": 16,
                   "sim": {"decode_step_s": 0.003, "decode_step_s_per_seq": 0.0001, "prefill_s_per_token": 1e-6}},
        "store": {"redis_url": redis_url, "key_prefix": APP},
        "service": {"instance_name": APP, "num_affinity_replicas": 1},
        "fleet": {"app_watch_interval_s": 0.3, "probe_interval_s": 0.5, "resume_unbracketed_pause_s": 2.0,
                  "unresponsive_after_s": 60.0, "probe_timeout_s": 5.0},
        "refit": {"step_timeout_s": 30.0},
    })


def _pid(actor) -> int:
    return ray.get(actor.__ray_call__.remote(lambda self: os.getpid()), timeout=60)


def _engine_states(fleet) -> dict[int, tuple[int, bool, str]]:
    view = ray.get(fleet.view.remote(), timeout=60)
    out = {}
    for m in view.members:
        h = ray.get(m.handle.health.remote(), timeout=60)
        out[m.slot] = (h["pid"], h["paused"], h["weight_version"])
    return out


def _wait(cond, timeout, what):
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


async def _rollouts(base: str, prefix: str, n: int, failures: list, concurrency: int = 8) -> int:
    sem = asyncio.Semaphore(concurrency)
    done = 0

    async def one(client, i):
        nonlocal done
        async with sem:
            rid = f"{prefix}-{i}"
            messages = [{"role": "user", "content": f"task {i}"}]
            for turn in range(2):
                r = await client.post(f"{base}/v1/chat/completions", headers={"X-Rollout-Id": rid}, json={
                    "model": "tiny-qwen3", "messages": messages, "max_tokens": 24, "seed": i})
                if r.status_code != 200:
                    failures.append((rid, turn, r.status_code, r.text[:300]))
                    return
                msg = r.json()["choices"][0]["message"]
                messages += [{"role": "assistant", "content": msg["content"] or ""}, {"role": "user", "content": "more"}]
            done += 1

    async with httpx.AsyncClient(timeout=120) as client:
        await asyncio.gather(*[one(client, i) for i in range(n)])
    return done


def _stored(base: str, prefix: str, n: int) -> None:
    with httpx.Client(timeout=60) as client:
        for i in range(n):
            traj = client.get(f"{base}/v1/rollouts/{prefix}-{i}").json()
            assert traj["turns"] == 2 and len(traj["segments"]) == 1, traj


@pytest.fixture(scope="module")
def heal_app(service, redis_server, tiny_model_dir):
    from ray import serve

    from rollout_service.fleet.fleet import fleet_name, get_fleet
    from rollout_service.serve.app import build_app

    base = f"{service.url}/{APP}"
    serve.run(build_app(_config(tiny_model_dir, redis_server)), name=APP, route_prefix=f"/{APP}")

    def healthy():
        try:
            return httpx.get(f"{base}/health", timeout=30).status_code == 200
        except httpx.HTTPError:
            return False

    _wait(healthy, 300, "the app did not come up")
    fleet = get_fleet(fleet_name(APP))
    _wait(lambda: len(_engine_states(fleet)) == ENGINES, 120, "engines not serving")
    yield base, fleet
    serve.delete(APP)
    from rollout_service.fleet.fleet import FLEET_NAMESPACE

    def gone():
        names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                 if a["namespace"] == FLEET_NAMESPACE and a["name"].startswith(f"{APP}-")]
        return not names or None

    try:
        _wait(gone, 60, "the fleet, its engines or its controller outlived the app")
    finally:
        for a in ray.util.list_named_actors(all_namespaces=True):
            if a["namespace"] == FLEET_NAMESPACE and a["name"].startswith(f"{APP}-"):
                ray.kill(ray.get_actor(a["name"], namespace=FLEET_NAMESPACE), no_restart=True)


def test_a_killed_fleet_is_restarted_adopts_its_engines_and_nothing_is_lost(heal_app, tiny_model_dir, tmp_path):
    from rollout_service.refit.client import TrainerClient
    from rollout_service.refit.controller import controller_name, get_controller

    base, fleet = heal_app
    before = ray.get(fleet.stats.remote(), timeout=60)
    engines = _engine_states(fleet)
    fleet_pid = _pid(fleet)
    failures: list = []
    killed = {}

    def kill_soon():
        time.sleep(1.0)
        os.kill(fleet_pid, signal.SIGKILL)
        killed["at"] = time.monotonic()

    side = threading.Thread(target=kill_soon, daemon=True)
    side.start()
    done = asyncio.run(_rollouts(base, "fk", 120, failures))
    side.join(10)
    assert "at" in killed
    assert failures == [] and done == 120, failures[:5]
    _stored(base, "fk", 120)

    # Restarted, and the app re-attached itself to the new incarnation (the replica does so as soon
    # as the new incarnation answers its view poll).
    after = _wait(lambda: (s := ray.get(fleet.stats.remote(), timeout=60))["incarnation"] != before["incarnation"]
                  and s["apps"] == [APP] and s, 60, "the fleet was not restarted, or the app did not re-attach")
    assert _pid(fleet) != fleet_pid
    assert after["adopted"] == ENGINES and after["weight_version"] == before["weight_version"]
    assert _engine_states(fleet) == engines  # the same engine processes, not restarted
    assert httpx.get(f"{base}/health", timeout=30).status_code == 200

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    shutil.copy(tiny_model_dir / "model.safetensors", ckpt / "model.safetensors")
    trainer = TrainerClient(get_controller(controller_name(APP)), timeout_s=60)
    report = trainer.refit("h1", str(ckpt), transport="path")
    assert report["ok"] and len(report["engines"]) == ENGINES
    assert {v for _, _, v in _engine_states(fleet).values()} == {"h1"}


def test_a_killed_controller_is_restarted_and_a_refit_it_left_half_done_ends_with_every_engine_resumed(
        heal_app, tiny_model_dir, tmp_path):
    """What a controller that dies in the middle of a refit leaves behind is made here step by step
    with the engines' own calls (a SIGKILL cannot be timed into a refit that takes a fraction of a
    second on simulated engines): the fleet's refit bracket open, every engine paused, one engine
    loaded and labelled with the new version, uncommitted. The restarted controller rolls it back
    and resumes every engine on the version the fleet serves; when instead every engine had
    committed the new version, it tells the fleet (roll forward). A pause that lands after its
    refit is over is undone by the fleet."""
    from rollout_service.refit.client import TrainerClient
    from rollout_service.refit.controller import controller_name, get_controller

    base, fleet = heal_app
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    shutil.copy(tiny_model_dir / "model.safetensors", ckpt / "model.safetensors")
    controller = get_controller(controller_name(APP))
    trainer = TrainerClient(controller, timeout_s=60)
    start_version = trainer.stats()["weight_version"]

    # Between refits: the same handle works after the restart, and a trainer that had formed a
    # weight-sync group re-forms it by itself (the restarted controller holds none) and says so.
    from safetensors.torch import load_file

    from rollout_service.refit.types import GROUP_UNKNOWN

    trainer.init_weight_sync()
    pid = _pid(controller)
    os.kill(pid, signal.SIGKILL)
    weights = load_file(str(ckpt / "model.safetensors"))
    report = _wait(lambda: _try(lambda: trainer.refit("c1", weights)), 60, "no refit after the controller's restart")
    assert report["ok"] and _pid(controller) != pid and report["transport"] == "collective"
    assert report["weight_sync_reformed"] == GROUP_UNKNOWN
    assert trainer.stats()["recovered"]["version"] == start_version
    sums = set(trainer.weights_checksums())

    # Mid-refit: bracket open, all paused, engine 0 loaded + labelled "c2" without a commit.
    view = ray.get(fleet.begin_refit.remote(lease_s=600), timeout=60)
    engines = {m.slot: m.handle for m in view.members}
    ray.get([e.pause.remote(mode="keep") for e in engines.values()], timeout=60)
    other = tmp_path / "other"
    other.mkdir()
    shutil.copy(tiny_model_dir / "model.safetensors", other / "model.safetensors")
    ray.get(engines[0].collective_rpc.remote("rs_stage_path", args=(str(other),)), timeout=60)
    ray.get(engines[0].collective_rpc.remote("rs_load_staged"), timeout=60)
    ray.get(engines[0].set_weight_version.remote("c2"), timeout=60)
    os.kill(_pid(controller), signal.SIGKILL)
    recovered = _wait(lambda: _try(lambda: trainer.stats()["recovered"]), 60, "the controller did not come back")
    assert recovered["version"] == "c1" and recovered["rolled_forward"] is None
    assert (recovered["rolled_back"], recovered["relabelled"], recovered["replaced"]) == (1, 1, 0)
    assert {(p, v) for _, p, v in _engine_states(fleet).values()} == {(False, "c1")}
    assert set(trainer.weights_checksums()) == sums  # engine 0 is back on c1's weights
    assert ray.get(fleet.stats.remote())["refitting"] is False

    # Every engine committed "c2", the fleet never heard: rolled forward.
    view = ray.get(fleet.begin_refit.remote(lease_s=600), timeout=60)
    for e in (m.handle for m in view.members):
        ray.get(e.pause.remote(mode="keep"), timeout=60)
        ray.get(e.collective_rpc.remote("rs_stage_path", args=(str(other),)), timeout=60)
        ray.get(e.collective_rpc.remote("rs_load_staged"), timeout=60)
        ray.get(e.set_weight_version.remote("c2"), timeout=60)
        ray.get(e.collective_rpc.remote("rs_commit"), timeout=60)
    os.kill(_pid(controller), signal.SIGKILL)
    recovered = _wait(lambda: _try(lambda: trainer.stats()["recovered"]), 60, "the controller did not come back")
    assert recovered["rolled_forward"] == recovered["version"] == "c2"
    assert ray.get(fleet.stats.remote())["weight_version"] == "c2"
    assert {(p, v) for _, p, v in _engine_states(fleet).values()} == {(False, "c2")}

    # A pause that lands after its refit is over: the fleet resumes it (fleet.resume_unbracketed_pause_s).
    late = ray.get(fleet.view.remote()).members[1].handle
    ray.get(late.pause.remote(mode="keep"), timeout=60)
    t0 = time.monotonic()
    _wait(lambda: not ray.get(late.is_paused.remote()), 30, "an engine left paused outside a refit stayed paused")
    print(f"late pause undone by the fleet after {time.monotonic() - t0:.1f}s")

    report = trainer.refit("c3", str(ckpt), transport="path")
    assert report["ok"] and len(report["engines"]) == ENGINES
    failures: list = []
    assert asyncio.run(_rollouts(base, "ck", 20, failures)) == 20 and failures == []


# (method, when, the step the refit reports): each fault hits one engine of the fleet.
REFIT_FAULTS = [
    ("pause", "after", "pause"),                   # the pause landed, the call failed: a partial pause
    ("pause", "before", "pause"),
    ("rs_stage_path", "before", "transfer"),
    ("rs_load_staged", "after", "load"),           # loaded, then failed: rolled back
    ("set_weight_version", "after", "label"),      # relabelled, then failed
    ("rs_commit", "before", None),                 # past the point of no return: rolled forward
    ("resume", "before", None),                    # committed, one engine left paused: the fleet resumes it
]


@pytest.mark.parametrize("control", ["channel", "ray"])
def test_a_refit_that_fails_on_one_engine_at_any_step_ends_with_every_engine_resumed_on_one_version(
        heal_app, tiny_model_dir, redis_server, tmp_path, control, request):
    """One failure path for every step: a fault injected into one engine of the fleet (the call
    raises before or after doing its work), or one engine stalled by SIGSTOP during the refit. The
    refit fails with the step named, every engine ends unpaused on the previous weights and
    version; a fault past the point of no return (commit, resume) leaves the refit committed, every
    engine unpaused on the new version. The next refit and rollouts work. Both ways the controller
    reaches the engines (refit.control): over their data channels with the weights staged ahead of
    the pause (a failed stage pauses no engine), and by Ray calls with the transfer inside it."""
    from rollout_service.refit.client import TrainerClient
    from rollout_service.refit.controller import controller_name, get_controller
    from rollout_service.refit.types import RefitFailed

    base, fleet = heal_app
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    shutil.copy(tiny_model_dir / "model.safetensors", ckpt / "model.safetensors")
    cfg = _config(tiny_model_dir, redis_server)
    controller = get_controller(controller_name(APP))
    # Over the channels with the weights staged ahead of the pause (the defaults); by Ray calls
    # with the transfer inside the pause: every fault under both staging modes.
    staging = "overlap" if control == "channel" else "inside"
    ray.get(controller.update_config.remote(cfg.model_copy(update={"refit": cfg.refit.model_copy(
        update={"control": control, "staging": staging})}).model_dump()), timeout=60)
    request.addfinalizer(lambda: ray.get(controller.update_config.remote(cfg.model_dump()), timeout=60))
    trainer = TrainerClient(controller, timeout_s=60)

    def control_calls():
        return sum(ray.get([m.handle.health.remote() for m in ray.get(fleet.view.remote(), timeout=60).members],
                           timeout=60)[i]["control_calls"] for i in range(ENGINES))

    calls_before = control_calls()

    def pauses_by_slot():
        return {m.slot: ray.get(m.handle.health.remote(), timeout=60)["pauses"]
                for m in ray.get(fleet.view.remote(), timeout=60).members}

    def settled(version):
        states = _engine_states(fleet)
        return {(p, v) for _, p, v in states.values()} == {(False, version)} and len(states) == ENGINES

    # A stalled engine: the first call of the refit that reaches it is the stage ahead of the pause
    # (overlap: the refit fails at its transfer, with no engine paused) or the pause (inside).
    for i, (method, when, step) in enumerate([*REFIT_FAULTS, ("SIGSTOP", "during",
                                                              "transfer" if staging == "overlap" else "pause")]):
        version = trainer.stats()["weight_version"]
        sums = sorted(trainer.weights_checksums())
        victim = ray.get(fleet.view.remote(), timeout=60).members[1]
        pauses = pauses_by_slot()
        pid = None
        if method == "SIGSTOP":
            pid = ray.get(victim.handle.health.remote(), timeout=60)["pid"]
            os.kill(pid, signal.SIGSTOP)
        else:
            ray.get(victim.handle.inject_fault.remote(method, when), timeout=60)
        t0 = time.monotonic()
        if step is None:
            report = trainer.refit(f"f{i}-{control}", str(ckpt), transport="path", timeout_s=3)
            assert report["ok"] and f"{method.removeprefix('rs_')} failed" in report["error"], report
            assert report["commit_failed"] == ([victim.slot] if method == "rs_commit" else [])
            waited = _wait(lambda: settled(f"f{i}-{control}") and time.monotonic() - t0, 30,
                           f"{method} {when}: an engine was left paused or on another version")
            assert len(set(trainer.weights_checksums())) == 1
            assert ray.get(fleet.stats.remote(), timeout=60)["weight_version"] == f"f{i}-{control}"
            print(f"{method} {when}: committed f{i}-{control}, all serving it unpaused after {waited:.2f}s")
            continue
        try:
            with pytest.raises(RefitFailed) as err:
                trainer.refit(f"f{i}-{control}", str(ckpt), transport="path", timeout_s=3)
        finally:
            if pid is not None:  # (the fleet may have killed the stalled engine already: it replaces one
                with contextlib.suppress(ProcessLookupError):  # that cannot be restored after a failed refit)
                    os.kill(pid, signal.SIGCONT)
        report = err.value.report
        failed_in = time.monotonic() - t0
        assert report["failed_step"] == step, (method, when, report)
        assert not report["ok"] and report["engines_lost"] == [], (method, report)
        if step == "transfer" and staging == "overlap":  # staged while generating: no engine was paused
            assert report["staging"] == "overlap" and report["stall_s"] == 0, report
            if method != "SIGSTOP":  # (the fleet replaces a stalled engine: a new count)
                assert pauses_by_slot() == pauses, (pauses, pauses_by_slot())
        # Resumed by the refit's own way out, or (an engine that refused its resume, or one whose
        # pause landed after the refit gave up) by the fleet within fleet.resume_unbracketed_pause_s.
        waited = _wait(lambda: settled(version) and time.monotonic() - t0, 30,
                       f"{method} {when}: an engine was left paused or on another version")
        print(f"{method} {when}: failed at {report['failed_step']} in {failed_in:.2f}s, "
              f"all resumed on {version} after {waited:.2f}s")
        assert sorted(trainer.weights_checksums()) == sums
        assert ray.get(fleet.stats.remote(), timeout=60)["refitting"] is False

    report = trainer.refit(f"after-faults-{control}", str(ckpt), transport="path")
    assert report["ok"] and len(report["engines"]) == ENGINES
    assert settled(f"after-faults-{control}")
    # the path taken: control frames on the engines' channels, or none at all under Ray calls
    # (engines replaced meanwhile start their count at 0: the sum is a lower bound)
    served = control_calls() - calls_before
    assert served > 0 if control == "channel" else served <= 0, served
    failures: list = []
    assert asyncio.run(_rollouts(base, "rf", 20, failures)) == 20 and failures == []


def test_a_refit_over_the_staging_budget_stages_inside_the_pause_and_status_says_how_it_staged(
        heal_app, tiny_model_dir, redis_server, tmp_path, request):
    """refit.staging: overlap stages ahead of the pause; over refit.staging_budget_bytes the
    engines stage inside it, and the report and GET /v1/status say which, with the stall."""
    from rollout_service.refit.client import TrainerClient
    from rollout_service.refit.controller import controller_name, get_controller

    base, fleet = heal_app
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    shutil.copy(tiny_model_dir / "model.safetensors", ckpt / "model.safetensors")
    size = (ckpt / "model.safetensors").stat().st_size
    cfg = _config(tiny_model_dir, redis_server)
    controller = get_controller(controller_name(APP))
    request.addfinalizer(lambda: ray.get(controller.update_config.remote(cfg.model_dump()), timeout=60))
    trainer = TrainerClient(controller, timeout_s=60)
    for budget, staging in ((size - 1, "inside"), (size, "overlap")):
        ray.get(controller.update_config.remote(cfg.model_copy(update={"refit": cfg.refit.model_copy(
            update={"staging_budget_bytes": budget})}).model_dump()), timeout=60)
        report = trainer.refit(f"budget-{staging}", str(ckpt), transport="path")
        assert report["ok"] and report["staging"] == staging, report
        assert report["stall_s"] > 0 and report["total_s"] >= report["stall_s"] + report["stage_s"]
        if staging == "inside":
            assert report["staged_bytes"] == 0  # (stage_s: the engines' answer that they would not)
            assert f"{size} bytes over refit.staging_budget_bytes ({size - 1})" in report["staging_fallback"]
        else:
            assert report["staged_bytes"] == size and report["stage_s"] > 0 and report["staging_fallback"] is None
        last = httpx.get(f"{base}/v1/status", timeout=60).json()["last_refit"]
        assert last["version"] == f"budget-{staging}" and last["staging"] == staging
        assert last["stall_s"] == pytest.approx(report["stall_s"]) and last["staged_bytes"] == report["staged_bytes"]


def test_a_refit_slow_at_every_step_that_fails_at_its_label_ends_inside_its_lease_each_engine_resumed_once(
        heal_app, tiny_model_dir, tmp_path):
    """One engine takes 80 % of the step timeout at every step it runs (the stage ahead, the pause,
    the load, the label, then the rollback and the relabel of the failure path) and its label
    fails. The refit fails at the label after its slowest path, inside the lease of its bracket
    (refit_lease_s): the fleet never ended the bracket under it (outcome not_committed, not
    lease_expired), every engine was paused once and resumed once (nothing resumed early), and
    all serve the previous weights under the previous version."""
    from rollout_service.refit.client import TrainerClient
    from rollout_service.refit.controller import controller_name, get_controller
    from rollout_service.refit.deadlines import refit_lease_s
    from rollout_service.refit.types import RefitFailed

    base, fleet = heal_app
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    shutil.copy(tiny_model_dir / "model.safetensors", ckpt / "model.safetensors")
    trainer = TrainerClient(get_controller(controller_name(APP)), timeout_s=60)
    step_s = 2.0
    version = trainer.stats()["weight_version"]
    sums = sorted(trainer.weights_checksums())
    members = ray.get(fleet.view.remote(), timeout=60).members
    victim = members[1].handle

    def counts():
        health = ray.get([m.handle.health.remote() for m in members], timeout=60)
        return {m.slot: (h["pauses"], h["resumes"]) for m, h in zip(members, health)}

    before = counts()
    for method, times in (("rs_stage_path", 1), ("pause", 1), ("rs_load_staged", 1), ("set_weight_version", 2),
                          ("rs_rollback", 1)):
        ray.get(victim.inject_delay.remote(method, 0.8 * step_s, times), timeout=60)
    ray.get(victim.inject_fault.remote("set_weight_version", "after"), timeout=60)
    t0 = time.monotonic()
    with pytest.raises(RefitFailed) as err:
        trainer.refit("slow-at-every-step", str(ckpt), transport="path", timeout_s=step_s)
    took = time.monotonic() - t0
    report = err.value.report
    print(f"slow refit failed at {report['failed_step']} after {took:.1f}s (lease {refit_lease_s(step_s):.0f}s)")
    assert report["failed_step"] == "label" and report["rolled_back"], report
    assert took > 5 * 0.8 * step_s and took < refit_lease_s(step_s)
    last = ray.get(fleet.stats.remote(), timeout=60)["last_refit"]
    assert last["outcome"] == "not_committed" and last["version"] is None, last
    assert counts() == {slot: (p + 1, r + 1) for slot, (p, r) in before.items()}
    states = _engine_states(fleet)
    assert {(paused, v) for _, paused, v in states.values()} == {(False, version)}
    assert sorted(trainer.weights_checksums()) == sums


def test_a_fleet_killed_for_good_is_created_again_by_the_data_plane_and_adopts_the_engines(heal_app):
    """ray.kill without restart: no Ray restart comes. The app's replica finds the fleet dead for
    good, creates it again by name, and the new fleet adopts the running engines; meanwhile
    /health answers 503 naming the fleet, never 200 from a stale view."""
    base, fleet = heal_app
    from rollout_service.fleet.fleet import fleet_name, get_fleet

    engines = _engine_states(fleet)
    before = ray.get(fleet.stats.remote(), timeout=60)["incarnation"]
    ray.kill(fleet, no_restart=True)
    seen = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        r = httpx.get(f"{base}/health", timeout=30)
        seen.append(r.status_code)
        if r.status_code == 503:
            assert "fleet" in r.json()["error"]["message"], r.text
        try:
            again = get_fleet(fleet_name(APP))
            stats = ray.get(again.stats.remote(), timeout=10)
        except Exception:
            stats = None
        if r.status_code == 200 and stats and stats["incarnation"] != before and stats["apps"] == [APP]:
            break
        time.sleep(0.2)
    else:
        raise AssertionError(f"the fleet was not created again: health {seen[-5:]}")
    print(f"/health while the fleet was gone: {sorted(set(seen))}")
    assert stats["adopted"] == ENGINES and _engine_states(again) == engines
    failures: list = []
    assert asyncio.run(_rollouts(base, "fg", 20, failures)) == 20 and failures == []


def _checkpoint(tiny_model_dir, where) -> str:
    """A checkpoint directory of its own (the simulated engine's digest covers file times): distinct weights."""
    where.mkdir()
    shutil.copy(tiny_model_dir / "model.safetensors", where / "model.safetensors")
    return str(where)


def _fleet():
    from rollout_service.fleet.fleet import fleet_name, get_fleet

    return get_fleet(fleet_name(APP))


def _restarted(fleet, before: str, cond=lambda s: True, timeout=60):
    return _wait(lambda: (s := _try(lambda: ray.get(fleet.stats.remote(), timeout=10))) and s["incarnation"] != before
                 and cond(s) and s, timeout, "the fleet was not restarted (or did not settle)")


def test_fleet_and_controller_killed_together_between_label_and_commit_end_on_the_committed_version_unasked(
        heal_app, tiny_model_dir, tmp_path):
    """Both control-plane actors die after every engine was loaded and labelled with a new version
    that was never committed. The restarted fleet takes the committed version from its durable
    record, not from the engines' labels (which name the uncommitted one), and the restarted
    controller rolls every engine back and relabels it at once, before any call reaches it."""
    from rollout_service.refit.client import TrainerClient
    from rollout_service.refit.controller import controller_name, get_controller

    import torch

    base, fleet = heal_app[0], _fleet()  # by name: an earlier test may have replaced the fixture's
    controller = get_controller(controller_name(APP))
    trainer = TrainerClient(controller, timeout_s=60)
    # In-memory weights (no checkpoint a restarted fleet could fall back on), as a GPU refit's are.
    assert trainer.refit("k1", {"w": torch.arange(8, dtype=torch.float32)}, transport="object_store")["ok"]
    sums = set(trainer.weights_checksums())
    assert len(sums) == 1
    before = ray.get(fleet.stats.remote(), timeout=60)["incarnation"]

    view = ray.get(fleet.begin_refit.remote(lease_s=600), timeout=60)
    other = _checkpoint(tiny_model_dir, tmp_path / "k2")
    for e in (m.handle for m in view.members):
        ray.get(e.pause.remote(mode="keep"), timeout=60)
        ray.get(e.collective_rpc.remote("rs_stage_path", args=(other,)), timeout=60)
        ray.get(e.collective_rpc.remote("rs_load_staged"), timeout=60)
        ray.get(e.set_weight_version.remote("k2"), timeout=60)
    fleet_pid, controller_pid = _pid(fleet), _pid(controller)
    os.kill(controller_pid, signal.SIGKILL)
    os.kill(fleet_pid, signal.SIGKILL)
    t0 = time.monotonic()

    # Nothing calls the controller from here on: it recovers by itself.
    stats = _restarted(fleet, before, lambda s: not s["refitting"] and len(s["serving"]) == ENGINES, 60)
    settled = time.monotonic() - t0
    assert stats["weight_version"] == "k1" and stats["version_source"] == "ledger", stats
    assert {(p, v) for _, p, v in _engine_states(fleet).values()} == {(False, "k1")}
    recovered = trainer.stats()["recovered"]
    assert (recovered["version"], recovered["rolled_back"], recovered["relabelled"], recovered["replaced"]) == \
        ("k1", ENGINES, ENGINES, 0), recovered
    assert set(trainer.weights_checksums()) == sums  # k1's weights, not k2's
    print(f"fleet + controller killed between label and commit: every engine serving k1 again after {settled:.1f}s")
    failures: list = []
    assert asyncio.run(_rollouts(base, "kt", 20, failures)) == 20 and failures == []


def test_a_fleet_restarted_in_the_middle_of_a_refit_keeps_its_bracket(heal_app, tiny_model_dir, tmp_path):
    """The fleet dies while a refit's engines are paused for a load that takes longer than
    fleet.resume_unbracketed_pause_s. The new incarnation knows the bracket from its record: it
    does not resume the engines mid-load, and the refit then commits through it."""
    base, fleet = heal_app[0], _fleet()  # by name: an earlier test may have replaced the fixture's
    before = ray.get(fleet.stats.remote(), timeout=60)
    view = ray.get(fleet.begin_refit.remote(lease_s=600), timeout=60)
    engines = [m.handle for m in view.members]
    ray.get([e.pause.remote(mode="keep") for e in engines], timeout=60)
    os.kill(_pid(fleet), signal.SIGKILL)
    stats = _restarted(fleet, before["incarnation"])
    assert stats["refitting"] is True and stats["weight_version"] == before["weight_version"], stats
    policy = _config(tiny_model_dir, "redis://unused").fleet
    time.sleep(policy.resume_unbracketed_pause_s + 2 * policy.probe_interval_s + 1.5)  # a resume would have landed
    assert ray.get([e.is_paused.remote() for e in engines], timeout=60) == [True] * ENGINES

    ckpt = _checkpoint(tiny_model_dir, tmp_path / "b1")
    for e in engines:  # the load goes on, then commits as the controller would
        ray.get(e.collective_rpc.remote("rs_stage_path", args=(ckpt,)), timeout=60)
        ray.get(e.collective_rpc.remote("rs_load_staged"), timeout=60)
        ray.get(e.set_weight_version.remote("b1"), timeout=60)
        ray.get(e.collective_rpc.remote("rs_commit"), timeout=60)
        ray.get(e.resume.remote(), timeout=60)
    ray.get(fleet.end_refit.remote("b1", ckpt), timeout=60)
    stats = ray.get(fleet.stats.remote(), timeout=60)
    assert stats["weight_version"] == "b1" and not stats["refitting"]
    assert stats["last_refit"]["outcome"] == "committed" and stats["last_refit"]["from_version"] == before["weight_version"]
    assert {(p, v) for _, p, v in _engine_states(fleet).values()} == {(False, "b1")}
    assert len(_engine_states(fleet)) == ENGINES


def _try(fn):
    try:
        return fn()
    except Exception:
        return None


def test_the_app_deleted_while_the_fleet_is_down_stops_the_restarted_fleet(heal_app):
    """Runs last in this module (it ends the app). The fleet is stopped (SIGSTOP) while its Serve app
    is deleted, then killed; Ray restarts it. Its new incarnation reads the apps it served from its
    record, finds them gone, and stops its engines, the controller and itself; its record is cleared."""
    from ray import serve

    from rollout_service.fleet.fleet import FLEET_NAMESPACE, fleet_name
    from rollout_service.fleet.ledger import FleetLedger

    base, fleet = heal_app[0], _fleet()  # by name: an earlier test may have replaced the fixture's
    pid = _pid(fleet)
    os.kill(pid, signal.SIGSTOP)
    try:
        serve.delete(APP)
    finally:
        os.kill(pid, signal.SIGKILL)
    t0 = time.monotonic()

    def gone():
        names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                 if a["namespace"] == FLEET_NAMESPACE and a["name"].startswith(f"{APP}-")]
        return not names or None

    _wait(gone, 90, "the restarted fleet kept its engines (or itself) after its app was deleted")
    print(f"app deleted while the fleet was down: fleet, engines and controller gone {time.monotonic() - t0:.1f}s "
          "after the fleet's restart")
    ledger = FleetLedger(fleet_name(APP), 5.0)
    assert asyncio.run(ledger.read()) is None and ledger.last_error is None
