"""The parity canary: finished generations re-scored by teacher forcing and compared with the logprobs
they were sampled with (rollout_service/canary, docs/canary.md).

- The recompute replays vLLM's own processing (its top-k / top-p function on the same logits) from
  raw scores, for every sampling it claims to handle; what it cannot handle is skipped by name.
- On two real engines (the fleet rig) at the parity config: every drawn generation is counted
  (checked or skipped with its reason) and |Δ| stays at or below 1e-5; an engine left on other
  weights behind the controller's back is caught.
- On a real engine in raw logprobs mode with prefix caching: raw logprobs at a temperature below 1
  are caught, and so is a prefix-cache hit across a weight change whose salt did not change.
- The serve-level test (a real Serve app, status and the metrics scrape) is in test_serve_canary.py.
"""

from __future__ import annotations

import asyncio
import math
import time

import pytest
import torch

from rollout_service.canary.recompute import SKIP_REASONS, plan, processed
from rollout_service.canary.stats import MAX_ENTRIES, CanaryStats, status_of
from rollout_service.engine.sampling import SamplingOptions
from rollout_service.training.parity import DIFF_CAP, ParityStats, rows_parity
from rollout_service.training.rows import TrainingRow, TurnBounds

PARITY = 1e-5  # the parity config's bound (fp32 tiny model on CPU: ~1e-6)


# ----------------------------------------------------------------------------- the recompute, unit
RECOMPUTABLE = [
    dict(temperature=1.0),
    dict(temperature=0.0),
    dict(temperature=0.7, top_k=20),
    dict(temperature=1.3, top_k=8, top_p=0.8),
    dict(temperature=0.5, top_k=3, top_p=0.5),
    dict(temperature=1.0, top_p=0.9),
    # over the whole vocabulary (the engine's worker: weights/worker_scoring.py)
    dict(temperature=0.7),
    dict(temperature=1.3),
    dict(temperature=0.7, top_p=0.9),
    dict(temperature=1.3, top_p=0.95),
    dict(temperature=0.8, min_p=0.05),
    dict(temperature=0.7, top_k=50),  # a top-k above the engine's max_logprobs
    dict(temperature=0.9, top_k=10, min_p=0.02),
]


