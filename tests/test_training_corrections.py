"""rollout_service.training.corrections: TIS, MIS and IcePop weights by hand, on rows from the
service's own exporter."""

from __future__ import annotations

import math

import pytest

from rollout_service.training import Correction, TrainingRow, correction_shares, correction_weights


def _row(behaviour: list[float], mask: list[int]) -> TrainingRow:
    n = len(mask)
    return TrainingRow(rollout_id="r", segment=0, input_ids=list(range(n)), loss_mask=mask,
                       behaviour_logprobs=behaviour, versions=["v" if m else None for m in mask], constrained=[0] * n)


# rho per trained position: 1, 3 (above cap 2), 0.25 (below icepop's 0.5), 1.5, 6 (above icepop's 5)
RHOS = [1.0, 3.0, 0.25, 1.5, 6.0]


def _rows_and_trainer():
    mask = [0] + [1] * len(RHOS)
    behaviour = [0.0] + [-1.0] * len(RHOS)
    trainer = [0.0] + [-1.0 + math.log(r) for r in RHOS]
    return [_row(behaviour, mask)], [trainer]


@pytest.mark.parametrize("method, weights, affected", [
    ("tis", [1.0, 2.0, 0.25, 1.5, 2.0], 2),
    ("mis", [1.0, 0.0, 0.25, 1.5, 0.0], 2),
    ("icepop", [1.0, 3.0, 0.0, 1.5, 0.0], 2),
])
def test_each_method_by_hand(method, weights, affected):
    rows, trainer = _rows_and_trainer()
    out = correction_weights(rows, trainer, method)
    assert out.weights[0][0] == 0.0  # the prompt position: off the loss mask
    assert out.weights[0][1:] == pytest.approx(weights, rel=1e-12)
    assert (out.affected, out.tokens) == (affected, 5)
    assert out.share == pytest.approx(affected / 5)


def test_bounds_are_settable_and_checked():
    rows, trainer = _rows_and_trainer()
    assert correction_weights(rows, trainer, Correction("tis", cap=4.0)).affected == 1
    assert correction_weights(rows, trainer, Correction("icepop", low=0.1, high=10.0)).affected == 0
    with pytest.raises(ValueError, match="unknown correction"):
        Correction("ppo")
    with pytest.raises(ValueError, match="bad bounds"):
        Correction("icepop", low=2.0, high=1.0)
    with pytest.raises(ValueError, match="trainer logprobs"):
        correction_weights(rows, [trainer[0][:-1]])


def test_exact_logprobs_leave_every_token_alone_and_shares_are_reported_for_all_three():
    rows, _ = _rows_and_trainer()
    exact = [list(rows[0].behaviour_logprobs)]
    for m in ("tis", "mis", "icepop"):
        out = correction_weights(rows, exact, m)
        assert out.affected == 0 and out.weights[0][1:] == [1.0] * 5
    assert correction_shares(rows, exact) == {"tis_clipped": 0.0, "mis_masked": 0.0, "icepop_masked": 0.0}
    _, trainer = _rows_and_trainer()
    assert correction_shares(rows, trainer) == pytest.approx({"tis_clipped": 0.4, "mis_masked": 0.4, "icepop_masked": 0.4})
    assert math.isnan(correction_weights([_row([0.0], [0])], [[0.0]]).share)
