"""Warm spares (``processes.spares``): a killed learner's slot is taken by a spare that has
imported torch and read the data already; it copies a peer and contributes again."""

from __future__ import annotations

from typing import Any

import psutil
from test_processes import config, steps_of

from ddiloco.runtime.processes.launcher.fragments import Launcher


def test_a_killed_learners_slot_is_taken_by_a_warm_spare_that_copies_a_peer(tmp_path, launch):
    state: dict[str, Any] = {"rounds": 0, "ready": 0}

    def hook(launcher: Launcher, r: dict[str, Any]) -> None:
        if r["kind"] == "round":
            state["rounds"] += 1
        ready = state["rounds"] >= 3 and len(launcher.spares.ready) == 1
        if r["kind"] == "step" and r["learner"] == 1 and "killed" not in state and ready:
            state["killed"] = launcher.play_crash(1, down_seconds=0.2)
        if r["kind"] == "recovered" and r["learner"] == 1:
            state["recovered"] = r
        if "recovered" in state and r["kind"] == "step" and r["learner"] == 1:
            state["after"] = state.get("after", 0) + 1
            if state["after"] == 40:
                launcher.request_stop()

    summary, records = launch(config("train.tokens=10000000", "processes.spares=1"), tmp_path, hook)
    spares = [r for r in records if r["kind"] == "started" and r["process"].startswith("spare")]
    first_spare = spares[0]
    took = [r for r in records if r["kind"] == "started" and r.get("spare")]
    assert len(took) == 1 and took[0]["process"] == "learner-1"
    assert took[0]["pid"] == first_spare["pid"]  # the spare's own process became learner 1
    assert took[0]["t"] - state["killed"] < 1.0  # no fresh interpreter in between
    recovered = state["recovered"]
    assert recovered["peer"] == 0 and recovered["step"] > 0  # it copied the live peer
    after = [r for r in steps_of(records, 1) if r["t"] > recovered["t"]]
    assert after and after[0]["step"] == recovered["step"] + 1
    assert any(r["kind"] == "round" and r["t"] > recovered["t"] and r["weights"].get("1")
               for r in records)  # fmt: skip  # its answers are merged again
    assert summary["ledger_balanced"] and summary["ledger_errors"] == 0
    # no spare failed, and no process of the run (spares included) is left running
    assert not [r for r in records if r["kind"] == "exited" and r["process"].startswith("spare")]
    started = [r["pid"] for r in records if r["kind"] == "started"]
    assert not [pid for pid in started if running(pid)]


def running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
