"""Compute scavenging with real processes: a learner joins a running job, copies a peer,
contributes, and leaves cleanly; nobody else stops."""

from __future__ import annotations

from typing import Any

from bases import TINY, UNTIL_STOPPED

from ddiloco.chaos.plan import ChaosEvent
from ddiloco.config import load_config
from ddiloco.runtime.processes.launcher.fragments import Launcher


def test_a_scavenged_learner_joins_copies_a_peer_contributes_and_leaves_cleanly(tmp_path):
    config = load_config(
        None,
        [
            *TINY,
            *UNTIL_STOPPED,
            "train.scavenged=1",
            "train.batch_size=4",
            "sync.fragments=4",
            "sync.sync_every=8",
            "processes.max_wall_seconds=150",
        ],
    )
    state: dict[str, Any] = {"steps0": 0, "steps2": 0}

    def hook(launcher: Launcher, r: dict[str, Any]) -> None:
        if r["kind"] != "step":
            if r["kind"] == "left" and r["learner"] == 2:
                state["left_at"] = state["steps0"]
            return
        if r["learner"] == 0:
            state["steps0"] += 1
            if state["steps0"] == 20:
                launcher.play(ChaosEvent(at=launcher.now(), kind="join", learner=2))
            if "left_at" in state and state["steps0"] == state["left_at"] + 10:
                launcher.request_stop()
        if r["learner"] == 2:
            state["steps2"] += 1
            if state["steps2"] == 30:
                launcher.play(ChaosEvent(at=launcher.now(), kind="leave", learner=2))

    records: list[dict[str, Any]] = []
    launcher = Launcher(config, "decoupled", tmp_path, records.append)
    launcher.hooks.append(hook)
    summary = launcher.run()
    (recovered,) = [r for r in records if r["kind"] == "recovered" and r["learner"] == 2]
    assert recovered["peer"] in (0, 1)  # it copied a running peer, not the syncer
    joined_at = recovered["t"]
    (left,) = [r for r in records if r["kind"] == "left" and r["learner"] == 2]
    assert any(r["kind"] == "round" and joined_at < r["t"] <= left["t"] and r["weights"].get("2")
               for r in records)  # fmt: skip  # its work was merged
    assert launcher.procs["learner-2"].returncode == 0 and summary["restarts"] == {}
    steps0 = [r["t"] for r in records if r["kind"] == "step" and r["learner"] == 0]
    assert any(t > left["t"] for t in steps0)  # the others went on after it left
    # a clean leave: the syncer was told, it never had to notice a silence
    assert not any(r["kind"] == "detected" and r["learner"] == 2 for r in records)
    # nothing refused but the wire's one known race: a shared-memory slot reused before it
    # was read ("expired", logged at INFO as a race; transport/wire.py)
    assert {k: v for k, v in summary["refused"].items() if k != "expired"} == {}


def test_a_preempted_learner_says_goodbye_and_is_back_after_its_duration_from_a_peer(tmp_path):
    config = load_config(
        None,
        [
            *TINY,
            *UNTIL_STOPPED,
            "processes.max_wall_seconds=150",
        ],
    )
    state: dict[str, Any] = {"steps0": 0, "steps1": 0}

    def hook(launcher: Launcher, r: dict[str, Any]) -> None:
        if r["kind"] == "recovered" and r["learner"] == 1:
            state["back"] = state["steps0"]
        if r["kind"] != "step":
            return
        state[f"steps{r['learner']}"] += 1
        # both training (a process still starting has no SIGTERM handler: it would just die)
        if "preempted" not in state and min(state["steps0"], state["steps1"]) >= 10:
            state["preempted"] = True
            launcher.play(ChaosEvent(launcher.now(), "preempt", learner=1, duration=2.0))
        if r["learner"] == 0 and "back" in state and state["steps0"] == state["back"] + 10:
            launcher.request_stop()

    records: list[dict[str, Any]] = []
    launcher = Launcher(config, "decoupled", tmp_path, records.append, hooks=[hook])
    summary = launcher.run()
    (chaos,) = [r for r in records if r["kind"] == "chaos"]
    assert chaos["event"] == "preempt" and "skipped" not in chaos
    (left,) = [r for r in records if r["kind"] == "left" and r["learner"] == 1]
    (recovered,) = [r for r in records if r["kind"] == "recovered" and r["learner"] == 1]
    assert recovered["peer"] == 0 and recovered["t"] >= chaos["t"] + 2.0  # its duration, then
    assert left["t"] < recovered["t"]
    assert not any(r["kind"] == "detected" and r["learner"] == 1 for r in records)  # it said bye
    assert any(
        r["kind"] == "step" and r["learner"] == 1 and r["t"] > recovered["t"] for r in records
    )
    assert summary["restarts"] == {} and summary["refused"] == {}
