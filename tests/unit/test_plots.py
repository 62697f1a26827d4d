"""What the plots draw, read from the records they are drawn from."""

from __future__ import annotations

import math

from ddiloco.report.plots import outages, train_loss_curves


def _step(m: int, step: int, loss: float, t: float) -> dict[str, object]:
    return {"kind": "step", "method": "decoupled", "learner": m, "step": step, "loss": loss, "t": t}


def test_a_restarted_learners_loss_curve_breaks_and_averages_its_new_life_alone():
    # learner 1 trains steps 1-3 at loss 5, crashes, comes back at step 40 (a peer's copy)
    # at loss 2.5: no line across the outage, and no average dragged from the old life
    records = [_step(1, s, 5.0, float(s)) for s in (1, 2, 3)]
    records += [{"kind": "recovered", "method": "decoupled", "learner": 1, "t": 9.0}]
    records += [_step(1, s, 2.5, 10.0 + s) for s in (40, 41)]
    points = train_loss_curves(records)[("decoupled", 1)]
    values = [v for _, v in points]
    assert values[:3] == [5.0, 5.0, 5.0] and math.isnan(values[3])
    assert values[4:] == [2.5, 2.5]


def test_an_outage_lasts_from_the_crash_until_the_learners_answer_merges_again():
    rows = [
        {"kind": "chaos", "event": "crash", "learner": 1, "t": 10.0},
        {"kind": "round", "weights": {"0": 1.0}, "t": 12.0},  # without it
        {"kind": "recovered", "learner": 1, "t": 15.0},
        {"kind": "round", "weights": {"0": 1.0}, "t": 16.0},  # still without it
        {"kind": "round", "weights": {"0": 1.0, "1": 1.0}, "t": 17.5},  # merged again
        {"kind": "chaos", "event": "crash", "learner": 0, "t": 20.0, "skipped": "why"},
    ]
    assert outages(rows, end=30.0) == [(1, 10.0, 17.5)]
