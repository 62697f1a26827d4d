"""Warm spares (``processes.spares``): a killed learner's slot is taken by a spare that has
imported torch and read the data already; it copies a peer and contributes again."""

from __future__ import annotations

import psutil
from hooks import kill_then_stop
from test_processes import config, steps_of


def test_a_killed_learners_slot_is_taken_by_a_warm_spare_that_copies_a_peer(tmp_path, launch):
    hook, state = kill_then_stop(
        1, down=0.2, ready=lambda launcher: len(launcher.spares.ready) == 1
    )
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
