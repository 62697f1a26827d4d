"""``ddiloco train --resume`` on the simulated clock: a ``ddiloco train`` SIGKILLed after its
first checkpoint continues from its newest checkpoint (the global model, the learners' steps
and data positions, the tokens and the virtual time), metrics appended, never truncated; a
method that finished is not run again, one with no checkpoint starts from the beginning; a
damaged checkpoint is refused naming the file; a changed model is refused."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from rundir import argv, records

from ddiloco import train
from ddiloco.chaos.plan import ChaosEvent
from ddiloco.checkpoints.format import steps_in
from ddiloco.cli import main
from ddiloco.config import load_config
from ddiloco.runtime.sim.restart import carried_chaos

TOKENS_PER_STEP = 2 * 64  # batch_size x gpt-tiny's context
ROUND = 3 * TOKENS_PER_STEP  # one step of each of the 3 learners
SETS = [
    "model='gpt-tiny'",
    "train.learners=3",
    "train.batch_size=2",
    "train.eval_every=1536",
    "sync.fragments=3",
    "sync.sync_every=3",
    "data.eval_batches=1",
]


def manifest(checkpoint: Path) -> dict[str, Any]:
    return json.loads((checkpoint / "ddiloco.json").read_text(encoding="utf-8"))


def test_a_run_killed_after_a_checkpoint_resumes_from_it_and_finishes_within_its_budget(
    tmp_path, capsys
):
    run = tmp_path / "run"
    sets = [
        *SETS,
        "methods=['decoupled', 'data_parallel']",
        "train.checkpoint_every=768",  # every 2 equivalent steps
        "train.tokens=1000000",  # far more than it trains before it is killed
        "chaos=[{at=1.0, kind='slow', learner=2, factor=1.5}]",  # to the end
    ]
    cmd = [sys.executable, "-m", "ddiloco.cli", "train", "--quiet", "--out", str(run)]
    first = subprocess.Popen([*cmd, *argv(*sets)], stdout=subprocess.DEVNULL)
    home = run / "checkpoints"
    try:
        deadline = time.monotonic() + 60
        while not steps_in(home) and first.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        first.kill()
        first.wait()
    assert steps_in(home), "the run never wrote a checkpoint"
    newest = home / f"step-{steps_in(home)[-1]}"
    at = manifest(newest)
    state = json.loads((newest / "resume" / "state.json").read_text(encoding="utf-8"))
    before = (run / "metrics.jsonl").read_bytes()
    assert not (run / "summary.json").exists()
    initial = next(r["loss"] for r in records(run) if r["kind"] == "eval")

    budget = at["tokens"] + 6 * ROUND
    assert main(["train", "--quiet", "--resume", str(run), *argv(f"train.tokens={budget}")]) == 0
    out = capsys.readouterr().out
    assert f"decoupled: resuming from checkpoints/{newest.name} ({at['tokens']:,} tokens" in out
    assert "data_parallel: no checkpoint to resume from: it starts from the beginning" in out
    after = (run / "metrics.jsonl").read_bytes()
    assert after.startswith(before) and len(after) > len(before)  # appended, not truncated
    new = records(run)[len(before.decode().splitlines()) :]
    mine = [r for r in new if r["method"] == "decoupled"]
    resumed = mine[0]
    assert resumed["kind"] == "resume" and resumed["checkpoint"] == f"checkpoints/{newest.name}"
    assert (resumed["step"], resumed["tokens"], resumed["t"]) == (
        at["step"],
        at["tokens"],
        state["t"],
    )
    assert all(r["t"] >= state["t"] for r in mine)  # virtual time goes on from the checkpoint
    evals = [r for r in mine if r["kind"] == "eval"]
    assert evals[0]["tokens"] == at["tokens"]  # the tokens it holds count, not from 0
    for m, learner in enumerate(state["learners"]):  # each at its own step, not from 0
        steps = [r["step"] for r in mine if r["kind"] == "step" and r["learner"] == m]
        assert steps[0] == learner["step"] + 1 > 1
    slowed = [r for r in mine if r["kind"] == "chaos"]  # the straggler is still slow
    assert [(r["event"], r["learner"], r["t"]) for r in slowed] == [("slow", 2, state["t"])]

    summary = json.loads((run / "summary.json").read_text(encoding="utf-8"))
    for method, s in summary["methods"].items():
        assert (
            budget <= s["tokens"] < budget + (TOKENS_PER_STEP if method == "decoupled" else ROUND)
        )
        assert math.isfinite(s["eval_loss"]) and s["eval_loss"] < initial
        assert s["ledger_balanced"]
        assert s["tokens_merged"] + sum(s["tokens_wasted"].values()) == pytest.approx(s["tokens"])
        final = manifest(run / s["checkpoint"])
        assert final["eval_loss"] == pytest.approx(s["eval_loss"])
    dec = summary["methods"]["decoupled"]
    assert dec["resumed_from"]["checkpoint"] == f"checkpoints/{newest.name}"
    assert dec["tokens_wasted"].get("resumed", 0) > 0  # the learners' progress since a merge
    assert summary["methods"]["data_parallel"]["resumed_from"]["checkpoint"] is None


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """A short finished run: checkpoints at steps 4, 8 and 12 (the final one)."""
    run = tmp_path_factory.mktemp("resume") / "run"
    sets = [*SETS, "methods=['decoupled']", "train.tokens=4608", "train.checkpoint_every=1536"]
    config = load_config(None, sets)
    train(config, run, quiet=True)
    assert steps_in(run / "checkpoints") == [4, 8, 12]
    return run


def copy_of(run: Path, tmp_path: Path) -> Path:
    shutil.copytree(run, tmp_path / "run")
    return tmp_path / "run"


def test_a_damaged_newest_checkpoint_is_refused_naming_the_file_until_it_is_removed(
    finished, tmp_path, capsys
):
    run = copy_of(finished, tmp_path)
    weights = run / "checkpoints" / "step-12" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-5] ^= 0xFF
    weights.write_bytes(bytes(data))
    (run / "summary.json").unlink()
    before = (run / "metrics.jsonl").read_bytes()
    assert main(["train", "--quiet", "--resume", str(run)]) == 2
    err = capsys.readouterr().err
    assert f"checkpoint {weights}: BLAKE3 digest mismatch" in err
    assert f"remove {weights.parent} to resume from step-8" in err
    assert (run / "metrics.jsonl").read_bytes() == before  # nothing written

    shutil.rmtree(weights.parent)  # as it says: the run goes on from step-8
    assert main(["train", "--quiet", "--resume", str(run)]) == 0
    assert "decoupled: resuming from checkpoints/step-8 (3,072 tokens" in capsys.readouterr().out
    resumed = [r for r in records(run) if r["kind"] == "resume"]
    assert [(r["step"], r["tokens"]) for r in resumed] == [(8, 3072)]
    summary = json.loads((run / "summary.json").read_text(encoding="utf-8"))
    assert 4608 <= summary["tokens"] < 4608 + TOKENS_PER_STEP
    assert summary["checkpoint"] == "checkpoints/step-12"
    assert manifest(run / "checkpoints" / "step-12")["tokens"] == summary["tokens"]


def test_a_finished_method_is_not_run_again_and_keeps_its_summary(finished, tmp_path, capsys):
    run = copy_of(finished, tmp_path)
    first = json.loads((run / "summary.json").read_text(encoding="utf-8"))
    count = len(records(run))
    assert main(["train", "--quiet", "--resume", str(run)]) == 0
    assert "decoupled: finished (checkpoints/step-12): not run again" in capsys.readouterr().out
    added = records(run)[count:]
    assert [r["kind"] for r in added] == ["resume"] and added[0]["finished"]
    again = json.loads((run / "summary.json").read_text(encoding="utf-8"))
    for s in (first, again):
        s.pop("wall_seconds")
        s.pop("methods")
    assert again.pop("resumed_from")["finished"]
    assert again == first  # rebuilt from its final checkpoint's state, every number


def test_a_resume_that_changes_the_model_is_refused(finished, capsys):
    before = (finished / "metrics.jsonl").read_bytes()
    assert main(["train", "--resume", str(finished), *argv("model='gpt-1m'")]) == 2
    assert "model='gpt-1m': cannot change on resume (the run has 'gpt-tiny')" in (
        capsys.readouterr().err
    )
    assert main(["train", "--resume", str(finished), *argv("sync.fragments=2")]) == 2
    assert "cannot change on resume" in capsys.readouterr().err
    # a chaos plan given on resume would not be played: refused, not ignored
    chaos = "chaos=[{at=1.0, kind='crash', learner=0, duration=1.0}]"
    assert main(["train", "--resume", str(finished), *argv(chaos)]) == 2
    assert "a resume plays no new chaos" in capsys.readouterr().err
    assert (finished / "metrics.jsonl").read_bytes() == before


def test_a_checkpoint_without_a_resume_state_is_refused_naming_it(finished, tmp_path, capsys):
    run = copy_of(finished, tmp_path)
    newest = run / "checkpoints" / "step-12"
    listed = manifest(newest)
    listed["files"] = {k: v for k, v in listed["files"].items() if not k.startswith("resume/")}
    (newest / "ddiloco.json").write_text(json.dumps(listed), encoding="utf-8")
    assert main(["train", "--quiet", "--resume", str(run)]) == 2
    err = capsys.readouterr().err
    assert f"checkpoint {newest / 'resume' / 'state.json'}: missing" in err


def test_a_slowdown_in_effect_at_the_checkpoint_is_struck_again_and_a_crash_is_not():
    plan = [
        ChaosEvent(at=1.0, kind="slow", learner=2, factor=1.5),  # to the end
        ChaosEvent(at=2.0, kind="link_cut", learner=0, duration=10.0),
        ChaosEvent(at=3.0, kind="crash", learner=1, duration=20.0),
        ChaosEvent(at=4.0, kind="slow", learner=0, duration=1.0, factor=2.0),  # over by 5
        ChaosEvent(at=9.0, kind="freeze", learner=1, duration=1.0),
    ]
    assert carried_chaos(plan, 8.0) == (
        ChaosEvent(at=8.0, kind="slow", learner=2, factor=1.5),
        ChaosEvent(at=8.0, kind="link_cut", learner=0, duration=4.0),
        ChaosEvent(at=9.0, kind="freeze", learner=1, duration=1.0),
    )
