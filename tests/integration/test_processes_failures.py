"""Failures of a real-processes run end in seconds with a named cause, never in a silent
crash loop: a run that cannot train is refused before any process starts, a process that
keeps failing (or fails fatally, exit 78) is given up with its log's tail, and SIGINT or
SIGTERM to ``ddiloco train`` stops the run cleanly, summary written, nothing left behind.

Most tests stand cheap ``python -c`` programs in for the syncer and the learners (through
the launcher's own spawn), so what is tested is the supervision, not the training.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
from bases import SMALL

from ddiloco import train
from ddiloco.config import load_config, to_toml
from ddiloco.errors import FATAL_EXIT, DDiLoCoError
from ddiloco.runtime.processes.launcher import fragments as launcher_module
from ddiloco.runtime.processes.launcher.fragments import SYNCER, Launcher
from ddiloco.runtime.processes.launcher.supervision import LaunchError
from ddiloco.runtime.processes.transport.shm import run_directory

BASE = [
    *SMALL,
    "processes.max_wall_seconds=120.0",
]
SLEEPER = ["-c", "import time; time.sleep(120)"]  # a process that neither fails nor talks

MODELS = """
from torch import nn
from ddiloco.models.gpt import GPT, GPTConfig

from bases import SMALL, TINY

class Raises(GPT):
    def forward(self, idx, targets=None):
        raise RuntimeError("boom in forward")

def broken_forward():
    return Raises(GPTConfig(n_layer=1, n_head=1, n_embd=16, block_size=32))

def small_vocab():
    return GPT(GPTConfig(vocab_size=100, n_layer=1, n_head=1, n_embd=16, block_size=32))
