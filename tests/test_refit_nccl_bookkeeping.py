"""The NCCL round keeps the same record of what each engine holds as the other transports, so a
replacement engine and a rollback after an NCCL refit load those weights — not the model's own
checkpoint under the new version's label.

vLLM's NCCL weight transfer runs only on GPUs. Here our worker extension's real methods
(``rs_nccl_start`` / ``rs_nccl_update`` / ``rs_nccl_finish`` / ``rs_nccl_abort``, ``rs_commit``,
``rs_export_current``) run on a CPU stand-in of vLLM's worker: a torch model with ``load_weights``,
vLLM's worker's round-session rules (start / update / finish, the target reset), and a transfer
engine that, as vLLM's NCCL engine does, hands what it receives to the target model's
``load_weights`` — different weights every round."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from rollout_service.weights.worker_extension import RolloutWorkerExtension

NAMES = ("embed.weight", "layer.0.weight", "layer.1.weight", "head.weight")


def _weights(seed: int, names=NAMES) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(4, 3, generator=g) for n in names}


class _Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.params = torch.nn.ParameterDict({n.replace(".", "_"): torch.nn.Parameter(torch.zeros(4, 3))
                                              for n in NAMES})

    def load_weights(self, weights) -> set[str]:
        loaded = set()
        with torch.no_grad():
            for name, tensor in weights:
                self.params[name.replace(".", "_")].copy_(tensor)
                loaded.add(name)
        return loaded

    def state(self) -> dict[str, torch.Tensor]:
        return {n: self.params[n.replace(".", "_")].detach().clone() for n in NAMES}


class _TransferEngine:
    """vLLM's WeightTransferEngine contract as the NCCL engine uses it: the target model can be
    swapped (set / reset), and what a round receives goes to the target's ``load_weights``."""

    def __init__(self, model):
        self.model = self._default = model
        self.model_config = "config"
        self.inbox: list[tuple[str, torch.Tensor]] = []  # what the trainer broadcasts next
        self.fail_after: int | None = None

    def set_weight_update_target(self, model, model_config):
        self.model, self.model_config = model, model_config

    def reset_weight_update_target(self):
        self.model = self._default

    def start_weight_update(self):
        pass

    def finish_weight_update(self):
        pass

    def update_weights(self, update_info):
        buffer = torch.empty(4, 3)  # reused for every tensor, as the packed receive buffers are

        def received():
            for i, (name, tensor) in enumerate(self.inbox):
                if self.fail_after is not None and i >= self.fail_after:
                    raise RuntimeError("broadcast failed mid-round")
                buffer.copy_(tensor)
                yield name, buffer

        self.model.load_weights(received())


class _Runner:
    def __init__(self, model, path):
        self.model = model
        self.vllm_config = type("C", (), {"model_config": type("M", (), {"model": path})()})()

    def get_model(self):
        return self.model


class StandInWorker(RolloutWorkerExtension):
    """vLLM's worker's weight-update session rules (vllm/v1/worker/gpu_worker.py) on CPU."""

    def __init__(self, model_path: str):
        self.rank = 0
        self.model = _Model()
        self.model_runner = _Runner(self.model, model_path)
        self.weight_transfer_engine = _TransferEngine(self.model)
        self._weight_update_active = False
        self.reload_weights(weights_path=model_path)

    def reload_weights(self, weights_path=None, weights_iterator=None):
        items = load_file(f"{weights_path}/model.safetensors").items() if weights_path else weights_iterator
        self.model.load_weights(items)

    def start_weight_update(self):
        if self._weight_update_active:
            raise RuntimeError("start_weight_update called while a weight update is already active")
        self.weight_transfer_engine.start_weight_update()
        self._weight_update_active = True

    def update_weights(self, update_info):
        if not self._weight_update_active:
            raise RuntimeError("start_weight_update must be called before update_weights.")
        try:
            self.weight_transfer_engine.update_weights(update_info)
        except BaseException:
            self._weight_update_active = False
            self.weight_transfer_engine.reset_weight_update_target()
            raise

    def finish_weight_update(self):
        if not self._weight_update_active:
            raise RuntimeError("finish_weight_update called without a matching start_weight_update.")
        self.weight_transfer_engine.finish_weight_update()
        self.weight_transfer_engine.reset_weight_update_target()
        self._weight_update_active = False


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture
def worker(tmp_path):
    (tmp_path / "base").mkdir()
    save_file(_weights(0), str(tmp_path / "base" / "model.safetensors"))
    return StandInWorker(str(tmp_path / "base"))


