"""Real processes that fall behind or lose a part: a straggler (the ``slow`` chaos kind, a
SIGSTOP/SIGCONT duty cycle) trains less while its peers go on at their own pace, and a
data-parallel learner (torchrun, gloo on CPU) that loses a rank fails fast as a group, is
restarted, and copies a peer while the other learner keeps training.

Faults are triggered by what the processes report (steps, recoveries), not by timers; rates
are compared within one run, so the tests hold on a slow, shared machine.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

from ddiloco.chaos.plan import ChaosEvent
from ddiloco.config import load_config
from ddiloco.runtime.processes.launcher.fragments import Launcher

BASE = [
    "model='gpt-tiny'",
    "methods=['decoupled']",
    "runtime='processes'",
    "train.learners=2",
    "train.tokens=10000000",
    "train.eval_every=1000000",
    "train.warmup_steps=5",
    "sync.fragments=4",
    "sync.sync_every=8",
    "data.eval_batches=1",
    "processes.detect_seconds=3.0",
    "processes.max_wall_seconds=150",
]


def run(config: Any, out: Path, hook: Any) -> tuple[Launcher, dict[str, Any], list[Any]]:
    """Run decoupled with ``hook`` on every event: the launcher, its summary, the records."""
    records: list[dict[str, Any]] = []
    launcher = Launcher(config, "decoupled", out, records.append, hooks=[hook])
    return launcher, launcher.run(), records


def step_times(records: list[dict[str, Any]], learner: int) -> list[float]:
    return [r["t"] for r in records if r["kind"] == "step" and r["learner"] == learner]


def rate(times: list[float], start: float, end: float) -> float:
    """Steps per second reported in [start, end)."""
    return sum(start <= t < end for t in times) / (end - start)


def test_a_slowed_learner_trains_less_while_its_peer_keeps_its_pace_and_is_still_merged(
    tmp_path,
):
    factor, duration = 4.0, 6.0
    config = load_config(None, [*BASE, "train.batch_size=4"])
    state: dict[str, Any] = {"steps": {0: 0, 1: 0}}

    def hook(launcher: Launcher, r: dict[str, Any]) -> None:
        if r["kind"] == "learner_up":
            state.setdefault("up", launcher.now())
        if r["kind"] != "step":
            return
        state["steps"][r["learner"]] += 1
        if "slowed" not in state and min(state["steps"].values()) >= 80:
            state["slowed"] = launcher.now()
            launcher.play(
                ChaosEvent(
                    at=launcher.now(), kind="slow", learner=1, duration=duration, factor=factor
                )
            )
        if "slowed" in state and r["learner"] == 1 and launcher.now() > state["slowed"] + duration:
            state["after"] = state.get("after", 0) + 1  # steps at full speed again
            if state["after"] == 60:
                launcher.request_stop()

    launcher, summary, records = run(config, tmp_path, hook)

    (chaos,) = [r for r in records if r["kind"] == "chaos"]
    assert chaos["event"] == "slow" and chaos["factor"] == factor and "skipped" not in chaos
    start, end = chaos["t"], chaos["t"] + duration
    t0, t1 = step_times(records, 0), step_times(records, 1)
    before = max(t0[20], t1[20])  # both past their first steps
    during = {m: rate(ts, start, end) for m, ts in ((0, t0), (1, t1))}
    usual = {m: rate(ts, before, start) for m, ts in ((0, t0), (1, t1))}
    # the straggler ran about 1/factor of the time: well under half its own pace and its peer's
    assert during[1] < 0.5 * usual[1], (during, usual)
    assert during[1] < 0.5 * during[0], (during, usual)
    # its peer did not wait for it (on a shared machine it may even go faster)
    assert during[0] > 0.6 * usual[0], (during, usual)
    last = min(t0[-1], t1[-1])  # back to its peer's pace once the slowdown ended
    assert rate(t1, end, last) > 0.5 * rate(t0, end, last), (during, usual)
    done = launcher.learner_done
    assert sorted(done) == [0, 1]
    assert done[1]["tokens"] < done[0]["tokens"]  # it trained fewer tokens over the run
    assert not any(r["kind"] in ("detected", "exited") for r in records)  # slow, never dead
    # it stayed in the job: its answers were merged during the slowdown and after it
    merged = [r["t"] for r in records if r["kind"] == "round" and r["weights"].get("1")]
    assert any(start < t < end for t in merged) and any(t > end for t in merged)
    assert summary["rounds"] > 0 and summary["restarts"] == {} and summary["refused"] == {}


def ranks_of(torchrun: int) -> dict[int, int]:
    """The rank (its RANK variable) -> pid of every worker torchrun ``torchrun`` started."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            if int(stat.rsplit(")", 1)[1].split()[1]) != torchrun:
                continue
            env = (entry / "environ").read_bytes().split(b"\0")
        except (OSError, ValueError):
            continue  # gone meanwhile
        for var in env:
            if var.startswith(b"RANK="):
                out[int(var[5:])] = int(entry.name)
    return out