"""


def program(code: str) -> list[str]:
    return ["-c", textwrap.dedent(code)]


def records_of(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def left_behind(records: list[dict[str, Any]], out: Path) -> list[str]:
    """Processes of the run still alive: those it started, and any (a torchrun rank, an
    orphan) whose command line names the run directory."""
    found = [
        f"{r['process']} {r['pid']}" for r in records if r["kind"] == "started" and alive(r["pid"])
    ]
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                cmdline = (entry / "cmdline").read_bytes().decode(errors="replace")
            except OSError:
                continue
            if str(out) in cmdline and alive(int(entry.name)):
                found.append(cmdline.replace("\0", " "))
    return found


def fake_launcher(
    tmp_path: Path, overrides: list[str], syncer: list[str], learners: dict[int, list[str]]
):
    """A launcher whose syncer and learners are the given programs (default: sleepers)."""
    records: list[dict[str, Any]] = []
    launcher = Launcher(
        load_config(None, [*BASE, *overrides]), "decoupled", tmp_path, records.append
    )
    launcher.start_syncer = lambda: launcher._spawn(SYNCER, syncer)  # type: ignore[method-assign]
    launcher.start_learner = lambda m, join=False, resume=False: launcher._spawn(  # type: ignore[method-assign]
        f"learner-{m}", learners.get(m, SLEEPER)
    )
    return launcher, records


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (
            ["model='brokenmodels:broken_forward'"],
            r"forward .* raised RuntimeError: boom in forward",
        ),
        (["model='brokenmodels:small_vocab'"], r"vocabulary 100 < 256: tokens are bytes"),
        (["data.source='{empty}'"], r"data.source=.*empty.txt'?: no text: the files are empty"),
        (["train.device='cuda'"], r"train.device='cuda': CUDA is not available"),
    ],
    ids=["forward-raises", "vocab-100", "empty-data", "no-cuda"],
)
def test_a_run_that_cannot_train_is_refused_before_any_process_starts(
    tmp_path, monkeypatch, overrides, match
):
    if "cuda" in match and __import__("torch").cuda.is_available():
        pytest.skip("this machine has CUDA")
    (tmp_path / "brokenmodels.py").write_text(MODELS)
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "empty.txt").write_text("")

    def no_process(*args: Any, **kwargs: Any) -> None:
        raise AssertionError(f"a process was started: {args}")

    monkeypatch.setattr(subprocess, "Popen", no_process)
    config = load_config(
        None, [*BASE, *(o.format(empty=tmp_path / "empty.txt") for o in overrides)]
    )
    started = time.monotonic()
    with pytest.raises(DDiLoCoError, match=match):
        train(config, tmp_path / "run", quiet=True)
    assert time.monotonic() - started < 10.0
    assert not (tmp_path / "run" / "processes").exists()  # no logs, no config for processes


def test_a_syncer_that_keeps_failing_is_given_up_with_backoff_and_its_log_tail(tmp_path):
    crash = program("""
        import sys
        print("loading the store", file=sys.stderr)
        print("RuntimeError: store damaged: bad checksum in fragment 2", file=sys.stderr)
        sys.exit(1)
    """)
    overrides = [
        "processes.max_restarts=2",
        "processes.restart_delay_seconds=0.3",
        "processes.restart_backoff_cap_seconds=0.5",
    ]
    launcher, records = fake_launcher(tmp_path, overrides, crash, {})
    started = time.monotonic()
    with pytest.raises(LaunchError) as info:
        launcher.run()
    assert time.monotonic() - started < 15.0
    error = info.value
    assert (error.process, error.code) == (SYNCER, 1)
    assert "failed 3 times in a row" in str(error) and "bad checksum in fragment 2" in str(error)
    said = "RuntimeError: store damaged: bad checksum in fragment 2"
    assert error.tail[-2:] == ["loading the store", said]
    assert "bad checksum" in error.details() and str(error.log).endswith("syncer.log")
    exited = [r for r in records if r["kind"] == "exited" and r["process"] == SYNCER]
    assert [(r["restart"], r["delay"], r["failures"]) for r in exited] == [
        (True, 0.3, 1), (True, 0.5, 2), (False, None, 3)]  # fmt: skip  # doubled, capped
    assert exited[-1]["gave_up"] and "bad checksum" in exited[-1]["reason"]
    starts = [r["t"] for r in records if r["kind"] == "started" and r["process"] == SYNCER]
    assert len(starts) == 3 and starts[1] - starts[0] >= 0.3 and starts[2] - starts[1] >= 0.5
    assert not left_behind(records, tmp_path)  # the learners were stopped too


@pytest.mark.parametrize("who", [SYNCER, "learner-1"])
def test_an_exit_with_code_78_gives_up_at_once_with_the_process_message(tmp_path, who):
    fatal = program(f"""
        import sys, time
        time.sleep(0.5)
        print("ddiloco {who.split("-")[0]}: error: run id refused by the syncer", file=sys.stderr)
        sys.exit({FATAL_EXIT})
    """)
    syncer = fatal if who == SYNCER else SLEEPER
    launcher, records = fake_launcher(tmp_path, [], syncer, {1: fatal} if who != SYNCER else {})
    started = time.monotonic()
    with pytest.raises(LaunchError, match="run id refused by the syncer") as info:
        launcher.run()
    assert time.monotonic() - started < 10.0
    assert (info.value.process, info.value.code) == (who, FATAL_EXIT)
    assert "code 78 (fatal): not restarted" in str(info.value)
    exited = [r for r in records if r["kind"] == "exited" and r["process"] == who]
    assert len(exited) == 1 and exited[0]["gave_up"] and not exited[0]["restart"]
    assert sum(r["kind"] == "started" and r["process"] == who for r in records) == 1
    assert not left_behind(records, tmp_path)


def test_a_stop_the_syncer_never_answers_ends_with_the_launchers_own_summary(tmp_path, monkeypatch):
    monkeypatch.setattr(launcher_module, "STOP_WAIT_SECONDS", 1.0)
    launcher, records = fake_launcher(tmp_path, [], SLEEPER, {})
    launcher.after(0.5, launcher.request_stop)  # the syncer never says it is up
    started = time.monotonic()
    summary = launcher.run()
    assert time.monotonic() - started < 10.0
    assert summary["stopped"] and summary["summary_source"] == "launcher"
    assert summary["tokens"] == 0 and summary["rounds"] == 0
    assert not left_behind(records, tmp_path)


def english(path: Path, size: int = 160_000) -> None:
    """A small corpus: quick to split in every process."""
    import random

    words = "the king said that his crown was heavy and all the lords slept under the moon"
    rng = random.Random(0)
    text = []
    while sum(map(len, text)) < size:
        text.append(" ".join(rng.choice(words.split()) for _ in range(12)) + ".\n")
    path.write_text("".join(text))


@pytest.mark.parametrize(
    ("sig", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["SIGINT", "SIGTERM"]
)
def test_a_signal_to_ddiloco_train_stops_it_cleanly_with_a_summary(tmp_path, sig, code):
    english(tmp_path / "corpus.txt")
    config = load_config(
        None, [*BASE, "train.tokens=100000000", f"data.source='{tmp_path / 'corpus.txt'}'"]
    )
    (tmp_path / "run.toml").write_text(to_toml(config))
    out = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "ddiloco.cli",
        "train",
        "--config",
        str(tmp_path / "run.toml"),
        "--out",
        str(out),
        "--quiet",
    ]
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        # a test runner started as a background job inherits SIGINT ignored, and so would the
        # command (it keeps a signal ignored from the start, as Python does): as at a terminal
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        deadline = time.monotonic() + 90.0
        while time.monotonic() < deadline and proc.poll() is None:
            metrics = out / "metrics.jsonl"
            if metrics.exists() and metrics.read_text().count('"kind": "step"') >= 10:
                break
            time.sleep(0.2)
        assert proc.poll() is None, proc.communicate()
        sent = time.monotonic()
        proc.send_signal(sig)
        stdout, stderr = proc.communicate(timeout=30)
        took = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            for r in records_of(out) if (out / "metrics.jsonl").exists() else []:
                if r["kind"] == "started" and alive(r["pid"]):  # (sessions of their own: a
                    with contextlib.suppress(ProcessLookupError):  # hung run must not load
                        os.killpg(r["pid"], signal.SIGKILL)  # the tests after it)
    assert proc.returncode == code, stderr
    assert took < 20.0
    assert "Traceback" not in stderr, stderr
    assert f"stopped early by {sig.name}" in stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stopped"] and summary["stop_signal"] == sig.name
    assert summary["summary_source"] == "syncer" and summary["tokens"] > 0
    assert (out / "eval_loss.png").exists()
    records = records_of(out)
    assert sum(r["kind"] == "started" for r in records) == 3  # a syncer, 2 learners
    assert not left_behind(records, out)
    run_id = next(r["run"] for r in records if r["kind"] == "started")
    shm = run_directory(run_id)
    assert shm is None or not shm.exists()
