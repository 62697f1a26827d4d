"""The simulated clock end to end: real training, virtual time, chaos, determinism."""

from __future__ import annotations

import json
from typing import Any

import pytest

from ddiloco.commands.train import train
from ddiloco.config import RunConfig, load_config
from ddiloco.data.corpus import eval_batches, split_corpus
from ddiloco.runtime.sim.engine import FragmentSim
from ddiloco.strategies import decoupled

BASE = [
    "model='gpt-tiny'",
    "methods=['decoupled']",
    "train.learners=3",
    "train.batch_size=2",
    "train.tokens=9000",
    "train.eval_every=4000",
    "sync.fragments=3",
    "sync.sync_every=3",
    "data.eval_batches=1",
]


@pytest.fixture(scope="module")
def splits():
    return split_corpus("shakespeare", 3)


def _run(splits, *overrides: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    config: RunConfig = load_config(None, [*BASE, *overrides])
    records: list[dict[str, Any]] = []
    evals = eval_batches(splits.eval, 64, 4, 1)
    summary = FragmentSim(config, decoupled(config), splits, evals, records.append).run()
    return summary, records


def test_same_seed_same_run_bit_for_bit(splits):
    chaos = "chaos=[{at=4.0, kind='crash', learner=1, duration=3.0}]"
    a = _run(splits, chaos)
    b = _run(splits, chaos)
    assert json.dumps(a[1]) == json.dumps(b[1])
    assert a[0] == b[0]
    c = _run(splits, chaos, "seed=1")
    assert json.dumps(c[1]) != json.dumps(a[1])


def test_crash_never_stops_the_others_and_the_ledger_balances(splits):
    summary, records = _run(splits, "chaos=[{at=4.0, kind='crash', learner=1, duration=6.0}]")
    assert summary["ledger_balanced"]
    total = summary["tokens_merged"] + sum(summary["tokens_wasted"].values())
    assert total == pytest.approx(summary["tokens"])
    down = [r for r in records if r["kind"] == "step" and 4.0 < r["t"] < 10.0]
    assert {r["learner"] for r in down} == {0, 2}  # the others kept stepping
    assert [r["peer"] for r in records if r["kind"] == "recovered"] == [0]
    after = [r for r in records if r["kind"] == "step" and r["learner"] == 1 and r["t"] > 10.0]
    assert after, "the crashed learner came back and trained"
    assert summary["uptime"] == pytest.approx(1.0) and summary["goodput"] < 1.0


def test_crash_mid_push_loses_only_that_answer(splits):
    # a slow link: every answer is on the wire for a long time, so the crash cuts one
    summary, _ = _run(
        splits,
        "network.learner_syncer_gbps=0.0002",
        "chaos=[{at=6.5, kind='crash', learner=0, duration=2.0}]",
    )
    assert summary["tokens_wasted"].get("lost_in_flight", 0) > 0
    assert summary["ledger_balanced"]


def test_crash_mid_recovery_retries_from_another_peer(splits):
    summary, records = _run(
        splits,
        "network.learner_learner_gbps=0.003",  # copying a peer takes ~4 s
        "chaos=[{at=3.0, kind='crash', learner=2, duration=1.0},"
        " {at=5.0, kind='crash', learner=0, duration=100.0}]",
    )
    recovered = [r for r in records if r["kind"] == "recovered"]
    assert recovered and recovered[0]["learner"] == 2 and recovered[0]["peer"] == 1
    assert summary["ledger_balanced"]


def test_train_writes_the_run_directory(tmp_path):
    config = load_config("configs/smoke.toml", ["train.tokens=6000", "train.eval_every=3000"])
    summaries = train(config, tmp_path, quiet=True)
    assert [s["method"] for s in summaries] == ["decoupled", "data_parallel"]
    summary = json.loads((tmp_path / "summary.json").read_text())
    for key in (
        "method",
        "eval_loss",
        "tokens",
        "tokens_merged",
        "tokens_wasted",
        "goodput",
        "uptime",
        "virtual_seconds",
        "bytes_sent",
        "bytes_received",
    ):
        assert key in summary, key
    assert summary["method"] == "decoupled" and set(summary["methods"]) == {
        "decoupled",
        "data_parallel",
    }
    for name in (
        "metrics.jsonl",
        "chaos_plan.json",
        "config.toml",
        "eval_loss.png",
        "timeline.png",
        "bytes.png",
    ):
        assert (tmp_path / name).stat().st_size > 0, name
    assert load_config(tmp_path / "config.toml") == config
    plan = json.loads((tmp_path / "chaos_plan.json").read_text())
    assert plan == [{"at": 12.0, "kind": "crash", "learner": 1, "duration": 6.0, "factor": 1.0}]
