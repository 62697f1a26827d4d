"""Sharded learners (``train.parallel = "fsdp"``): two learners, each two torchrun ranks under
FSDP2 over gloo, real sockets. Each rank holds half of every parameter and answers its rows
of each fragment; the learner is still one learner to the syncer (one ledger line, one
weight). A learner SIGKILLed mid-run is restarted by the launcher and each of its ranks copies
the same rank of its peer: parameters, optimizer moments, step, data position."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from bases import TINY
from hooks import kill_then_stop
from rundir import argv, records
from test_processes_resume import kill_everything

from ddiloco.cli import main
from ddiloco.config import load_config

SHARDED = [
    "train.parallel='fsdp'",
    "processes.ranks=2",
    "train.batch_size=2",
    "train.tokens=10000000",
    "train.eval_every=6000",
    "sync.fragments=4",
    "sync.sync_every=8",
    "data.eval_batches=2",
]


def test_two_sharded_learners_train_and_one_killed_comes_back(tmp_path, launch):
    config = load_config(
        None,
        # (its blocks recomputed in backward: activation checkpointing under FSDP2)
        [*TINY, *SHARDED, "processes.max_wall_seconds=200", "train.activation_checkpointing=true"],
    )
    hook, state = kill_then_stop(1, down=0.5, steps=60, rounds=6)
    seen = {}

    def watch(launcher, r):
        seen["launcher"] = launcher
        hook(launcher, r)

    summary, records = launch(config, tmp_path, watch)
    ups = [r for r in records if r["kind"] == "learner_up"]
    assert {r["learner"] for r in ups} == {0, 1} and len(ups) >= 3  # learner 1 came up twice
    assert all(r["sharded"] and r["ranks"] == 2 and len(r["peer"].split()) == 2 for r in ups)
    recovered = state["recovered"]  # rank r copied rank r of learner 0, both ranks at once
    assert recovered["peer"] == 0 and recovered["ranks"] == 2 and recovered["bytes"] > 0
    assert recovered["step"] > 0
    after = [r for r in records if r["kind"] == "round" and r["t"] > recovered["t"]]
    assert any(r["weights"].get("1") for r in after)  # its answers merge again
    assert summary["refused"] == {}
    assert summary["ledger_balanced"] and summary["ledger_errors"] == 0, ledger_of(summary)
    evals = [r["loss"] for r in records if r["kind"] == "eval"]
    assert len(evals) >= 2 and evals[-1] < evals[0] - 1.0, evals  # it learned, sharded
    # every rank received its own rows of the merged fragments on its own link (payload
    # bytes: half of each fragment each), and the ranks moved their rows together
    for m, (rank0, rank1) in summary["learner_bytes_received"].items():
        assert rank1 > 0 and 0.5 * rank0 <= rank1 <= 1.5 * rank0, (m, rank0, rank1)
    done = seen["launcher"].learner_done  # (each learner's last life's report)
    assert sorted(done) == [0, 1] and all(r["ranks_in_sync"] for r in done.values()), done


def test_an_answer_whose_part_is_lost_on_the_wire_is_never_merged_half(tmp_path, launch):
    """Every rank sends its part of an answer on its own link; the fault proxy drops a share
    of the answer parts on the rank 1 links: an answer missing a part is dropped whole
    (counted, said), the others are put together and merged, and the run trains and balances."""
    config = load_config(
        None,
        [*TINY, *SHARDED, "chaos=[]", "train.tokens=24000", "processes.detect_seconds=2.0",
         "processes.proxy='drop_parts=0.3'", "processes.max_wall_seconds=150"],
    )  # fmt: skip

    summary, records = launch(config, tmp_path, lambda launcher, r: None)
    counts = summary["service"]
    assert summary["proxy"]["dropped_parts"] > 0, summary["proxy"]
    # (each answer whose part was dropped is dropped whole: after its bound, or at the end)
    incomplete, assembled = counts.get("answers_incomplete", 0), counts.get("answers_assembled", 0)
    assert incomplete > 0 and assembled > 0, (counts, summary["proxy"])
    dropped = [r for r in records if r["kind"] == "drop" and r["verdict"] == "incomplete"]
    assert dropped  # rank 0 was told, so it keeps nothing pending for ever
    merged = sum(len(r["weights"]) for r in records if r["kind"] == "round")
    assert 0 < merged <= counts["answers_assembled"]  # only whole answers were merged
    from_ = {m for r in records if r["kind"] == "round" for m, w in r["weights"].items() if w}
    assert from_ == {"0", "1"}  # both learners' whole answers merged
    assert summary["ledger_balanced"] and summary["ledger_errors"] == 0, ledger_of(summary)
    evals = [r["loss"] for r in records if r["kind"] == "eval"]
    assert evals[-1] < evals[0] - 1.0, evals


def ledger_of(summary: dict) -> str:
    """What a failed balance check shows (a string: pytest shortens a dict's repr)."""
    keys = ("ledger", "tokens", "answers")
    return json.dumps({k: v for k, v in summary.items() if k.startswith(keys)}, default=str)


def rank_saves(run: Path) -> dict[int, int]:
    """learner -> the newest step both its ranks saved a local checkpoint of."""
    found: dict[int, int] = {}
    for m in (0, 1):
        home = run / "processes" / "learners" / f"learner-{m}"
        steps = [{int(p.stem.split("-")[1]) for p in (home / f"rank-{r}").glob("state-*.bin")}
                 for r in (0, 1)]  # fmt: skip
        if steps[0] & steps[1]:
            found[m] = max(steps[0] & steps[1])
    return found


def test_sharded_learners_killed_whole_resume_from_their_ranks_saves(tmp_path):
    run = tmp_path / "run"
    sets = [*TINY, *SHARDED, "chaos=[]", "processes.learner_checkpoint_every=1.0",
            "processes.max_wall_seconds=150"]  # fmt: skip
    cmd = [sys.executable, "-m", "ddiloco.cli", "train", "--quiet", "--out", str(run)]
    first = subprocess.Popen([*cmd, *argv(*sets)], stdout=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # both learners' ranks saved after some merges
            time.sleep(0.5)
            held = rank_saves(run)
            if len(held) == 2 and min(held.values()) >= 24:
                break
        else:
            pytest.fail("the sharded learners never saved a local checkpoint on both ranks")
    finally:
        kill_everything(first, run)
    before = len(records(run))
    held = rank_saves(run)
    trained = sum(1 for r in records(run) if r["kind"] == "step") * 2 * 2 * 64
    budget = f"train.tokens={trained + 30 * 2 * 2 * 64 * 2}"
    assert main(["train", "--quiet", "--resume", str(run), *argv(budget)]) == 0
    new = records(run)[before:]
    back = {r["learner"]: r for r in new if r["kind"] == "recovered"}
    for m in (0, 1):  # each rank from its own file, all at one step
        assert back[m]["source"] == "local" and back[m]["ranks"] == 2, back
        assert back[m]["step"] >= held[m]
        first_step = min(r["step"] for r in new if r["kind"] == "step" and r["learner"] == m)
        assert first_step == back[m]["step"] + 1  # the schedule goes on from there
    summary = json.loads((run / "summary.json").read_text())
    assert summary["ledger_balanced"] and summary["tokens"] >= trained
