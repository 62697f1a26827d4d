"""Real processes on loopback, with the chaos plan's link faults played by the proxy: a cut
link holds a learner's traffic with the syncer (nothing is lost: it is merged again after),
a slow link caps it at the run's per-learner bandwidth / factor."""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time
from typing import Any

from bases import TINY

from ddiloco.chaos.plan import ChaosEvent
from ddiloco.config import RunConfig, load_config
from ddiloco.runtime.processes.launcher.fragments import Launcher, free_port

BASE = [
    *TINY,
    "train.batch_size=4",
    "train.warmup_steps=5",
    "train.eval_every=1000000",
    "sync.fragments=4",
    "sync.sync_every=8",
    "data.eval_batches=1",
    "processes.detect_seconds=2.0",
    "processes.max_wall_seconds=90.0",
]
CUT_SECONDS = 4.0


def config(*overrides: str) -> RunConfig:
    return load_config(None, [*BASE, *overrides])


def merged_from(record: dict[str, Any], m: int) -> bool:
    return record["kind"] == "round" and bool(record["weights"].get(str(m)))


def test_a_cut_link_holds_a_learners_traffic_and_its_answers_are_merged_again_after(
    tmp_path, launch
):
    state: dict[str, Any] = {"rounds": 0, "after": 0}

    def hook(launcher: Launcher, r: dict[str, Any]) -> None:
        if r["kind"] == "round":
            state["rounds"] += 1
        if "cut" not in state and state["rounds"] >= 3 and merged_from(r, 1):
            state["cut"] = launcher.now()  # both learners are merged: cut learner 1 off
            launcher.play(ChaosEvent(state["cut"], "link_cut", 1, duration=CUT_SECONDS))
        elif "cut" in state and merged_from(r, 1) and r["t"] > state["cut"] + CUT_SECONDS:
            state["after"] += 1
            if state["after"] == 2:
                launcher.request_stop()

    # a proxy with no wire faults: this test triggers the cut itself, not the plan
    cfg = config("train.tokens=10000000", "processes.proxy='drop=0'")
    summary, records = launch(cfg, tmp_path, hook)
    start = state["cut"]
    end = start + CUT_SECONDS
    (chaos,) = [r for r in records if r["kind"] == "chaos"]
    assert chaos["event"] == "link_cut" and "skipped" not in chaos
    # the syncer heard nothing from learner 1 for detect_seconds: it gave it up, mid-cut
    detected = [r["t"] for r in records if r["kind"] == "detected" and r["learner"] == 1]
    assert detected and start < detected[0] < end
    # nothing of learner 1's was merged from then until the cut ended...
    assert not [r for r in records if merged_from(r, 1) and detected[0] <= r["t"] < end]
    # ...while learner 0 was merged as usual, and learner 1 itself kept training
    assert [r for r in records if merged_from(r, 0) and start < r["t"] < end]
    assert [
        r
        for r in records
        if r["kind"] == "step" and r["learner"] == 1 and start + 1.0 < r["t"] < end
    ]
    # after the cut its held frames went through: it registered again and is merged again
    assert [r for r in records if r["kind"] == "joined" and r["learner"] == 1 and r["t"] >= end]
    assert state["after"] >= 2
    proxy = summary["proxy"]
    assert proxy.get("link_cut") == 1 and proxy.get("held", 0) > 0
    assert proxy.get("dropped", 0) == 0  # held, not dropped
    assert not [r for r in records if r["kind"] == "exited"]  # no process died of it


def test_a_slow_link_from_the_plan_gets_a_proxy_starves_the_learner_until_restored(
    tmp_path, launch
):
    state: dict[str, Any] = {"joined": set(), "slow": {0: 0, 1: 0}, "after": {0: 0, 1: 0}}

    def hook(launcher: Launcher, r: dict[str, Any]) -> None:
        if r["kind"] == "joined":
            state["joined"].add(r["learner"])
        if state["joined"] != {0, 1}:
            return  # count from when both are registered (so both could be merged)
        phase = "after" if "restored" in state else "slow"
        for m in (0, 1):
            state[phase][m] += merged_from(r, m)
        if phase == "slow" and state["slow"][0] >= 30:  # back to full speed: factor 1
            state["restored"] = launcher.now()
            launcher.play(ChaosEvent(state["restored"], "link_slow", 1, factor=1.0))
        if state["after"][1] >= 2 and not launcher.stop_requested:
            launcher.request_stop()

    # 0.004 Gbit/s / 25 = 20 KB/s for learner 1, both ways, to the end; no processes.proxy
    plan = "chaos=[{at=0.0, kind='link_slow', learner=1, factor=25.0}]"
    cfg = config("train.tokens=10000000", "network.learner_syncer_gbps=0.004", plan)
    summary, records = launch(cfg, tmp_path, hook)
    chaos = [r for r in records if r["kind"] == "chaos"]
    assert [(r["event"], r["factor"]) for r in chaos] == [("link_slow", 25.0), ("link_slow", 1.0)]
    assert not [r for r in chaos if "skipped" in r]
    # the capped learner's frames crawl: far fewer of its answers make it into merges...
    assert state["slow"][1] < state["slow"][0] / 2, state
    # ...until its link is restored: its backlog goes through and it is merged again
    assert state["after"][1] >= 2
    assert summary["refused"] == {}
    proxy = summary["proxy"]  # the launcher started one for the plan's link fault
    assert proxy.get("link_slow") == 2 and proxy.get("slowed", 0) > 0
    assert not any(proxy.get(k) for k in ("dropped", "duplicated", "corrupted", "truncated"))


def test_a_proxy_under_control_stops_cleanly_on_sigterm():
    """Its control thread blocks reading stdin for ever; a SIGTERM must still end the proxy
    with its counts said and exit 0 (a buffered stdin made the interpreter abort at exit)."""
    env = {**os.environ, "DDILOCO_SECRET": secrets.token_hex(32)}
    port, target = free_port("127.0.0.1"), free_port("127.0.0.1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "ddiloco.runtime.processes.transport.proxy", "--control",
         "--listen", f"127.0.0.1:{port}", "--target", f"127.0.0.1:{target}", "--run-id", "r"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
    )  # fmt: skip
    try:
        assert proc.stdin is not None and proc.stdout is not None
        assert b"proxy_up" in proc.stdout.readline()
        proc.stdin.write(b'{"open": true}\n')
        proc.stdin.flush()
        time.sleep(1.0)  # read: the control thread is blocked reading the next line
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)  # (not communicate: closing stdin would end the reader first)
        out, err = proc.stdout.read(), proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0 and b"Fatal Python error" not in err, err.decode()[-2000:]
    assert b'"kind": "proxy"' in out
