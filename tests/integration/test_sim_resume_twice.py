"""Issue 33: a run resumed twice with a raised budget goes on from where it stood and never
back: its progress lines count on from the tokens it held (against the raised budget), its
evaluations stay on the run's ``train.eval_every`` cadence, config.toml keeps the raised
budget for the next resume, and summary.json is never replaced by one with fewer tokens.
Also: a Ctrl-C in a later method keeps the finished methods' summary, and a refused start
leaves no run directory."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from rundir import argv, records

from ddiloco.checkpoints.format import steps_in
from ddiloco.cli import main
from ddiloco.errors import ConfigError
from ddiloco.report.metrics import kept_records
from ddiloco.report.run_writer import FEWER, RunWriter

TOKENS_PER_STEP = 2 * 64  # one learner step: batch_size x gpt-tiny's context
SETS = [
    "model='gpt-tiny'",
    "methods=['decoupled']",
    "chaos=[]",
    "train.learners=3",
    "train.batch_size=2",
    "train.eval_every=1000",  # (1024: the first multiple of a step's 128 tokens past it)
    "train.checkpoint_every=1536",
    "sync.fragments=3",
    "sync.sync_every=3",
    "data.eval_batches=1",
    "report.progress_seconds=0",  # a status line at each evaluation: what the test reads
]
FIRST, RAISED = 4608, 9216
STATUS = re.compile(r"tokens\s+([\d,]+) \(\s*([\d.]+)%\)")


def status_lines(text: str) -> list[tuple[int, float]]:
    """(tokens, percent) of every status line printed."""
    return [(int(m[1].replace(",", "")), float(m[2])) for m in STATUS.finditer(text)]


def summary_of(run: Path) -> dict[str, Any]:
    return json.loads((run / "summary.json").read_text(encoding="utf-8"))


def kill_at_eval(monkeypatch: pytest.MonkeyPatch, tokens: int) -> None:
    """The launch dies (a KeyboardInterrupt, as at a Ctrl-C) at its first evaluation at or
    past ``tokens``, before that step's checkpoint: its newer checkpoints are older."""
    emit = RunWriter.emit

    def dying(self: RunWriter, record: dict[str, Any]) -> None:
        if record["kind"] == "eval" and record["tokens"] >= tokens:
            raise KeyboardInterrupt
        emit(self, record)

    monkeypatch.setattr(RunWriter, "emit", dying)


def test_a_run_resumed_twice_with_a_raised_budget_goes_on_and_never_back(
    tmp_path, capsys, monkeypatch
):
    run = tmp_path / "run"
    assert main(["train", "--out", str(run), *argv(*SETS, f"train.tokens={FIRST}")]) == 0
    first = summary_of(run)
    assert FIRST <= first["tokens"] < FIRST + TOKENS_PER_STEP
    capsys.readouterr()

    # resume 1 raises the budget and dies on the way, past the first budget
    with monkeypatch.context() as m:
        kill_at_eval(m, 7168)
        assert main(["train", "--resume", str(run), *argv(f"train.tokens={RAISED}")]) == 130
    out = capsys.readouterr().out
    assert f"train.tokens: {FIRST} -> {RAISED}" in out
    assert re.search(rf"^tokens = {RAISED}$", (run / "config.toml").read_text(), re.M)
    lines = status_lines(out)  # the count goes on from the run's tokens, against the raise
    assert lines[0][0] == first["tokens"] and lines[0][1] == pytest.approx(50.0, abs=0.1)
    assert [t for t, _ in lines] == sorted(t for t, _ in lines)
    assert all(p == pytest.approx(100 * t / RAISED, abs=0.06) for t, p in lines)
    assert summary_of(run)["tokens"] == first["tokens"]  # killed: the summary stands
    held = steps_in(run / "checkpoints")[-1]  # a checkpoint past the first budget
    at = json.loads((run / "checkpoints" / f"step-{held}" / "ddiloco.json").read_text())
    assert FIRST < at["tokens"] < RAISED

    # resume 2, no --set: config.toml's raised budget, from the newest checkpoint
    assert main(["train", "--resume", str(run)]) == 0
    out = capsys.readouterr().out
    assert f"resuming from checkpoints/step-{held} ({at['tokens']:,} tokens" in out
    lines = status_lines(out)
    assert lines[0][0] == at["tokens"] and lines[-1][0] >= RAISED
    assert [t for t, _ in lines] == sorted(t for t, _ in lines)
    second = summary_of(run)
    assert RAISED <= second["tokens"] < RAISED + TOKENS_PER_STEP  # the raised budget

    # evaluations stayed on the run's cadence through both resumes (multiples of 1024),
    # but for each launch's final evaluation and the one at each resume point
    kept = kept_records(records(run))
    resumed_at = {r["tokens"] for r in kept if r["kind"] == "resume"}
    finals = {FIRST, second["tokens"]}
    evals = [r["tokens"] for r in kept if r["kind"] == "eval"]
    grid = set(range(0, RAISED, 1024))
    assert grid <= set(evals) and set(evals) - grid <= resumed_at | finals, sorted(evals)

    # a resume that would take the run back (its newest checkpoints removed, the budget
    # lowered) keeps summary.json as it was, says so, and puts its own summary aside
    for step in steps_in(run / "checkpoints"):
        if step > held:
            for f in sorted((run / "checkpoints" / f"step-{step}").rglob("*"), reverse=True):
                f.unlink() if f.is_file() else f.rmdir()
            (run / "checkpoints" / f"step-{step}").rmdir()
    assert main(["train", "--quiet", "--resume", str(run), *argv(f"train.tokens={FIRST}")]) == 0
    err = capsys.readouterr().err
    assert "WARNING: decoupled ended this launch at" in err and "summary.json keeps" in err
    third = summary_of(run)
    assert third["tokens"] == second["tokens"] and third["checkpoint"] == second["checkpoint"]
    aside = json.loads((run / FEWER).read_text())["decoupled"]
    assert at["tokens"] <= aside["tokens"] < second["tokens"]


