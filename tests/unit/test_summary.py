"""The summary's equal-time loss: a method's eval loss when the first method finished."""

from __future__ import annotations

import pytest

from ddiloco.report.summary import add_equal_time, loss_at

CURVE = [(0.0, 5.0), (10.0, 4.0), (30.0, 2.0)]


def test_loss_at_is_linear_between_evaluations_and_holds_after_the_last():
    assert loss_at(CURVE, 0.0) == 5.0
    assert loss_at(CURVE, 5.0) == pytest.approx(4.5)
    assert loss_at(CURVE, 20.0) == pytest.approx(3.0)
    assert loss_at(CURVE, 30.0) == 2.0 and loss_at(CURVE, 99.0) == 2.0  # done by then
    assert loss_at(CURVE, -1.0) is None and loss_at([], 3.0) is None


def test_every_method_is_read_at_the_first_methods_finish():
    summaries = [
        {"method": "decoupled", "virtual_seconds": 20.0, "eval_loss": 3.1},
        {"method": "data_parallel", "virtual_seconds": 30.0, "eval_loss": 2.0},
    ]
    add_equal_time(summaries, {"decoupled": [(0.0, 5.0), (20.0, 3.1)], "data_parallel": CURVE})
    assert [s["equal_time_seconds"] for s in summaries] == [20.0, 20.0]
    assert summaries[0]["eval_loss_equal_time"] == 3.1  # its own final loss
    assert summaries[1]["eval_loss_equal_time"] == pytest.approx(3.0)
