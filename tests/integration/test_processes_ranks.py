"""A learner that is itself data-parallel (torchrun, gloo on CPU): rank 0 talks to the
syncer, every rank trains, and the ranks stay identical through merges."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from bases import TINY

from ddiloco.config import load_config
from ddiloco.runtime.processes.launcher.fragments import Launcher


# overwrite with ranks: test_processes_methods.py, test_processes_stragglers.py
@pytest.mark.parametrize("apply", ["carry"])
def test_a_torchrun_learner_keeps_its_ranks_identical_and_counts_their_tokens(tmp_path, apply):
    config = load_config(
        None,
        [
            *TINY,
            "train.batch_size=2",
            "train.tokens=16000",
            "train.eval_every=8000",
            "sync.fragments=4",
            "sync.sync_every=8",
            "data.eval_batches=1",
            "processes.ranks=2",
            "processes.max_wall_seconds=170",
            f"sync.apply='{apply}'",  # carry: every rank takes rank 0's snapshots
        ],
    )
    records: list[dict[str, Any]] = []
    launcher = Launcher(config, "decoupled", tmp_path, records.append)
    summary = launcher.run()
    done = launcher.learner_done
    assert sorted(done) == [0, 1]
    # a learner up a sync period after the other starts from its state (caught_up), not at 0
    start = {m: 0 for m in done}
    start.update({r["learner"]: r["step"] for r in records if r["kind"] == "caught_up"})
    for m, record in done.items():
        assert record["ranks"] == 2 and record["ranks_in_sync"]  # merges reached every rank
        steps = record["step"] - start[m]
        assert record["tokens"] == 2 * 2 * 64 * steps  # both ranks' batches count
    assert summary["rounds"] > 0 and summary["tokens"] >= 16000
    assert {r["learner"] for r in records if r["kind"] == "step"} == {0, 1}  # rank 0 only speaks
    per_learner = {
        m: sum(1 for r in records if r["kind"] == "step" and r["learner"] == m) for m in (0, 1)
    }
    assert all(per_learner[m] == done[m]["step"] - start[m] for m in (0, 1))  # one per step


RANKS_AT_BOUNDARIES = """
import os, signal, sys, threading, torch
from ddiloco.runtime.processes.learner.ranks import RankGroup, RankGroupFailed
term = threading.Event()
signal.signal(signal.SIGTERM, lambda *_: term.set())
group = RankGroup("cpu", terminated=term)
open(os.path.join(sys.argv[1], f"rank{group.rank}"), "w").write(str(os.getpid()))
try:
    while True:  # rank 0's decisions at every boundary, as a learner's loop shares them
        group.share_boundary(False, False, [(0, 1, [torch.ones(3)])], [[(3,)]])
except RankGroupFailed as e:
    print("FAILED", e, flush=True)
    os._exit(3)
"""


@contextlib.contextmanager
def two_ranks(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[bytes], dict[int, int]]]:
    """torchrun running RANKS_AT_BOUNDARIES on 2 ranks (their output in ``tmp_path/out``):
    the agent and each rank's pid once both are at their boundaries; every rank SIGKILLed
    and the agent stopped after."""
    script = tmp_path / "ranks.py"
    script.write_text(RANKS_AT_BOUNDARIES)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    run = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    log = (tmp_path / "out").open("w")
    agent = subprocess.Popen([*run, str(script), str(tmp_path)], env=env, stdout=log, stderr=log)
    pids: dict[int, int] = {}
    try:
        deadline = time.monotonic() + 60
        while len(pids) < 2 and time.monotonic() < deadline and agent.poll() is None:
            time.sleep(0.1)
            pids = {r: int(p.read_text()) for r in (0, 1) if (p := tmp_path / f"rank{r}").exists()
                    and p.read_text()}  # fmt: skip
        assert len(pids) == 2, (tmp_path / "out").read_text()
        yield agent, pids
    finally:
        for pid in pids.values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if agent.poll() is None:
            agent.kill()
        log.close()


def test_a_rank_waiting_on_a_frozen_peer_fails_within_seconds_of_sigterm(tmp_path):
    # torchrun stops a group's surviving ranks with SIGTERM (and SIGKILL only 30 s later): a
    # rank whose peer is frozen (its socket open: the backend sees no error) must still hear
    # it, and fail, rather than hold its learner's slot and link for those 30 s
    with two_ranks(tmp_path) as (_, pids):
        time.sleep(1.0)  # both at their boundaries
        os.kill(pids[1], signal.SIGSTOP)
        time.sleep(0.5)
        os.kill(pids[0], signal.SIGTERM)
        sent = time.monotonic()
        while "FAILED" not in (tmp_path / "out").read_text() and time.monotonic() < sent + 25:
            time.sleep(0.1)  # (torchrun's own SIGKILL would come at 30 s)
        took = time.monotonic() - sent
    out = (tmp_path / "out").read_text()
    assert (
        "FAILED rank 0 of 2: the boundary broadcast failed" in out
        or "FAILED rank 0 of 2: the merged fragment broadcast failed" in out
    ), out
    assert "after SIGTERM" in out and took < 15.0, (took, out)


def test_ranks_whose_torchrun_agent_is_sigkilled_exit_within_seconds(tmp_path):
    # a launcher SIGKILLed with its torchrun agents leaves their ranks orphaned: they must not
    # wait in a collective (or a rendezvous) for gloo's 30-minute timeout
    with two_ranks(tmp_path) as (agent, pids):
        os.kill(pids[1], signal.SIGSTOP)  # rank 0 waits on it in a collective
        agent.kill()
        agent.wait()
        gone = time.monotonic() + 10
        while time.monotonic() < gone and alive(pids[0]):
            time.sleep(0.1)
        assert not alive(pids[0]), "rank 0 outlived its agent by 10 s"
        os.kill(pids[1], signal.SIGCONT)
        while time.monotonic() < gone + 5 and alive(pids[1]):
            time.sleep(0.1)
        assert not alive(pids[1]), "rank 1 outlived its agent"
    assert "torchrun agent" in (tmp_path / "out").read_text()


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with contextlib.suppress(FileNotFoundError):  # a zombie (not reaped yet) is gone too
        if Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z":
            return False
    return True
