"""What the plots draw, read from the records they are drawn from."""

from __future__ import annotations

import json
import math

from ddiloco.report.metrics import kept_records
from ddiloco.report.plots import (
    byte_series,
    eval_tokens,
    learners_sent,
    outages,
    read_metrics,
    train_loss_curves,
)
from ddiloco.report.run_writer import eval_curves


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


def test_a_resume_breaks_the_loss_line_and_the_abandoned_launchs_records_are_left_out():
    # a simulated run killed at t=6 resumes from its checkpoint at t=4: the records of the
    # killed launch after t=4 are abandoned work, and the line breaks at the resume
    killed = [_step(0, s, 5.0 - 0.1 * s, float(s)) for s in range(1, 7)]
    evals = [{"kind": "eval", "method": "decoupled", "loss": 4.5, "tokens": 9, "t": 5.0}]
    resume = {"kind": "resume", "method": "decoupled", "tokens": 8, "step": 4, "t": 4.0}
    other = {"kind": "eval", "method": "data_parallel", "loss": 4.0, "tokens": 9, "t": 5.0}
    again = [_step(0, s, 3.0, float(s)) for s in (5, 6)]
    records = kept_records([*killed, *evals, other, resume, *again])
    assert [(r["kind"], r["t"]) for r in records if r["method"] == "decoupled"] == [
        *[("step", float(s)) for s in range(1, 5)],
        ("resume", 4.0),
        ("step", 5.0),
        ("step", 6.0),
    ]
    assert other in records  # another method's records stand
    points = train_loss_curves(records)[("decoupled", 0)]
    assert [t for t, _ in points] == [1.0, 2.0, 3.0, 4.0, 5.0, 5.0, 6.0]
    assert math.isnan(points[4][1]) and points[5][1] == 3.0  # broken, the average anew


def test_a_cut_line_is_skipped_and_compare_reads_the_kept_records(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    lines = [
        {"kind": "eval", "method": "decoupled", "loss": 4.0, "tokens": 0, "t": 0.0},
        {"kind": "eval", "method": "decoupled", "loss": 3.0, "tokens": 9, "t": 9.0},
    ]
    text = "".join(json.dumps(r) + "\n" for r in lines) + '{"kind": "st\n'  # cut by a kill
    text += json.dumps({"kind": "resume", "method": "decoupled", "t": 5.0}) + "\n"
    (run / "metrics.jsonl").write_text(text)
    assert [r["t"] for r in read_metrics(run / "metrics.jsonl")] == [0.0, 5.0]
    assert eval_curves(run / "metrics.jsonl") == {"decoupled": [(0.0, 4.0)]}


def test_bytes_show_both_directions_of_every_method():
    rounds = [
        {"kind": "round", "method": "decoupled", "t": float(t), "answers": 2, "asked": 3,
         "broadcast_bytes": 100}
        for t in (1, 2)
    ]  # fmt: skip
    steps = [_step(0, s, 4.0, float(s)) | {"method": "data_parallel"} for s in (1, 2, 3, 4)]
    totals = {
        "decoupled": {"clock": "virtual", "bytes_sent": 800, "bytes_received": 600},
        "data_parallel": {"clock": "virtual", "bytes_sent": 4000, "bytes_received": 4000},
    }
    series = byte_series([*rounds, *steps], totals)
    assert series == {
        "decoupled syncer -> learners": [(1.0, 300), (2.0, 300)],
        "decoupled learners -> syncer": [(1.0, 400.0), (2.0, 400.0)],  # the summary's 800
        "data_parallel all-reduce (each way)": [(float(s), 1000.0) for s in (1, 2, 3, 4)],
    }
    # real processes: the syncer counted them, so what learners sent is what it received
    assert learners_sent({"clock": "wall", "bytes_sent": 1, "bytes_received": 7}) == 7


def test_an_in_place_evaluation_is_drawn_at_the_middle_of_the_tokens_it_spanned():
    copy = {"kind": "eval", "tokens": 1000, "loss": 3.0}  # one global model exactly
    in_place = {"kind": "eval", "tokens": 1000, "tokens_end": 5000, "merged_during": 3}
    assert eval_tokens(copy) == 1000
    assert eval_tokens(in_place) == 3000
