"""A user's own training loop as every learner (``train.entry``, ``ddiloco.Learner``) under the
real launcher: examples/own_loop.py run as a script (a crash: the learner restarts and copies
its peer), and the same loop with a crash and a freeze on three learners — the ledger
balances, the eval loss falls, the frozen learner is detected and comes back."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hooks import kill_then_stop, train_with_hook
from rundir import records

from ddiloco.chaos.plan import ChaosEvent
from ddiloco.config import load_config
from ddiloco.runtime.processes.launcher.fragments import Launcher

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_the_own_loop_example_trains_and_its_crashed_learner_copies_its_peer(tmp_path):
    out = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / "own_loop.py"), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["ledger_balanced"] and summary["ledger_errors"] == 0
    evals = [r["loss"] for r in records(out) if r.get("kind") == "eval"]
    assert evals[-1] < evals[0] - 1.5, evals  # 5.5 -> ~2.7 nats: it trained
    recovered = [r for r in records(out) if r.get("kind") == "recovered"]
    assert [(r["learner"], r["peer"]) for r in recovered] == [(1, 0)], recovered
    assert "'ledger_balanced': True" in done.stdout


def test_an_own_loop_survives_a_crash_and_a_freeze_under_the_launcher(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))  # the launcher's pre-flight imports it
    monkeypatch.setenv("PYTHONPATH", str(EXAMPLES))  # the learner processes do too
    chaos = "[{at=6.0, kind='crash', learner=1, duration=1.0}]"  # (the freeze: by the hook)
    overrides = [
        "runtime='processes'",
        "methods=['decoupled']",
        "model='own_loop:build_model'",
        "train.entry='own_loop:main'",
        "train.evaluate='own_loop:evaluate'",
        "train.learners=3",
        "train.batch_size=8",
        "train.seq_len=64",
        "train.tokens=10000000",  # (the hook below stops it once both came back)
        "train.eval_every=200000",
        "processes.max_wall_seconds=150",
        "sync.fragments=3",
        "sync.sync_every=6",
        "sync.rounds.quorum=2",
        "data.eval_batches=2",
        "processes.detect_seconds=2.0",
        f"chaos={chaos}",
    ]
    state: dict[str, Any] = {"after": 0, "steps": 0}

    def hook(launcher: Any, r: dict[str, Any]) -> None:  # stop once both came back
        if r["kind"] == "recovered" and r["learner"] == 1:
            state["recovered"] = True
        if r["kind"] == "step" and r["learner"] == 2:
            state["steps"] += 1
            if state["steps"] == 10:  # frozen once it trains (a loaded machine starts it late)
                state["frozen"] = launcher.now()
                launcher.play(ChaosEvent(state["frozen"], "freeze", 2, duration=5.0))
            elif "frozen" in state and r["t"] > state["frozen"] + 5.0:  # thawed
                state["after"] += 1
        # (>=, once: learner 2 may take its 20 steps after the thaw before learner 1 is back)
        if state.get("recovered") and state["after"] >= 20 and not state.get("stopped"):
            state["stopped"] = True
            launcher.request_stop()

    config = load_config(None, overrides)
    (summary,) = train_with_hook(config, tmp_path / "run", hook, monkeypatch)
    assert summary["ledger_balanced"] and summary["ledger_errors"] == 0
    run = records(tmp_path / "run")
    evals = [r["loss"] for r in run if r.get("kind") == "eval"]
    assert evals[-1] < evals[0] - 1.5, evals
    recovered = [r for r in run if r.get("kind") == "recovered"]
    assert [r["learner"] for r in recovered] == [1] and recovered[0]["peer"] is not None
    frozen = next(r for r in run if r.get("kind") == "chaos" and r.get("event") == "freeze")
    detected = [r for r in run if r.get("kind") == "detected" and r.get("learner") == 2]
    assert detected and detected[0]["t"] - frozen["t"] < 2.0 + 2.0, detected  # detect + slack
    after = [r for r in run if r.get("kind") == "step" and r["learner"] == 2]
    assert after and after[-1]["t"] > frozen["t"] + 5.0  # thawed, it trained on


@pytest.fixture(autouse=True)
def _forget_the_example():
    yield
    sys.modules.pop("own_loop", None)


def test_the_hugging_face_trainer_drives_a_learner_through_its_callback(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    out = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / "hf_trainer.py"), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["ledger_balanced"] and summary["tokens"] >= 150_000
    evals = [r["loss"] for r in records(out) if r.get("kind") == "eval"]
    assert evals[-1] < evals[0] - 1.5, evals  # 5.55 -> ~2.7
    assert summary["learner_uptime"] > 0.95


def test_an_own_loop_of_two_torchrun_ranks_per_learner_wraps_itself_in_ddp(tmp_path):
    """``processes.ranks = 2``: torchrun runs the entry on every rank, each makes its Learner
    (rank 0 talks to the syncer), the example wraps its model in DDP over the group."""
    out = tmp_path / "run"
    argv = [str(EXAMPLES / "own_loop.py"), "--ranks", "2", "--no-crash", "--out", str(out)]
    done = subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    run = records(out)
    ups = [r for r in run if r.get("kind") == "learner_up"]
    assert sorted((r["learner"], r["ranks"]) for r in ups) == [(0, 2), (1, 2)]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["ledger_balanced"]
    evals = [r["loss"] for r in run if r.get("kind") == "eval"]
    assert evals[-1] < evals[0] - 1.5, evals


def test_an_own_loop_sharded_with_fsdp_copies_its_peer_shard_to_shard(tmp_path, monkeypatch):
    """examples/own_loop_fsdp.py's run: a Hugging Face GPT-2 under ``fully_shard`` over 2 ranks
    per learner, the user's loss and loader; learner 1 is killed once rounds merged (not at a
    fixed time: a loaded machine starts 2-rank learners slowly) and its ranks copy learner
    0's, rank by rank (parameters and AdamW moments as DTensors again)."""
    pytest.importorskip("transformers")
    monkeypatch.syspath_prepend(str(EXAMPLES))  # the launcher's pre-flight imports it
    monkeypatch.setenv("PYTHONPATH", str(EXAMPLES))  # the learner processes do too
    from own_loop_fsdp import overrides

    config = load_config(None, overrides(tokens=10_000_000))
    hook, state = kill_then_stop(1, down=0.5, steps=40, rounds=6)
    run: list[dict] = []
    out = tmp_path / "run"
    summary = Launcher(config, "decoupled", out, run.append, hooks=[hook]).run()
    sys.modules.pop("own_loop_fsdp", None)
    ups = [r for r in run if r.get("kind") == "learner_up"]
    assert all(r["sharded"] and r["ranks"] == 2 for r in ups) and len(ups) == 3
    recovered = state["recovered"]
    assert recovered["peer"] == 0 and recovered["ranks"] == 2 and recovered["bytes"] > 0
    assert summary["ledger_balanced"]
    evals = [r["loss"] for r in run if r.get("kind") == "eval"]
    assert evals[-1] < evals[0] - 1.5, evals  # 5.55 -> ~2.8
