"""The summary's equal-time loss: a method's eval loss when the first method finished."""

from __future__ import annotations

import pytest

from ddiloco.config import load_config
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


def test_the_tables_equal_time_names_the_method_that_set_it_and_compare_says_each_runs():
    from ddiloco.commands.train import render

    def s(method: str, seconds: float, horizon: float) -> dict:
        return {
            "method": method, "eval_loss": 4.0, "eval_loss_equal_time": 4.1, "tokens": 100,
            "tokens_merged": 100, "tokens_wasted": {}, "goodput": 1.0, "uptime": 1.0,
            "virtual_seconds": seconds, "equal_time_seconds": horizon, "bytes_per_token": 8,
            "clock": "wall",
        }  # fmt: skip

    # summary.json's methods come back sorted: data_parallel before the decoupled that set it
    one_run = render([s("data_parallel", 166, 119), s("decoupled", 119, 119)])
    assert "at 119 wall s: when decoupled finished" in one_run
    two_runs = render([s("a/decoupled", 119, 119), s("b/decoupled", 62, 62)])
    assert "at equal time: each run's, when its first method finished" in two_runs


def test_a_run_whose_answers_came_late_under_outer_momentum_is_told_so():
    from ddiloco.commands.train import late_notes

    late = {"method": "decoupled", "answers": {"accepted": 100, "waiting": 300, "late": 250}}
    fresh = {"method": "decoupled", "answers": {"accepted": 400, "late": 20}}
    config = load_config(None, ["methods=['decoupled']"])
    (note,) = late_notes(config, [late])
    assert "250 of decoupled's 400 answers came late" in note and "momentum=0.0" in note
    assert late_notes(config, [fresh]) == []  # (5%: nothing to say)
    as_is = load_config(None, ["methods=['decoupled']", "sync.outer.momentum=0.0"])
    assert late_notes(as_is, [late]) == []  # no momentum to carry them on