def test_a_data_parallel_learner_that_loses_a_rank_fails_fast_restarts_and_copies_a_peer(
    tmp_path,
):
    config = load_config(None, [*BASE, "train.batch_size=2", "processes.ranks=2"])
    state: dict[str, Any] = {"steps": {0: 0, 1: 0}}

    def hook(launcher: Launcher, r: dict[str, Any]) -> None:
        if r["kind"] == "recovered" and r["learner"] == 1:
            state["recovered"] = r
        if r["kind"] != "step":
            return
        state["steps"][r["learner"]] += 1
        if "killed" not in state and min(state["steps"].values()) >= 10:
            ranks = ranks_of(launcher.procs["learner-1"].pid)
            assert sorted(ranks) == [0, 1], ranks
            state["ranks"] = ranks
            os.kill(ranks[1], signal.SIGKILL)  # one rank only: not a signal to the group
            state["killed"] = launcher.now()
        if "recovered" in state and r["learner"] == 1:
            state["after"] = state.get("after", 0) + 1
            if state["after"] == 10:
                launcher.request_stop()

    launcher, summary, records = run(config, tmp_path, hook)

    killed, recovered = state["killed"], state["recovered"]
    (exited,) = [r for r in records if r["kind"] == "exited"]
    assert exited["process"] == "learner-1" and exited["code"] != 0
    # the group failed fast: its rank 0 did not sit in a collective waiting for a dead peer
    assert exited["t"] - killed < 15.0, exited["t"] - killed
    assert not any(os.path.exists(f"/proc/{pid}") for pid in state["ranks"].values())
    # a failed group is not a clean leave: the syncer noticed the silence, no bye was said
    assert not any(r["kind"] == "left" for r in records)
    assert any(r["kind"] == "detected" and r["learner"] == 1 for r in records)
    # restarted by the launcher, it copied its peer (not the syncer) and trained on from there
    assert summary["restarts"] == {"learner-1": 1}
    assert recovered["peer"] == 0 and recovered["bytes"] > 0 and recovered["step"] > 0
    after = [
        r for r in records if r["kind"] == "step" and r["learner"] == 1 and r["t"] > recovered["t"]
    ]
    assert after and after[0]["step"] == recovered["step"] + 1
    # the other learner kept training while the group was down and coming back
    assert any(killed < t < recovered["t"] for t in step_times(records, 0))
    done = launcher.learner_done
    assert done[1]["ranks"] == 2 and done[1]["ranks_in_sync"]  # both new ranks got the copy
    assert any(r["kind"] == "round" and r["t"] > recovered["t"] and r["weights"].get("1")
               for r in records)  # fmt: skip  # its answers are merged again
    assert summary["refused"] == {}


def test_a_frozen_data_parallel_learner_stops_all_its_ranks_not_only_torchrun(tmp_path):
    # torchrun starts each rank in a session of its own: a signal to torchrun's process group
    # alone stops no rank (nor kills one, nor slows one)
    config = load_config(None, [*BASE, "train.batch_size=2", "processes.ranks=2"])
    freeze = 2.0
    state: dict[str, Any] = {"steps": {0: 0, 1: 0}}

    def hook(launcher: Launcher, r: dict[str, Any]) -> None:
        if r["kind"] != "step":
            return
        state["steps"][r["learner"]] += 1
        if "frozen" not in state and min(state["steps"].values()) >= 10:
            state["frozen"] = launcher.now()
            launcher.play(ChaosEvent(at=launcher.now(), kind="freeze", learner=1, duration=freeze))
        if "frozen" in state and r["learner"] == 1 and launcher.now() > state["frozen"] + freeze:
            state["after"] = state.get("after", 0) + 1
            if state["after"] == 10:
                launcher.request_stop()

    launcher, summary, records = run(config, tmp_path, hook)

    (chaos,) = [r for r in records if r["kind"] == "chaos"]
    start, end = chaos["t"] + 0.3, chaos["t"] + freeze  # a step under way may still report
    assert not [t for t in step_times(records, 1) if start < t < end]  # rank 0 was stopped
    assert [t for t in step_times(records, 0) if start < t < end]  # its peer was not
    done = launcher.learner_done
    assert done[1]["ranks"] == 2 and done[1]["ranks_in_sync"]  # both ranks went on together
    assert state["after"] >= 10 and summary["restarts"] == {}  # it trained on after the thaw
