"""The lock-step baselines on real processes: Streaming DiLoCo, DiLoCo and Decoupled's K = M
corner run over the real wire, each learner waiting for its merged fragment."""

from __future__ import annotations

from typing import Any

import pytest
from bases import SHORT

from ddiloco.config import load_config
from ddiloco.runtime.processes.launcher.fragments import Launcher

BASE = [*SHORT, "sync.diloco_inner_steps=6", "processes.max_wall_seconds=150"]


def _run(tmp_path, method: str, *extra: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    config = load_config(None, [*BASE, f"methods=['{method}']", *extra])
    records: list[dict[str, Any]] = []
    launcher = Launcher(config, method, tmp_path / method, records.append)
    summary = launcher.run()
    summary["learner_done"] = launcher.learner_done
    return summary, records


@pytest.mark.parametrize("method", ["streaming", "diloco"])
def test_a_lock_step_method_merges_every_learner_in_every_round(tmp_path, method):
    summary, records = _run(tmp_path, method)
    assert summary["method"] == method and summary["tokens"] >= 12000
    rounds = [r for r in records if r["kind"] == "round"]
    assert rounds and summary["rounds"] == len(rounds)
    assert all(r["answers"] == 2 for r in rounds)  # K = M: both learners in every merge
    evals = [r["loss"] for r in records if r["kind"] == "eval"]
    assert evals[-1] < evals[0]
    assert summary["ledger_balanced"]
    waited = [d["idle_seconds"] for d in summary["learner_done"].values()]
    assert len(waited) == 2 and max(waited) > 0  # someone waited for a merged fragment
    if method == "diloco":  # one fragment, the whole model, every diloco_inner_steps steps
        assert {r["fragment"] for r in rounds} == {0}


def test_decoupled_sync_idles_behind_a_straggler_and_still_finishes(tmp_path):
    chaos = "chaos=[{at=2.0, kind='slow', learner=1, duration=0.0, factor=2.0}]"
    summary, _ = _run(tmp_path, "decoupled_sync", chaos)
    assert summary["method"] == "decoupled_sync" and summary["ledger_balanced"]
    done = summary["learner_done"]
    assert done[0]["idle_seconds"] > 0  # the fast learner waited for the slow one
    assert abs(done[0]["step"] - done[1]["step"]) <= 4 + 2  # lock-step: within H + tau


def test_a_lock_step_torchrun_learner_waits_with_all_its_ranks_and_they_stay_identical(tmp_path):
    summary, _ = _run(tmp_path, "diloco", "processes.ranks=2", "train.batch_size=1")
    done = summary["learner_done"]
    assert sorted(done) == [0, 1] and summary["rounds"] > 0 and summary["ledger_balanced"]
    for record in done.values():  # rank 0 waited for merges, and every rank applied them
        assert record["ranks"] == 2 and record["ranks_in_sync"]
    assert max(d["idle_seconds"] for d in done.values()) > 0
