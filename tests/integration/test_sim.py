"""The simulated clock end to end: real training, virtual time, chaos, determinism."""

from __future__ import annotations

import json
from typing import Any

import pytest

from ddiloco import train
from ddiloco.commands.train import render
from ddiloco.config import RunConfig, load_config
from ddiloco.data.corpus import eval_batches, split_corpus
from ddiloco.report.summary import REQUIRED, loss_at
from ddiloco.runtime.run import RunSetup
from ddiloco.runtime.sim.engine import FragmentSim

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
    setup = RunSetup(config, "decoupled", splits_given=splits, evals_given=evals)
    summary = FragmentSim(setup, records.append).run()
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


def test_a_preempted_learner_leaves_at_once_and_is_back_after_its_duration(splits):
    """Reclaimed with notice: no detection wait (it said goodbye), down for its duration
    (lost capacity, unlike a scavenged slot's leave), back from a peer."""
    preempt = "chaos=[{at=4.0, kind='preempt', learner=1, duration=6.0}]"
    summary, records = _run(splits, preempt)
    crash, _ = _run(splits, preempt.replace("preempt", "crash"))
    assert not [r for r in records if r["kind"] == "detected"]
    steps = [r["t"] for r in records if r["kind"] == "step" and r["learner"] == 1]
    assert not [t for t in steps if 4.0 < t < 10.0] and max(steps) > 10.0
    assert [r["peer"] for r in records if r["kind"] == "recovered"] == [0]
    assert summary["tokens_wasted"].get("crash", 0) == 0 and summary["ledger_balanced"]
    assert summary["goodput"] < 1.0 and crash["goodput"] < 1.0


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


def test_a_node_loss_is_a_crash_on_the_simulated_clock(splits):
    plan = "chaos=[{at=3.0, kind='%s', learner=2, duration=1.0}]"
    crash = _run(splits, plan % "crash")
    lost = _run(splits, plan % "node_loss")
    renamed = [{**r, "event": "crash"} if r["kind"] == "chaos" else r for r in lost[1]]
    assert renamed == crash[1]  # (a learner's chips are its node: the same run, bit for bit)
    assert any(r["kind"] == "recovered" and r["learner"] == 2 for r in lost[1])


def test_train_writes_the_run_directory(tmp_path):
    config = load_config("configs/smoke.toml", ["train.tokens=6000", "train.eval_every=3000"])
    summaries = train(config, tmp_path, quiet=True)
    assert [s["method"] for s in summaries] == ["decoupled", "data_parallel"]
    summary = json.loads((tmp_path / "summary.json").read_text())
    for key in REQUIRED:  # the one summary schema (report/summary.py)
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
        "train_loss.png",
        "timeline.png",
        "bytes.png",
    ):
        assert (tmp_path / name).stat().st_size > 0, name
    assert load_config(tmp_path / "config.toml") == config
    # equal time next to equal tokens: data-parallel read when decoupled finished
    first, dp = summary, summary["methods"]["data_parallel"]
    assert first["eval_loss_equal_time"] == first["eval_loss"]
    assert dp["equal_time_seconds"] == first["virtual_seconds"]
    curve = [
        (r["t"], r["loss"])
        for r in map(json.loads, (tmp_path / "metrics.jsonl").open())
        if r["kind"] == "eval" and r["method"] == "data_parallel"
    ]
    assert dp["eval_loss_equal_time"] == pytest.approx(loss_at(curve, first["virtual_seconds"]))
    assert "at " + f"{first['virtual_seconds']:.0f} virtual s" in render(summaries)
    plan = json.loads((tmp_path / "chaos_plan.json").read_text())
    assert plan == [{"at": 12.0, "kind": "crash", "learner": 1, "duration": 6.0, "factor": 1.0}]
    from ddiloco.cli import main

    assert main(["compare", str(tmp_path), "--out", str(tmp_path / "cmp.png")]) == 0
    assert (tmp_path / "cmp.png").stat().st_size > 0


def _run_method(splits, method: str, *overrides: str):
    from ddiloco.launch import run_method

    config = load_config(None, [*BASE, *overrides])
    records: list[dict[str, Any]] = []
    summary = run_method(
        config, method, splits, eval_batches(splits.eval, 64, 4, 1), records.append
    )
    return summary, records


def test_a_long_freeze_is_detected_and_the_learner_rejoins_with_its_state(splits):
    summary, records = _run(splits, "chaos=[{at=3.0, kind='freeze', learner=2, duration=5.0}]")
    assert [r["learner"] for r in records if r["kind"] == "detected"] == [2]
    frozen = [r for r in records if r["kind"] == "step" and r["learner"] == 2 and 3.2 < r["t"] < 8]
    assert frozen == []
    assert any(r["kind"] == "step" and r["learner"] == 2 and r["t"] > 8 for r in records)
    assert "crash" not in summary["tokens_wasted"]  # a freeze loses no state
    assert summary["ledger_balanced"]


