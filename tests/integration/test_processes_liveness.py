"""Liveness does not depend on how long a step takes: learners whose every step outlasts
``processes.detect_seconds`` (a big model, a slow device) are never given up, and one that is
really stopped (SIGSTOP: the ``freeze`` chaos) is still detected within the detection time.

The model sleeps in its forward (the GIL released, as torch's kernels release it) and spins
in Python for part of each step (the GIL held, handed over only at Python's switch interval),
so both ways a training thread can keep the CPU are covered.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

from bases import TINY

from ddiloco.chaos.plan import ChaosEvent
from ddiloco.config import load_config
from ddiloco.runtime.processes.launcher.fragments import Launcher

DETECT = 2.0
STEP_SECONDS = DETECT + 1.0  # every step lasts longer than the detection time

SLOW_MODELS = f"""
import time

from ddiloco.models.gpt import GPT, GPTConfig


class Slow(GPT):
    def forward(self, idx, targets=None):
        if self.training and torch_grad():
            end = time.perf_counter() + 0.4
            while time.perf_counter() < end:  # holds the GIL (yields it every 5 ms)
                pass
            time.sleep({STEP_SECONDS} - 0.4)  # releases it, as a long kernel does
        return super().forward(idx, targets)


def torch_grad():
    import torch

    return torch.is_grad_enabled()


def slow():
    return Slow(GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=64))
"""

BASE = [
    *TINY,
    "model='slowmodels:slow'",
    "train.batch_size=2",
    "train.seq_len=64",
    "train.tokens=10000000",
    "train.eval_every=10000000",
    "train.warmup_steps=2",
    "sync.fragments=2",
    "sync.sync_every=2",
    "data.eval_batches=1",
    f"processes.detect_seconds={DETECT}",
    "processes.final_round_seconds=0",
    "processes.max_wall_seconds=200",
]


def run(tmp_path: Path, monkeypatch: Any, hook: Any) -> tuple[Launcher, dict[str, Any], list[Any]]:
    (tmp_path / "slowmodels.py").write_text(SLOW_MODELS)
    monkeypatch.syspath_prepend(str(tmp_path))  # the launcher's preflight imports it here,
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))  # the processes there
    records: list[dict[str, Any]] = []
    config = load_config(None, BASE)
    launcher = Launcher(config, "decoupled", tmp_path / "run", records.append, hooks=[hook])
    return launcher, launcher.run(), records


def steps_of(records: list[dict[str, Any]], m: int) -> list[dict[str, Any]]:
    return [r for r in records if r["kind"] == "step" and r["learner"] == m]


def test_learners_whose_steps_outlast_the_detection_time_are_never_given_up(tmp_path, monkeypatch):
    steps = {0: 0, 1: 0}

    def hook(launcher: Launcher, r: dict[str, Any]) -> None:
        if r["kind"] == "step":
            steps[r["learner"]] += 1
            if min(steps.values()) >= 8:
                launcher.request_stop()

    launcher, summary, records = run(tmp_path, monkeypatch, hook)

    # each step took longer than the syncer waits for a silent learner
    times = [r["t"] for r in steps_of(records, 0)]
    assert min(b - a for a, b in itertools.pairwise(times)) > DETECT
    assert not [r for r in records if r["kind"] == "detected"]
    assert summary["learner_uptime"] >= 0.95, summary["learner_uptime"]
    assert summary["tokens_wasted"].get("crash", 0) == 0, summary["tokens_wasted"]
    assert summary["rounds"] > 0 and summary["restarts"] == {}
    done = launcher.learner_done
    assert sorted(done) == [0, 1], done
    # neither end thought the other silent, not even at the end (the syncer closes after its
    # stop while the learners finish their step)
    assert not any(d["reconnects"] for d in done.values()), done


def test_a_frozen_slow_learner_is_still_detected_within_the_detection_time(tmp_path, monkeypatch):
    state: dict[str, Any] = {"steps": {0: 0, 1: 0}}
    freeze = 2 * STEP_SECONDS + DETECT

    def hook(launcher: Launcher, r: dict[str, Any]) -> None:
        if r["kind"] == "step":
            state["steps"][r["learner"]] += 1
            if "frozen" not in state and min(state["steps"].values()) >= 3:
                state["frozen"] = launcher.now()
                launcher.play(
                    ChaosEvent(at=launcher.now(), kind="freeze", learner=1, duration=freeze)
                )
            if "frozen" in state and launcher.now() > state["frozen"] + freeze + 3 * STEP_SECONDS:
                launcher.request_stop()

    _, summary, records = run(tmp_path, monkeypatch, hook)

    (chaos,) = [r for r in records if r["kind"] == "chaos"]
    detected = [r for r in records if r["kind"] == "detected"]
    assert [r["learner"] for r in detected] == [1], detected  # the frozen one, and only it
    # within the detection time (+ one liveness check, + the beat the learner last sent)
    assert detected[0]["t"] - chaos["t"] <= DETECT + 1.5, (detected[0]["t"], chaos["t"])
    # thawed, it said hello again and trained on; nothing crashed
    assert [s for s in steps_of(records, 1) if s["t"] > chaos["t"] + freeze]
    assert summary["restarts"] == {}