@pytest.mark.parametrize("case", RECOMPUTABLE, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_the_recompute_replays_vllms_own_processing(case):
    """Each case against vLLM's sampler as it runs on this platform (temperature, min-p, then the
    top-k / top-p function its sampler calls): from the raw top logprobs where a top-k bounds the kept
    set, from the whole vocabulary (the worker's function) otherwise."""
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p  # what this platform's sampler calls

    from rollout_service.canary.recompute import WHOLE_TOLERANCE, WHOLE_VOCABULARY
    from rollout_service.weights.worker_scoring import processed_rows

    s = SamplingOptions.validated(**case)
    g = torch.Generator().manual_seed(7)
    positions, vocab = 96, 3000
    logits = torch.randn(positions, vocab, generator=g)
    for i in range(positions):  # a few dominant tokens per row: a 0.9 nucleus lies within the top 20
        logits[i, torch.randperm(vocab, generator=g)[:8]] += 10.0
    greedy = s.temperature < 1e-5
    if greedy:
        reference = torch.log_softmax(logits, -1)
    else:
        scaled = logits / s.temperature
        if s.min_p > 0:  # vLLM's MinPLogitsProcessor, after the temperature
            probs = scaled.softmax(-1)
            scaled = scaled.masked_fill(probs < probs.amax(-1, keepdim=True) * s.min_p, -math.inf)
        k = torch.full((positions,), s.top_k, dtype=torch.long) if s.top_k > 0 else None
        p = torch.full((positions,), s.top_p) if s.top_p < 1.0 else None
        reference = torch.log_softmax(apply_top_k_top_p(scaled.clone(), k, p), -1)  # vLLM's processed logprobs
    raw = torch.log_softmax(logits, -1)
    num_top = plan(s, 20)
    assert isinstance(num_top, int)
    # the sampled token of each position (from the processed distribution), plus one it would have dropped
    targets = torch.multinomial(reference.exp(), 1, generator=g).squeeze(-1) if not greedy else reference.argmax(-1)
    dropped = reference.argmin(-1)
    whole = num_top == WHOLE_VOCABULARY
    assert whole == (case.get("top_k", 0) in (0, 50) and case not in ({"temperature": 1.0}, {"temperature": 0.0})
                     or "min_p" in case)
    keeps_all = greedy or s.top_k <= 0 and s.top_p >= 1.0 and s.min_p == 0  # nothing is dropped
    for tokens, in_support in ((targets, True), (dropped, keeps_all)):
        if whole:
            ours = processed_rows(logits, tokens, s.temperature, max(s.top_k, 0), s.top_p, s.min_p, WHOLE_TOLERANCE)
        else:
            lps = raw.gather(-1, tokens[:, None]).squeeze(-1)
            tops = raw.topk(num_top, -1).values.tolist() if num_top else None
            ours = processed(s, lps.tolist(), tops)
        assert isinstance(ours, list)
        want = reference.gather(-1, tokens[:, None]).squeeze(-1).tolist()
        pairs = [(a, b) for a, b in zip(ours, want) if a is not None]  # None: a top-p decision too close to call
        # (over the whole vocabulary the tail's tokens each carry ~1e-5 here: one of them lies within the
        # tolerance of p at about one position in ten)
        assert len(pairs) >= (positions * 3 // 4 if whole and s.top_p < 1.0 else positions - 2)
        if in_support:
            diff = max(abs(a - b) for a, b in pairs)
            print(f"{case}: max |ours - vLLM| {diff:.2e} over {len(pairs)} positions")
            assert diff <= 2e-6
        else:  # a token the processing drops has probability 0 on both sides
            assert all(a == -math.inf and b == -math.inf for a, b in pairs)


def test_a_tie_at_the_top_k_cut_is_left_out_not_called_dropped():
    s = SamplingOptions.validated(temperature=0.8, top_k=2)
    assert plan(s, 20) == 3  # k + 1: the value after the cut shows a tie
    tops = [[-0.5, -1.0, -1.0], [-0.5, -1.0, -2.0]]
    out = processed(s, [-1.0, -2.0], tops)
    assert out[0] is None and out[1] == -math.inf  # tied at the cut: unknown; clearly below it: dropped
    assert plan(SamplingOptions.validated(temperature=0.8, top_k=20), 20) == 20  # no room for k + 1
    stats = ParityStats()
    stats.add([-1.0, -2.0, -0.3], [None, -math.inf, -0.3])
    assert (stats.tokens, stats.ambiguous, stats.dropped, stats.max_abs) == (2, 1, 1, DIFF_CAP)
    assert stats.token_mult_prob_error == pytest.approx((math.exp(DIFF_CAP) + 1) / 2)


def test_what_cannot_be_recomputed_is_named():
    from rollout_service.canary.recompute import WHOLE_VOCABULARY

    cases = {
        "structured_output": dict(structured_outputs={"regex": "a+"}),
        "penalties": dict(presence_penalty=0.5),
        "tiny_temperature": dict(temperature=1e-6),
    }
    for reason, sampling in cases.items():
        assert reason in SKIP_REASONS
        assert plan(SamplingOptions.validated(**sampling), 20) == reason, reason
    assert plan(SamplingOptions.validated(), 20, "raw_logits") == "logits_mode"
    assert plan(SamplingOptions.validated(), 20, "raw_logprobs") == 0  # compared: raw is what the canary catches
    # greedy: vLLM turns top-k / top-p / min-p off, so the processed logprob is the raw one
    assert plan(SamplingOptions.validated(temperature=0.0, top_k=5, top_p=0.5, min_p=0.1), 20) == 0
    # what needs every logit is checked over the whole vocabulary, whatever the engine's max_logprobs
    for sampling in (dict(temperature=0.7), dict(top_p=0.9), dict(min_p=0.1), dict(temperature=0.7, top_k=50)):
        assert plan(SamplingOptions.validated(**sampling), 0) == WHOLE_VOCABULARY, sampling
        assert plan(SamplingOptions.validated(**sampling), 20) == WHOLE_VOCABULARY, sampling
    # engines that cannot (Model Runner V2): what the top logprobs give, the rest named
    cannot = {"min_p": dict(min_p=0.1), "temperature_without_top_k": dict(temperature=0.7),
              "top_k_above_limit": dict(temperature=0.7, top_k=50)}
    for reason, sampling in cannot.items():
        assert reason in SKIP_REASONS
        assert plan(SamplingOptions.validated(**sampling), 20, whole_vocabulary=False) == reason, reason
    assert plan(SamplingOptions.validated(temperature=0.7, top_k=5), 20, whole_vocabulary=False) == 6
    assert plan(SamplingOptions.validated(top_p=0.9), 20, whole_vocabulary=False) == 20
    assert plan(SamplingOptions.validated(top_p=0.9), 0, whole_vocabulary=False) == "nucleus_beyond_top_k"
    flat = [math.log(1 / 1000)] * 20  # T = 1 with top-p: a nucleus beyond the top logprobs cannot be known
    assert processed(SamplingOptions.validated(top_p=0.9), [flat[0]], [flat]) == "nucleus_beyond_top_k"
    assert "whole_vocabulary_unavailable" in SKIP_REASONS


def test_a_cut_too_close_to_call_over_the_whole_vocabulary_is_left_out():
    """A top-k cut between equal logits, a token on the min-p threshold: None, not a value or -inf
    (vLLM decides them over the decode step's logits, which may fall on the other side)."""
    from rollout_service.canary.recompute import WHOLE_TOLERANCE
    from rollout_service.weights.worker_scoring import processed_rows

    logits = torch.tensor([[5.0, 3.0, 3.0, 0.0], [5.0, 3.0, 2.0, 0.0]])
    targets = torch.tensor([0, 0])
    assert processed_rows(logits, targets, 1.0, 2, 1.0, 0.0, WHOLE_TOLERANCE)[0] is None  # tie at the cut
    assert processed_rows(logits, targets, 1.0, 2, 1.0, 0.0, WHOLE_TOLERANCE)[1] is not None
    on_threshold = torch.tensor([[0.0, math.log(0.5), -9.0, -9.0]])  # p(1) / p(0) = 0.5 = min_p exactly
    assert processed_rows(on_threshold, targets[:1], 1.0, 0, 1.0, 0.5, WHOLE_TOLERANCE) == [None]
    clear = processed_rows(on_threshold, targets[:1], 1.0, 0, 1.0, 0.3, WHOLE_TOLERANCE)[0]
    assert clear == pytest.approx(-math.log(1.5), abs=1e-6)  # min-p 0.3 keeps tokens 0 and 1
    assert processed_rows(logits, targets, 1.0, 4, 1.0, 0.0, WHOLE_TOLERANCE) == processed_rows(
        logits, targets, 1.0, 0, 1.0, 0.0, WHOLE_TOLERANCE)  # a top-k of the whole vocabulary is off


def test_figures_merge_exactly_across_replicas():
    a, b = CanaryStats(threshold=1e-3), CanaryStats(threshold=1e-3)
    a.add(0, "v1", 1, [-1.0, -2.0], [-1.0, -2.0 + 2e-3])
    a.skip("version_moved")
    b.add(0, "v1", 1, [-0.5], [-0.5 - 1e-6])
    b.add(1, "v1", 0, [-3.0], [-math.inf])  # a token the recompute drops
    b.skip("version_moved")
    b.skip("queue_full")
    st = status_of([a.report(), b.report()], enabled=True, sample_fraction=1.0, threshold=1e-3)
    assert st["checked"] == 3 and st["tokens"] == 4
    assert st["skipped"] == {"queue_full": 1, "version_moved": 2}
    assert st["max_abs_diff"] == DIFF_CAP and st["share_above_threshold"] == 0.5
    e0, e1 = st["by_engine"]
    assert (e0["slot"], e0["weight_version"], e0["checked"], e0["tokens"], e0["scored_on"]) == (0, "v1", 2, 3, {"1": 2})
    assert e0["max_abs_diff"] == pytest.approx(2e-3) and e0["mean_abs_diff"] == pytest.approx((2e-3 + 1e-6) / 3)
    assert e0["token_mult_prob_error"] == pytest.approx((1 + math.exp(2e-3) + math.exp(1e-6)) / 3)
    assert (e1["slot"], e1["checked"], e1["max_abs_diff"]) == (1, 1, DIFF_CAP)
    many = CanaryStats()
    for i in range(MAX_ENTRIES + 5):
        many.add(0, f"v{i}", 0, [-1.0], [-1.0])
    kept = status_of([many.report()], enabled=True, sample_fraction=1.0)["by_engine"]
    older = [e for e in kept if e["weight_version"] == "older"]
    assert len(kept) == MAX_ENTRIES and len(older) == 1 and older[0]["checked"] == 6
    assert kept[-1]["weight_version"] == f"v{MAX_ENTRIES + 4}"  # a slot's entries: last checked last
    assert sum(e["checked"] for e in kept) == MAX_ENTRIES + 5


def test_mixed_tokens_are_counted_apart_and_merge_across_replicas():
    a, b = CanaryStats(threshold=1e-3), CanaryStats(threshold=1e-3)
    a.add(0, "v2", 1, [-1.0], [-1.0])
    a.add_mixed([-1.0, -2.0], [-1.5, -2.0])
    b.add_mixed([-0.5], [-0.5 - 1e-2])
    st = status_of([a.report(), b.report()], enabled=True, sample_fraction=1.0, threshold=1e-3)
    assert (st["checked"], st["tokens"], st["max_abs_diff"]) == (1, 1, 0.0)  # the mixed tokens in no other figure
    assert st["mixed"]["checked"] == 2 and st["mixed"]["tokens"] == 3
    assert st["mixed"]["max_abs_diff"] == pytest.approx(0.5) and st["mixed"]["share_above_threshold"] == pytest.approx(2 / 3)
    assert status_of([], enabled=True, sample_fraction=1.0)["mixed"]["tokens"] == 0


def test_the_trainer_side_twin_counts_the_same_way():
    row = TrainingRow(rollout_id="r", segment=0, input_ids=list(range(8)), loss_mask=[0, 0, 1, 1, 0, 1, 1, 1],
                      behaviour_logprobs=[0, 0, -1.0, -2.0, 0, -0.5, -0.25, -3.0],
                      versions=[None, None, "v1", "v1", None, "v1", "v2", "v2"], constrained=[0] * 8,
                      turns=[TurnBounds(0, 0, 2, 4, "stop"), TurnBounds(1, 4, 5, 8, "stop")])
    trainer = [0, 0, -1.0, -2.0 + 1e-3, 0, -0.5, -0.25 - 1e-2, -3.0]
    out = rows_parity([row], [trainer], threshold=5e-3)
    assert sorted(out) == ["v1", "v2"]
    assert (out["v1"].turns, out["v1"].tokens, out["v1"].max_abs) == (2, 3, pytest.approx(1e-3))
    assert (out["v2"].turns, out["v2"].tokens, out["v2"].above) == (1, 2, 1)
    assert out["v2"].summary()["share_above_threshold"] == 0.5
    # the canary counts the same pairs the same way
    c = CanaryStats(threshold=5e-3)
    c.add(0, "v2", 0, [-0.25, -3.0], [-0.25 - 1e-2, -3.0])
    assert c.entries[(0, "v2")]["stats"].summary() == out["v2"].summary()


# ----------------------------------------------------------------------------- real engines
def canary_runner(cfg, client, store, tokenizer, **canary):
    from rollout_service.canary.canary import Canary
    from rollout_service.config import CanaryConfig
    from rollout_service.serve.turns import TurnRunner

    c = Canary(CanaryConfig(**({"sample_fraction": 1.0} | canary)), client, "test", max_top=cfg.engine.max_logprobs)
    return TurnRunner(cfg, client, store, tokenizer, canary=c), c


async def complete(runner, prompt_ids, sampling: dict, max_tokens: int = 12, stream: bool = False):
    from rollout_service.serve.turn_types import CompletionCall, TurnResult

    result = None
    async for event in runner.run_completion(CompletionCall(prompt=list(prompt_ids), sampling=sampling,
                                                            max_tokens=max_tokens, stream=stream)):
        if isinstance(event, TurnResult):
            result = event
    return result


async def drained(canary, expected: int, timeout: float = 120.0) -> dict:
    """The canary's status once ``expected`` generations were counted (checked or skipped) and it is idle."""
    deadline = time.monotonic() + timeout
    while True:
        st = status_of([canary.figures()], enabled=True, sample_fraction=1.0, threshold=canary.config.threshold)
        if st["checked"] + sum(st["skipped"].values()) >= expected and canary.idle():
            return st
        assert time.monotonic() < deadline, f"the canary did not finish: {st}"
        await asyncio.sleep(0.1)


async def both_idle(client, canary, timeout: float = 60.0) -> None:
    """Until the canary re-scores nothing and the fleet's last probes saw no request on either engine:
    the routing's loads then are this client's own calls only (a re-scoring on one engine, or a probe
    that saw one, would send both calls of a pair to the other)."""
    deadline = time.monotonic() + timeout
    while True:
        view = await client.refresh()
        if canary.idle() and len(view.members) == 2 and all(m.load == 0 for m in view.members):
            return
        assert time.monotonic() < deadline, f"the engines did not go idle: {[(m.slot, m.load) for m in view.members]}"
        await asyncio.sleep(0.1)


def prompt_of(tokenizer, i: int) -> list[int]:
    return tokenizer(f"Question {i}: list the colours of the rainbow and say why the sky is blue.")["input_ids"]


# What a real engine samples with, on its own logits: a top-k from the top logprobs; without one (T = 0.7,
# 1.0, 1.3, with and without top-p, min-p, a top-k above max_logprobs) over the whole vocabulary.
ENGINE_CASES = [
    dict(temperature=1.0), dict(temperature=0.0), dict(temperature=0.7, top_k=20),
    dict(temperature=1.3, top_k=8, top_p=0.8), dict(temperature=0.7), dict(temperature=1.3),
    dict(temperature=1.0, top_p=0.9), dict(temperature=0.7, top_p=0.9), dict(temperature=1.3, top_p=0.9),
    dict(temperature=0.8, min_p=0.05), dict(temperature=0.7, top_k=50),
]


async def test_every_drawn_generation_is_counted_and_the_parity_config_stays_below_1e5(fleet_rig, tiny_tokenizer):
    rig = fleet_rig
    runner, canary = canary_runner(rig.config, rig.runner.fleet, rig.store, tiny_tokenizer)
    try:
        checked_cases = ENGINE_CASES
        skipped_cases = {"penalties": dict(frequency_penalty=0.3)}
        n = 0
        for i, case in enumerate(checked_cases * 2):
            await complete(runner, prompt_of(tiny_tokenizer, i), case | {"seed": i}, stream=i % 2 == 0)
            n += 1
        for i, case in enumerate(skipped_cases.values()):
            await complete(runner, prompt_of(tiny_tokenizer, 100 + i), case | {"seed": i})
            n += 1
        st = await drained(canary, n)
    finally:
        canary.close()
    print(f"{st['checked']} checked, skipped {st['skipped']}, max |Δ| {st['max_abs_diff']:.2e}, mean "
          f"{st['mean_abs_diff']:.2e}, token_mult_prob_error {st['token_mult_prob_error']:.8f}; by engine "
          f"{[(e['slot'], e['checked'], e['scored_on']) for e in st['by_engine']]}")
    assert st["checked"] == 2 * len(checked_cases)
    assert st["skipped"] == dict.fromkeys(skipped_cases, 1)
    assert st["max_abs_diff"] <= PARITY
    for e in st["by_engine"]:  # each re-scored on the other engine
        assert list(e["scored_on"]) == [str(1 - e["slot"])]
    assert sum(e["checked"] for e in st["by_engine"]) == st["checked"]


async def test_an_engine_left_on_other_weights_is_caught(fleet_rig, tiny_tokenizer, tiny_model_dir):
    from safetensors.torch import load_file

    from refit_helpers import perturbed

    rig = fleet_rig
    base = load_file(str(tiny_model_dir / "model.safetensors"))
    report = await asyncio.to_thread(rig.trainer.refit, "canary-w1", perturbed(base, seed=31), transport="object_store")
    assert report["ok"] and sorted(report["engines"]) == [0, 1]
    runner, canary = canary_runner(rig.config, rig.runner.fleet, rig.store, tiny_tokenizer)
    try:
        # Behind the controller's back: engine 1 goes back to the model's own weights, keeping its label.
        stale = next(m for m in rig.runner.fleet.members() if m.slot == 1)
        await stale.handle.collective_rpc.remote("rs_reload_from_path", (str(tiny_model_dir),))
        for i in range(0, 8, 2):  # two at a time: least-loaded routing puts one on each engine
            await both_idle(rig.runner.fleet, canary)
            await asyncio.gather(*(complete(runner, prompt_of(tiny_tokenizer, 200 + j), {"seed": j}) for j in (i, i + 1)))
        st = await drained(canary, 8)
    finally:
        canary.close()
        restored = await asyncio.to_thread(rig.trainer.refit, "canary-base", base, transport="object_store")
        assert restored["ok"]
    print("engine 1 on other weights:", [(e["slot"], e["weight_version"], e["checked"], f"{e['max_abs_diff']:.3f}",
                                          f"{e['mean_abs_diff']:.3f}") for e in st["by_engine"]])
    assert st["checked"] == 8 and not st["skipped"]
    assert {e["slot"] for e in st["by_engine"]} == {0, 1}  # least loaded routing spread them
    for e in st["by_engine"]:  # every generation was compared with the other engine's weights
        assert e["weight_version"] == "canary-w1" and e["mean_abs_diff"] > 1e-2 and e["share_above_threshold"] > 0.5


async def test_a_generation_a_refit_lands_in_is_checked_on_its_last_versions_tokens(fleet_rig, tiny_tokenizer,
                                                                                      tiny_model_dir):
    """A refit inside a generation: with the KV kept, the tokens after it are mixed (new weights over
    the old KV) and counted apart, expected off; with it cleared, they are pure and within parity."""
    from safetensors.torch import load_file

    from refit_helpers import perturbed
    from rollout_service.serve.turn_types import CompletionCall, TokenDelta, TurnResult

    rig = fleet_rig
    base = load_file(str(tiny_model_dir / "model.safetensors"))
    runner, canary = canary_runner(rig.config, rig.runner.fleet, rig.store, tiny_tokenizer)

    async def across_a_refit(i: int, label: str, weights, clear_cache: bool) -> TurnResult:
        started = asyncio.Event()

        async def generate():
            async for event in runner.run_completion(CompletionCall(
                    prompt=prompt_of(tiny_tokenizer, 300 + i), sampling={"seed": i, "ignore_eos": True},
                    max_tokens=400, stream=True)):
                if isinstance(event, TokenDelta):
                    started.set()
                elif isinstance(event, TurnResult):
                    return event

        task = asyncio.create_task(generate())
        await asyncio.wait_for(started.wait(), 60)
        report = await asyncio.to_thread(rig.trainer.refit, label, weights, transport="object_store",
                                         clear_cache=clear_cache)
        assert report["ok"], report
        return await task

    try:
        kept = await across_a_refit(0, "canary-kv-kept", perturbed(base, seed=41), clear_cache=False)
        st = await drained_mixed(canary, 1)
        assert len({s["version"] for s in kept.weight_versions}) == 2, kept.weight_versions  # it spanned the refit
        assert kept.weight_versions[-1]["kv_version"] != kept.weight_versions[-1]["version"], kept.weight_versions
        assert st["checked"] == 0 and st["mixed"]["checked"] == 1 and st["mixed"]["max_abs_diff"] > 1e-3, st
        cleared = await across_a_refit(1, "canary-kv-cleared", base, clear_cache=True)
        assert len({s["version"] for s in cleared.weight_versions}) == 2, cleared.weight_versions  # it spanned the refit
        assert all(s["kv_version"] == s["version"] for s in cleared.weight_versions), cleared.weight_versions
        st = await drained(canary, 1)
    finally:
        canary.close()
        if rig.runner.fleet.view.version != "canary-kv-cleared":
            assert (await asyncio.to_thread(rig.trainer.refit, "canary-kv-base", base, transport="object_store"))["ok"]
    print(f"across a refit: mixed max |Δ| {st['mixed']['max_abs_diff']:.3f} over {st['mixed']['tokens']} tokens; "
          f"after a cache-clearing refit {st['tokens']} pure tokens, max |Δ| {st['max_abs_diff']:.2e}")
    assert st["checked"] == 1 and st["tokens"] > 0 and st["max_abs_diff"] <= PARITY and not st["skipped"]
    assert st["mixed"]["checked"] == 1  # unchanged by the second generation


async def drained_mixed(canary, expected: int, timeout: float = 120.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        st = status_of([canary.figures()], enabled=True, sample_fraction=1.0, threshold=canary.config.threshold)
        if st["mixed"]["checked"] + st["checked"] + sum(st["skipped"].values()) >= expected and canary.idle():
            return st
        assert time.monotonic() < deadline, f"the canary did not finish: {st}"
        await asyncio.sleep(0.1)


async def test_raw_logprobs_and_a_stale_prefix_cache_are_caught(raw_prefix_controller, redis_server, tiny_tokenizer,
                                                                tiny_model_dir):
    from safetensors.torch import load_file

    from refit_helpers import perturbed
    from rollout_service.config import RolloutServiceConfig
    from rollout_service.fleet.client import connect
    from rollout_service.store.redis_store import RedisRolloutStore

    cfg = RolloutServiceConfig.model_validate({"engine": {"model": str(tiny_model_dir)},
                                               "store": {"redis_url": redis_server, "key_prefix": "canary"}})
    client = await connect(raw_prefix_controller.fleet_handle)
    store = RedisRolloutStore.from_config(cfg.store)
    runner, canary = canary_runner(cfg, client, store, tiny_tokenizer)
    try:
        # 1. logprobs_mode raw at a temperature below 1 (the engine returns log-softmax(logits), not of logits / T):
        # the most common RL setting, T = 0.7 without top-k, is flagged from the first drawn generation
        await complete(runner, prompt_of(tiny_tokenizer, 300), {"temperature": 0.7, "seed": 0})
        first = await drained(canary, 1)
        for i, sampling in enumerate(({"temperature": 0.7, "top_k": 20}, {"temperature": 1.3, "top_p": 0.9},
                                      {"temperature": 0.7}), start=1):
            await complete(runner, prompt_of(tiny_tokenizer, 300 + i), sampling | {"seed": i})
        raw = await drained(canary, 4)
        # at T = 1 raw and processed are the same: the canary stays quiet
        for i in range(4):
            await complete(runner, prompt_of(tiny_tokenizer, 310 + i), {"seed": i})
        quiet = await drained(canary, 8)

        # 2. a prefix-cache hit across a weight change whose salt did not change: the weights are
        # swapped behind the controller's back, so the engine's label (and its cache salt) stay.
        long_prompt = tiny_tokenizer(" ".join(f"fact {i} is that {i * 7} is odd or even." for i in range(40)))["input_ids"]
        warm = await complete(runner, long_prompt, {"seed": 1})
        assert warm is not None
        warmed = await drained(canary, 9)
        engine = client.members()[0].handle
        w1 = perturbed(load_file(str(tiny_model_dir / "model.safetensors")), seed=41)
        import ray

        await engine.stage_weights_from_object_store.remote([ray.put(w1)], 60)
        await engine.collective_rpc.remote("rs_load_staged")
        await engine.collective_rpc.remote("rs_commit")
        await complete(runner, long_prompt, {"seed": 2})
        stale = await drained(canary, 10)
    finally:
        canary.close()
        client.stop_watching()
        client.close_channels()
        await store.close()
    def figures(st):
        return {k: st[k] for k in ("checked", "max_abs_diff", "mean_abs_diff", "token_mult_prob_error")}

    print("raw at T=0.7:", figures(raw), "| +4 at T=1:", figures(quiet), "| +stale prefix:", figures(stale))
    assert first["checked"] == 1 and not first["skipped"] and first["max_abs_diff"] >= 1e-3
    assert raw["checked"] == 4 and not raw["skipped"] and raw["mean_abs_diff"] > 0.1
    assert raw["share_above_threshold"] > 0.9
    added = quiet["tokens"] - raw["tokens"]
    assert quiet["checked"] == 8 and added > 0
    # the four T = 1 generations add nothing above parity: the sum of |Δ| grows by at most 1e-5 per token
    assert quiet["mean_abs_diff"] * quiet["tokens"] - raw["mean_abs_diff"] * raw["tokens"] <= PARITY * added
    def added_sum(a, b):  # the sum of |Δ| the generations between two readings added
        return b["mean_abs_diff"] * b["tokens"] - a["mean_abs_diff"] * a["tokens"]

    assert warmed["checked"] == 9 and added_sum(quiet, warmed) <= PARITY * (warmed["tokens"] - quiet["tokens"])
    last = added_sum(warmed, stale) / (stale["tokens"] - warmed["tokens"])
    print(f"the generation on the stale prefix: mean |Δ| {last:.3f}")
    assert stale["checked"] == 10 and last > 1e-2