def _round(worker, weights: dict, *, fail_after=None, finish=True):
    worker.weight_transfer_engine.inbox = list(weights.items())
    worker.weight_transfer_engine.fail_after = fail_after
    worker.rs_nccl_start()
    worker.rs_nccl_update({"names": list(weights)})
    if finish:
        worker.rs_nccl_finish()


def _exported(worker, tmp_path) -> dict:
    out = worker.rs_export_current(str(tmp_path / "export.safetensors"))
    return load_file(out["file"]) if "file" in out else load_file(f"{out['path']}/model.safetensors")


def test_a_replacement_after_an_nccl_round_gets_the_weights_it_loaded(worker, tmp_path):
    w1 = _weights(1)
    _round(worker, w1)
    worker.rs_commit()
    assert _same(worker.model.state(), w1)
    assert _same(_exported(worker, tmp_path), w1)  # not the model's own checkpoint (seed 0)


def test_a_failed_round_after_an_nccl_round_rolls_back_to_that_round(worker):
    w1, w2 = _weights(1), _weights(2)
    _round(worker, w1)
    worker.rs_commit()
    with pytest.raises(RuntimeError, match="mid-round"):
        _round(worker, w2, fail_after=2)
    assert not _same(worker.model.state(), w1)  # half of w2 is in the model now
    worker.rs_nccl_abort()
    assert _same(worker.model.state(), w1)
    # And the next round runs: nothing of the failed one is left open.
    w3 = _weights(3)
    _round(worker, w3)
    worker.rs_commit()
    assert _same(worker.model.state(), w3)


def test_a_round_finished_but_never_labelled_is_undone_to_the_committed_weights(worker, tmp_path):
    w1, w2 = _weights(1), _weights(2)
    _round(worker, w1)
    worker.rs_commit()
    _round(worker, w2)  # finished; the label then failed: the controller aborts the round
    with pytest.raises(RuntimeError, match="not committed"):
        worker.rs_export_current(str(tmp_path / "x.safetensors"))
    worker.rs_nccl_abort()
    assert _same(worker.model.state(), w1) and _same(_exported(worker, tmp_path), w1)


def test_an_abandoned_round_is_closed_and_reloaded(worker):
    """The trainer died between update and finish (its lease ran out): vLLM's session is closed, so
    the next round can start, and the engine is back on its committed weights."""
    w1 = _weights(1)
    _round(worker, w1)
    worker.rs_commit()
    _round(worker, _weights(2), finish=False)
    worker.rs_nccl_abort()
    assert _same(worker.model.state(), w1) and not worker._weight_update_active
    _round(worker, _weights(4))
    worker.rs_commit()
    assert _same(worker.model.state(), _weights(4))


def test_a_round_that_sends_some_of_the_weights_keeps_the_others(worker, tmp_path):
    w1 = _weights(1)
    _round(worker, w1)
    worker.rs_commit()
    part = _weights(5, names=NAMES[1:3])
    _round(worker, part)
    worker.rs_commit()
    want = {**w1, **part}
    assert _same(worker.model.state(), want) and _same(_exported(worker, tmp_path), want)
    # Over the model's own checkpoint too (the first round after start-up, partial).
    fresh = StandInWorker(worker.model_runner.vllm_config.model_config.model)
    _round(fresh, part)
    fresh.rs_commit()
    assert _same(_exported(fresh, tmp_path), {**_weights(0), **part})
