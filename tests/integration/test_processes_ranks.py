"""A learner that is itself data-parallel (torchrun, gloo on CPU): rank 0 talks to the
syncer, every rank trains, and the ranks stay identical through merges."""

from __future__ import annotations

from typing import Any

import pytest
from bases import TINY

from ddiloco.config import load_config
from ddiloco.runtime.processes.launcher.fragments import Launcher


# overwrite with ranks: test_processes_methods.py, test_processes_stragglers.py
@pytest.mark.parametrize("apply", ["carry"])
def test_a_torchrun_learner_keeps_its_ranks_identical_and_counts_their_tokens(tmp_path, apply):
    config = load_config(
        None,
        [
            *TINY,
            "train.batch_size=2",
            "train.tokens=16000",
            "train.eval_every=8000",
            "sync.fragments=4",
            "sync.sync_every=8",
            "data.eval_batches=1",
            "processes.ranks=2",
            "processes.max_wall_seconds=170",
            f"sync.apply='{apply}'",  # carry: every rank takes rank 0's snapshots
        ],
    )
    records: list[dict[str, Any]] = []
    launcher = Launcher(config, "decoupled", tmp_path, records.append)
    summary = launcher.run()
    done = launcher.learner_done
    assert sorted(done) == [0, 1]
    # a learner up a sync period after the other starts from its state (caught_up), not at 0
    start = {m: 0 for m in done}
    start.update({r["learner"]: r["step"] for r in records if r["kind"] == "caught_up"})
    for m, record in done.items():
        assert record["ranks"] == 2 and record["ranks_in_sync"]  # merges reached every rank
        steps = record["step"] - start[m]
        assert record["tokens"] == 2 * 2 * 64 * steps  # both ranks' batches count
    assert summary["rounds"] > 0 and summary["tokens"] >= 16000
    assert {r["learner"] for r in records if r["kind"] == "step"} == {0, 1}  # rank 0 only speaks
    per_learner = {
        m: sum(1 for r in records if r["kind"] == "step" and r["learner"] == m) for m in (0, 1)
    }
    assert all(per_learner[m] == done[m]["step"] - start[m] for m in (0, 1))  # one per step
