"""The data-parallel baseline as real processes: torchrun DDP (gloo, 2 ranks), checkpoints,
and torchrun's own restart of the whole group after a rank is SIGKILLed."""

from __future__ import annotations

import itertools
import json
import math
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from ddiloco import train
from ddiloco.chaos.plan import ChaosEvent
from ddiloco.config import load_config
from ddiloco.errors import FATAL_EXIT, ConfigError
from ddiloco.report.summary import REQUIRED
from ddiloco.runtime.processes.launcher.data_parallel import DataParallelJob
from ddiloco.runtime.processes.launcher.data_parallel_worker import (
    CheckpointError,
    latest,
    read_checkpoint,
    write_checkpoint,
)
from ddiloco.runtime.processes.launcher.fragments import Launcher
from ddiloco.runtime.processes.launcher.supervision import LaunchError

BASE = [
    "model='gpt-tiny'",
    "methods=['data_parallel']",
    "runtime='processes'",
    "train.learners=2",
    "train.batch_size=4",
    "train.warmup_steps=5",
    "train.eval_every=8000",
    "data.eval_batches=1",
    "data_parallel.checkpoint_every=10",
    "processes.max_wall_seconds=120",
]


def corpus(path: Path, size: int = 160_000) -> str:
    """A small corpus: quick to split in every rank."""
    import random

    words = "the king said that his crown was heavy and all the lords slept under the moon"
    rng = random.Random(0)
    lines = [
        " ".join(rng.choice(words.split()) for _ in range(12)) + ".\n" for _ in range(size // 60)
    ]
    path.write_text("".join(lines))
    return f"data.source='{path}'"


def job(tmp_path: Path, *overrides: str, hook: Any = None) -> tuple[DataParallelJob, list]:
    config = load_config(None, [*BASE, corpus(tmp_path / "corpus.txt"), *overrides])
    records: list[dict[str, Any]] = []
    return DataParallelJob(
        config, "data_parallel", tmp_path / "run", records.append, hooks=[hook] if hook else ()
    ), records


def test_a_clean_data_parallel_run_trains_and_writes_the_summary_schema(tmp_path):
    config = load_config(None, [*BASE, corpus(tmp_path / "corpus.txt"), "train.tokens=20000"])
    (summary,) = train(config, tmp_path / "run", quiet=True)
    on_disk = json.loads((tmp_path / "run" / "summary.json").read_text())
    for key in (*REQUIRED, "restarts", "checkpoints", "summary_source"):
        assert key in on_disk, key
    assert summary["method"] == "data_parallel" and summary["clock"] == "wall"
    assert summary["summary_source"] == "dp_worker" and summary["restarts"] == {}
    assert summary["tokens"] == summary["tokens_merged"] >= 20000
    assert summary["tokens_wasted"] == {} and summary["checkpoints"] >= 3
    assert 0 < summary["goodput"] <= summary["uptime"] <= 1.0
    # no fault: the job was up the whole time, its evaluations and checkpoints included
    # (planned pauses, not lost time: stepping alone is less of it), and every step was kept
    assert summary["uptime"] == pytest.approx(1.0) and summary["goodput"] == summary["uptime"]
    span = summary["virtual_seconds"] - summary["startup_seconds"]
    assert 0 < summary["stepping_seconds"] < 0.999 * span
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    evals = [r["loss"] for r in records if r["kind"] == "eval"]
    assert len(evals) >= 3  # (the first, at least one on the way, the last)
    assert evals[-1] < evals[0] - 1.0 and summary["eval_loss"] == evals[-1]
    steps = [r for r in records if r["kind"] == "step"]
    assert {r["learner"] for r in steps} == {0} and len(steps) == summary["steps"]
    up = next(r for r in records if r["kind"] == "learner_up")
    ring = int(2 * (2 - 1) / 2 * up["grad_bytes"])  # a ring all-reduce, per rank and step
    assert summary["bytes_sent"] == summary["bytes_received"] == len(steps) * 2 * ring
    pids = {r["rank"]: r["pid"] for r in records if r["kind"] == "rank_up"}
    assert sorted(pids) == [0, 1] and len(set(pids.values())) == 2  # every rank announced


def test_a_rank_killed_mid_run_makes_torchrun_restart_the_group_from_its_checkpoint(tmp_path):
    # the plan's crash (wall clock: well after a start-up of ~6 s here) may land right after a
    # checkpoint and lose nothing; the second, at step 10k + 5 of the next life, loses 5 steps
    state: dict[str, Any] = {"lives": 0}

    def hook(run: DataParallelJob, r: dict[str, Any]) -> None:
        if r["kind"] == "learner_up":
            state["lives"] += 1
        elif r["kind"] == "step" and state["lives"] == 2 and r["step"] % 10 == 5:
            if "killed" not in state:
                state["killed"] = r["step"]
                run.play(ChaosEvent(at=run.now(), kind="crash", learner=0, duration=1.0))
        elif r["kind"] == "step" and state["lives"] == 3 and "stop" not in state:
            state["stop"] = run.now()
            run.request_stop()  # and the job ends with rank 0's own report

    run, records = job(
        tmp_path,
        "train.tokens=100000000",
        "chaos=[{at=12.0, kind='crash', learner=1, duration=1.0}]",
        hook=hook,
    )
    started = time.monotonic()
    summary = run.run()
    took = time.monotonic() - started
    planned, played = [r for r in records if r["kind"] == "chaos"]
    assert played["event"] == "crash" and played["learner"] == 0 and "skipped" not in played
    assert "skipped" not in planned, (planned, "start-up took longer than the crash's at")
    assert planned["event"] == "crash" and "duration is not played" in planned["note"]
    assert planned["t"] >= 12.0 and run.max_restarts == 5 + 1  # a planned kill adds one
    resumed = [r for r in records if r["kind"] == "resumed"]
    rollbacks = [r for r in records if r["kind"] == "rollback"]
    assert [r["attempt"] for r in resumed] == [1, 2] and len(rollbacks) == 2
    for back, rollback in zip(resumed, rollbacks, strict=True):
        # the newest checkpoint written before the restart (rank 0 may finish one a moment
        # after its peer was killed: it is complete, all ranks had gathered for it)
        before = [r for r in records[: records.index(back)] if r["kind"] == "checkpoint"]
        assert back["step"] == before[-1]["step"] == rollback["to_step"]
        assert rollback["from_step"] >= rollback["to_step"]
    assert rollbacks[1]["from_step"] >= state["killed"] > rollbacks[1]["to_step"]
    wasted = summary["tokens_wasted"]["rollback"]
    assert wasted == sum(r["tokens_lost"] for r in rollbacks) >= 5 * 512
    assert summary["tokens"] == summary["tokens_merged"] + wasted
    assert summary["restarts"] == {"dp": 2}
    assert [r["step"] for r in summary["resumed"]] == [r["step"] for r in resumed]
    assert summary["goodput"] < summary["uptime"]  # the rolled-back steps were not useful
    assert summary["stopped"] and summary["summary_source"] == "dp_worker"
    assert math.isfinite(summary["eval_loss"])
    recovered = [(r["learner"], r["source"]) for r in records if r["kind"] == "recovered"]
    assert recovered == [(1, "checkpoint"), (0, "checkpoint")]
    print(
        f"crash run: {took:.1f}s wall, rollback {wasted:.0f} tokens, "
        f"{summary['restarts']} restarts, goodput {summary['goodput']:.3f}, "
        f"uptime {summary['uptime']:.3f}"
    )


def test_a_frozen_rank_stalls_every_rank_and_elastic_faults_are_skipped(tmp_path):
    state: dict[str, Any] = {}

    def hook(run: DataParallelJob, r: dict[str, Any]) -> None:
        if r["kind"] == "step" and r["step"] == 20 and "frozen" not in state:
            state["frozen"] = run.now()
            for kind in ("freeze", "leave", "join", "link_cut"):
                run.play(ChaosEvent(at=run.now(), kind=kind, learner=1, duration=2.0))

    run, records = job(tmp_path, "train.tokens=25000", hook=hook)
    summary = run.run()
    chaos = {r["event"]: r for r in records if r["kind"] == "chaos"}
    assert "skipped" not in chaos["freeze"] and chaos["freeze"]["pids"]
    assert "cannot shrink or grow" in chaos["leave"]["skipped"]
    assert "cannot shrink or grow" in chaos["join"]["skipped"]
    assert "fault proxy" in chaos["link_cut"]["skipped"]
    times = [r["t"] for r in records if r["kind"] == "step"]
    gap = max(b - a for a, b in itertools.pairwise(times))
    assert gap >= 1.8  # rank 0 waited in the all-reduce for the frozen rank 1
    assert summary["restarts"] == {} and summary["tokens_wasted"] == {}


def test_a_job_out_of_restarts_raises_launch_error_naming_its_log(tmp_path):
    def hook(run: DataParallelJob, r: dict[str, Any]) -> None:
        if r["kind"] == "step" and r["step"] == 5:
            run.play(ChaosEvent(at=run.now(), kind="crash", learner=0))

    run, _ = job(tmp_path, "train.tokens=100000", "processes.max_restarts=0", hook=hook)
    started = time.monotonic()
    with pytest.raises(LaunchError, match="torchrun gave up") as info:
        run.run()
    assert time.monotonic() - started < 30.0
    assert info.value.process == "dp" and str(info.value.log).endswith("dp.log")
    assert "SIGKILL" in str(info.value)  # torchrun's root cause, not its ruler of '='


def test_a_damaged_checkpoint_is_refused_at_once_naming_the_file(tmp_path):
    run, _ = job(tmp_path, "train.tokens=20000")
    path, _ = write_checkpoint(run.home / "checkpoints", 10, {"x": torch.zeros(4)})
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x10  # one bit flipped on disk
    path.write_bytes(bytes(data))
    started = time.monotonic()
    with pytest.raises(LaunchError, match=r"ckpt-00000010\.bin.*checksum mismatch") as info:
        run.run()
    assert time.monotonic() - started < 30.0  # not torchrun's restarts one by one
    assert info.value.code == FATAL_EXIT and str(path) in str(info.value)


def test_the_checkpoint_reader_refuses_every_damage_naming_the_file(tmp_path):
    state = {
        "version": 1,
        "method": "data_parallel",
        "model": "gpt-tiny",
        "world": 2,
        "step": 7,
        "tokens": 3584,
        "positions": [7, 7],
        "stepping_seconds": 0.5,
        "next_eval": 8000,
        "weights": {"w": torch.arange(6.0).reshape(2, 3)},
        "optimizer": {"state": {}, "param_groups": [{"betas": (0.9, 0.95)}]},
    }
    path, size = write_checkpoint(tmp_path, 7, state)
    assert latest(tmp_path) == (7, path) and path.stat().st_size == size
    back = read_checkpoint(path)
    assert torch.equal(back["weights"]["w"], state["weights"]["w"])
    assert back["optimizer"]["param_groups"][0]["betas"] == (0.9, 0.95)
    good = path.read_bytes()
    damages = {
        "checksum mismatch": good[:-1] + bytes([good[-1] ^ 1]),  # one bit in the payload
        "truncated or extended": good[:-10],
        "shorter than its header": good[:30],
        "bad magic": b"PK\x03\x04" + good[4:],  # e.g. a torch.save zip
        "format version 9": good[:8] + (9).to_bytes(4, "little") + good[12:],
    }
    for why, data in damages.items():
        path.write_bytes(data)
        with pytest.raises(CheckpointError, match=why) as info:
            read_checkpoint(path)
        assert str(path) in str(info.value)
    with pytest.raises(CheckpointError, match="cannot read it") as info:
        read_checkpoint(tmp_path / "ckpt-00000099.bin")
    assert "ckpt-00000099.bin" in str(info.value)
    for step in (8, 9, 10):  # only the newest two are kept
        write_checkpoint(tmp_path, step, state)
    assert sorted(p.name for p in tmp_path.glob("ckpt-*")) == [
        "ckpt-00000009.bin",
        "ckpt-00000010.bin",
    ]
    assert not list(tmp_path.glob(".*.tmp"))


def test_each_runtime_refuses_the_methods_it_does_not_run(tmp_path):
    config = load_config(None, [*BASE, "methods=['elastic_dp', 'decoupled']"])
    with pytest.raises(ConfigError, match="elastic_dp does not run as processes"):
        DataParallelJob(config, "elastic_dp", tmp_path, print)
    with pytest.raises(ConfigError, match="a fragment method"):
        DataParallelJob(config, "decoupled", tmp_path, print)
    with pytest.raises(ConfigError, match="not a fragment method"):
        Launcher(config, "data_parallel", tmp_path, print)
    assert not (tmp_path / "processes").exists()  # refused before any file is written
