"""``ddiloco train --resume``: every process of a run is SIGKILLed, and the run continues in
its directory — the syncer from its store, each learner from its local checkpoint (its step,
so its learning rate, and its data position), metrics appended, never truncated."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from rundir import argv, records

from ddiloco.cli import main

SETS = [
    "model='gpt-tiny'",
    "methods=['decoupled']",
    "runtime='processes'",
    "chaos=[]",
    "train.learners=2",
    "train.batch_size=4",
    "train.eval_every=1000000",
    "train.tokens=10000000",
    "sync.fragments=4",
    "sync.sync_every=8",
    "data.eval_batches=1",
    "processes.learner_checkpoint_every=1.0",
    "processes.detect_seconds=3.0",
    "processes.max_wall_seconds=120",
]


def saves(run: Path) -> dict[int, int]:
    """learner -> the step of its newest local checkpoint."""
    found: dict[int, int] = {}
    for m in (0, 1):
        names = sorted((run / "processes" / "learners" / f"learner-{m}").glob("state-*.bin"))
        if names:
            found[m] = int(names[-1].stem.split("-")[1])
    return found


def kill_everything(launcher: subprocess.Popen[bytes], run: Path) -> None:
    """SIGKILL the launcher and every process it started (their pids are in the metrics)."""
    launcher.kill()
    launcher.wait()
    for r in records(run):
        if r["kind"] in ("started", "rank_up"):  # a torchrun job's ranks too
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(r["pid"]), signal.SIGKILL)


def test_a_run_killed_whole_resumes_at_its_learners_steps_and_data_positions(tmp_path):
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "ddiloco.cli", "train", "--quiet", "--out", str(run)]
    first = subprocess.Popen([*cmd, *argv(*SETS)], stdout=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:  # both learners saved after some merges
            time.sleep(0.5)
            held = saves(run)
            if len(held) == 2 and min(held.values()) >= 24:
                break
        else:
            pytest.fail("the learners never saved a local checkpoint")
    finally:
        kill_everything(first, run)
    before = (run / "metrics.jsonl").read_bytes()
    held = saves(run)
    killed_at = max(r["t"] for r in records(run))
    steps = [r for r in records(run) if r["kind"] == "step"]
    # the resumed run: to a budget a little past what was trained, then it stops by itself
    trained = sum(1 for _ in steps) * 4 * 64
    budget = f"train.tokens={trained + 40 * 4 * 64 * 2}"
    assert main(["train", "--quiet", "--resume", str(run), *argv(budget)]) == 0
    after = (run / "metrics.jsonl").read_bytes()
    assert after.startswith(before) and len(after) > len(before)  # appended, not truncated
    new = records(run)[len(before.splitlines()) :]
    back = {r["learner"]: r for r in new if r["kind"] == "recovered"}
    # a learner slow to start (a loaded machine) caught up at the global step with its data
    # position at 0: from there on, a batch a step
    late = {
        r["learner"]: r["step"]
        for r in records(run)[: len(before.splitlines())]
        if r["kind"] == "caught_up" and r.get("source") == "syncer"
    }
    for m in (0, 1):
        assert back[m]["source"] == "local" and back[m]["step"] >= held[m]
        assert back[m]["position"] == back[m]["step"] - late.get(m, 0)  # its data position
        first_step = min(r["step"] for r in new if r["kind"] == "step" and r["learner"] == m)
        assert first_step == back[m]["step"] + 1  # the schedule goes on from there
    assert min(r["t"] for r in new) >= killed_at  # times go on from the last record
    summary = json.loads((run / "summary.json").read_text())
    assert summary["tokens"] >= trained and summary["checkpoint"]
    assert (run / summary["checkpoint"] / "model.safetensors").is_file()


def test_a_data_parallel_job_killed_whole_resumes_from_its_last_rollback_checkpoint(tmp_path):
    run = tmp_path / "run"
    dp = [*SETS[:-3], "methods=['data_parallel']", "data_parallel.checkpoint_every=10"]
    cmd = [sys.executable, "-m", "ddiloco.cli", "train", "--quiet", "--out", str(run)]
    first = subprocess.Popen([*cmd, *argv(*dp, "processes.max_wall_seconds=120")])
    ckpts = run / "processes" / "data_parallel" / "checkpoints"
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and not list(ckpts.glob("ckpt-00000020.bin")):
            time.sleep(0.5)
    finally:
        kill_everything(first, run)
    assert list(ckpts.glob("ckpt-*.bin")), "the job never wrote a rollback checkpoint"
    latest = max(int(p.stem.split("-")[1]) for p in ckpts.glob("ckpt-*.bin"))
    done = max(r["step"] for r in records(run) if r["kind"] == "step")
    budget = (done + 40) * 2 * 4 * 64  # past what the killed launch trained, whenever it died
    before = len(records(run))
    assert main(["train", "--quiet", "--resume", str(run), *argv(f"train.tokens={budget}")]) == 0
    new = records(run)[before:]
    # (torchrun may restart the group once more, e.g. while the killed launch's rendezvous
    # port is still held: that logs a later resume, from a later checkpoint)
    resumed = next(r for r in new if r["kind"] == "resumed")
    assert resumed["attempt"] == 0 and resumed["step"] == latest
    first_step = min(r["step"] for r in new if r["kind"] == "step")
    assert first_step == latest + 1
    summary = json.loads((run / "summary.json").read_text())
    assert summary["tokens"] >= budget and summary["tokens_merged"] <= summary["tokens"]
    assert all(v >= 0 for v in summary["tokens_wasted"].values())
    assert 0 < summary["goodput"] <= 1.0


def test_a_resume_that_changes_what_was_trained_and_a_reused_directory_are_refused(
    tmp_path, capsys
):
    run = tmp_path / "run"
    short = [*SETS[:-3], "train.tokens=3000", "processes.max_wall_seconds=120"]
    assert main(["train", "--quiet", "--out", str(run), *argv(*short)]) == 0
    capsys.readouterr()
    assert main(["train", "--quiet", "--out", str(run), *argv(*short)]) == 2
    err = capsys.readouterr().err
    assert "holds a run" in err and f"continue it with --resume {run}" in err
    assert main(["train", "--resume", str(run), *argv("model='gpt-1m'")]) == 2
    assert "model='gpt-1m': cannot change on resume (the run has 'gpt-tiny')" in (
        capsys.readouterr().err
    )
    assert main(["train", "--resume", str(run), "--config", "x.toml"]) == 2
    assert "keeps its own config" in capsys.readouterr().err
    sim = tmp_path / "sim"
    sets = [s for s in short if not s.startswith(("runtime", "processes"))]
    assert main(["train", "--quiet", "--out", str(sim), *argv(*sets)]) == 0
    capsys.readouterr()
    assert main(["train", "--resume", str(sim)]) == 0  # (tests/integration/test_sim_resume.py)
    assert "decoupled: finished (checkpoints/step-" in capsys.readouterr().out


def test_a_run_resumed_twice_with_raised_budgets_counts_on_and_keeps_the_budget(tmp_path, capsys):
    # issue 33: the progress line went back to 0 and a second resume trained to the first
    # launch's budget (the raise was never written down)
    status = re.compile(r"tokens\s+([\d,]+) \(\s*([\d.]+)%\)")
    run = tmp_path / "run"
    sets = [*SETS[:-3], "processes.max_wall_seconds=120", "report.progress_seconds=0"]
    budget = 3000
    assert (
        main(["train", "--quiet", "--out", str(run), *argv(*sets, f"train.tokens={budget}")]) == 0
    )
    first = json.loads((run / "summary.json").read_text())
    held, sent = first["tokens"], first["bytes_sent"]
    capsys.readouterr()
    for _ in range(2):
        budget = held + 3000  # (a run ends past its budget: learners step until the end)
        assert main(["train", "--resume", str(run), *argv(f"train.tokens={budget}")]) == 0
        out = capsys.readouterr().out
        assert re.search(rf"^tokens = {budget}$", (run / "config.toml").read_text(), re.M)
        lines = [(int(m[1].replace(",", "")), float(m[2])) for m in status.finditer(out)]
        assert lines and lines[0][0] >= held, out  # from where it stood, not from 0
        assert all(p == pytest.approx(100 * t / budget, abs=0.06) for t, p in lines)
        summary = json.loads((run / "summary.json").read_text())
        assert summary["tokens"] >= budget and summary["tokens"] >= held  # never back
        assert summary["bytes_sent"] > sent  # the launches' bytes add up
        moved = summary["bytes_sent"] + summary["bytes_received"]
        assert summary["bytes_per_token"] == pytest.approx(moved / summary["tokens"])
        held, sent = summary["tokens"], summary["bytes_sent"]
    assert sum(r["kind"] == "resume" for r in records(run)) == 2  # where the lines break
    count = len(records(run))  # a resume with nothing left to train starts no process
    assert main(["train", "--resume", str(run)]) == 0
    assert f"decoupled: finished ({held:,} tokens of {budget:,}): not run again" in (
        capsys.readouterr().out
    )
    assert len(records(run)) == count
    assert json.loads((run / "summary.json").read_text())["tokens"] == held