def test_scavenged_learner_joins_from_a_peer_and_leaves(splits):
    summary, records = _run(
        splits,
        "train.scavenged=1",
        "train.learners=2",
        "chaos=[{at=2.0, kind='join', learner=2}, {at=6.0, kind='leave', learner=2}]",
    )
    assert [(r["learner"], r["peer"]) for r in records if r["kind"] == "recovered"] == [(2, 0)]
    steps = [r["t"] for r in records if r["kind"] == "step" and r["learner"] == 2]
    assert steps and min(steps) > 2.0 and max(steps) < 6.0
    assert summary["ledger_balanced"]


def test_link_cut_delays_but_loses_nothing(splits):
    summary, _ = _run(splits, "chaos=[{at=2.0, kind='link_cut', learner=0, duration=4.0}]")
    assert summary["ledger_balanced"]
    assert "lost_in_flight" not in summary["tokens_wasted"]


def test_streaming_is_lock_step_with_every_learner(splits):
    summary, records = _run_method(splits, "streaming", "hardware.speed=[1.0, 1.0, 1.5]")
    rounds = [r for r in records if r["kind"] == "round"]
    assert rounds and all(r["answers"] >= 3 for r in rounds[1:])  # K = M
    assert summary["idle_seconds"] > 0  # the fast learners waited for the slow one
    assert summary["method"] == "streaming" and summary["ledger_balanced"]


def test_decoupled_sync_is_the_synchronous_corner_and_idles_behind_a_straggler(splits):
    shape = ("hardware.speed=[1.0, 1.0, 1.5]",)
    sync, records = _run_method(splits, "decoupled_sync", *shape)
    free, _ = _run_method(splits, "decoupled", *shape, "sync.quorum=3", "sync.grace=false")
    rounds = [r for r in records if r["kind"] == "round"]
    assert rounds and all(r["answers"] >= 3 for r in rounds[1:])  # K = M, RDA as configured
    assert sync["idle_seconds"] > 0 and sync["goodput"] < free["goodput"]
    assert free["idle_seconds"] == 0  # the same K without lock-step never waits
    assert sync["method"] == "decoupled_sync" and sync["ledger_balanced"]


def test_diloco_syncs_the_whole_model_at_once(splits):
    summary, records = _run_method(splits, "diloco", "sync.diloco_inner_steps=5")
    assert summary["plan"]["fragments"] == 1
    assert {r["fragment"] for r in records if r["kind"] == "round"} == {0}


def test_data_parallel_rolls_back_and_elastic_shrinks(splits):
    chaos = "chaos=[{at=5.0, kind='crash', learner=1, duration=10.0}]"
    stiff, stiff_records = _run_method(
        splits, "data_parallel", chaos, "data_parallel.checkpoint_every=100"
    )
    elastic, elastic_records = _run_method(splits, "elastic_dp", chaos)
    assert stiff["tokens_wasted"]["rollback"] > 0 and stiff["uptime"] < 1.0
    assert any(r["kind"] == "rollback" for r in stiff_records)
    assert elastic["tokens_wasted"] == {}
    pauses = [r["why"] for r in elastic_records if r["kind"] == "pause"]
    assert "downscale" in pauses and "upscale" in pauses
    assert elastic["goodput"] > stiff["goodput"]


def test_replaying_an_expanded_plan_reproduces_the_run(tmp_path):
    overrides = [
        "train.tokens=5000",
        "train.eval_every=2500",
        "methods=['decoupled']",
        "chaos_gen.mtbi_hours=0.002",
        "chaos_gen.recovery_seconds=3.0",
    ]
    first = load_config("configs/smoke.toml", overrides)
    train(first, tmp_path / "a", quiet=True)
    plan = json.loads((tmp_path / "a" / "chaos_plan.json").read_text())
    assert any(e["kind"] == "crash" for e in plan[1:])  # generated, beyond the explicit one
    replay = load_config(
        "configs/smoke.toml",
        [*overrides[:3], "chaos=[]", f"chaos_plan='{tmp_path / 'a' / 'chaos_plan.json'}'"],
    )
    train(replay, tmp_path / "b", quiet=True)
    a = (tmp_path / "a" / "metrics.jsonl").read_text()
    assert a == (tmp_path / "b" / "metrics.jsonl").read_text()


def test_lock_step_survives_a_crash_without_stalling(splits):
    """A newcomer owes the rounds that opened while it was away; without answering them,
    the others (waiting for those rounds) and it (waiting for its own) deadlock."""
    shape = ("sync.fragments=6", "sync.sync_every=6", "train.tokens=12000")
    calm, _ = _run_method(splits, "streaming", *shape)
    summary, records = _run_method(
        splits, "streaming", *shape, "chaos=[{at=5.0, kind='crash', learner=1, duration=3.0}]"
    )
    assert summary["tokens"] >= 12000 and summary["ledger_balanced"]
    assert summary["virtual_seconds"] < calm["virtual_seconds"] + 3.0 + 10.0
    assert any(r["kind"] == "step" and r["learner"] == 1 and r["t"] > 8.0 for r in records)


def test_a_virtual_time_budget_stops_every_method(splits):
    for method in ("decoupled", "data_parallel"):
        summary, _ = _run_method(
            splits, method, "train.tokens=10000000", "train.max_virtual_seconds=6"
        )
        assert 6.0 <= summary["virtual_seconds"] < 6.0 + 3.0, method
        assert summary["tokens"] < 10_000_000