def test_a_ctrl_c_in_the_second_method_keeps_the_first_ones_summary(tmp_path, capsys, monkeypatch):
    # seen: Ctrl-C during the demo's data-parallel printed "killed, no summary" though
    # decoupled had finished; the Ctrl-C here strikes at data-parallel's third step
    run = tmp_path / "run"
    emit = RunWriter.emit

    def ctrl_c(self: RunWriter, record: dict[str, Any]) -> None:
        if self.method == "data_parallel" and record["kind"] == "step" and record["step"] == 3:
            raise KeyboardInterrupt
        emit(self, record)

    monkeypatch.setattr(RunWriter, "emit", ctrl_c)
    sets = [*SETS, "methods=['decoupled', 'data_parallel']", "train.tokens=3072"]
    assert main(["train", "--quiet", "--out", str(run), *argv(*sets)]) == 130
    captured = capsys.readouterr()
    assert "interrupted during data_parallel" in captured.err and "hold decoupled" in captured.err
    assert "killed, no summary" not in captured.err
    assert "decoupled model:" in captured.out  # the table and where the model is
    summary = summary_of(run)
    assert list(summary["methods"]) == ["decoupled"] and summary["interrupted"] == "data_parallel"
    assert summary["tokens"] >= 3072 and (run / summary["checkpoint"]).is_dir()
    assert (run / "eval_loss.png").is_file()


def test_a_ctrl_c_in_the_first_method_still_has_no_summary(tmp_path, capsys, monkeypatch):
    kill_at_eval(monkeypatch, 1024)
    run = tmp_path / "run"
    assert main(["train", "--quiet", "--out", str(run), *argv(*SETS)]) == 130
    assert "killed, no summary" in capsys.readouterr().err
    assert not (run / "summary.json").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available: not refused")
def test_a_refused_start_leaves_no_run_directory_and_keeps_a_users_own(
    tmp_path, capsys, monkeypatch
):
    fresh = tmp_path / "new" / "run"
    assert main(["train", "--out", str(fresh), *argv(*SETS, "train.device='cuda'")]) == 2
    assert "CUDA is not available" in capsys.readouterr().err
    assert not (tmp_path / "new").exists()
    bad = tmp_path / "plan.json"
    bad.write_text('{"events": []}')
    assert main(["train", "--out", str(fresh), *argv(*SETS, f"chaos_plan='{bad}'")]) == 2
    assert "expected a JSON list" in capsys.readouterr().err
    assert not (tmp_path / "new").exists()

    def refused(*args: Any, **kwargs: Any) -> None:  # (a sink refused: a missing package)
        raise ConfigError("report.tensorboard", True, "not installed")

    monkeypatch.setattr(RunWriter, "__init__", refused)
    assert main(["train", "--out", str(fresh), *argv(*SETS)]) == 2
    assert not (tmp_path / "new").exists()  # made by this command: taken away again
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("the user's")
    assert main(["train", "--out", str(mine), *argv(*SETS)]) == 2
    assert (mine / "notes.txt").read_text() == "the user's"  # never a user's directory
