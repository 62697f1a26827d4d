"""A peer copy over a slow link, by hand as on two sites: learner 0 serves its snapshots
behind a relay that passes ~60 KB/s, learner 1 is SIGKILLed and restarted with ``--join``.
The copy takes far longer than the fixed 10-second deadline it once had; it must arrive
whole, say its progress on the learner's terminal, and the run must end cleanly."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from attackers import events_in
from bases import TINY

from ddiloco.config import load_config, to_toml
from ddiloco.runtime.processes.launcher.fragments import free_port
from ddiloco.runtime.processes.transport.sockets import SECRET_ENV

RATE = 60_000  # bytes/s each way through the relay: the "WAN" between the two sites


class SlowLink(threading.Thread):
    """Listens on ``listen`` and forwards each connection to ``target`` at ``RATE``."""

    def __init__(self, listen: tuple[str, int], target: tuple[str, int]) -> None:
        super().__init__(daemon=True)
        self.target = target
        self.listener = socket.create_server(listen)
        self.start()

    def run(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
                upstream = socket.create_connection(self.target)
            except OSError:
                return
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self.pump, args=(a, b), daemon=True).start()

    @staticmethod
    def pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(4096):
                time.sleep(len(data) / RATE)
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            s.close()


def start(*args: str, log: Path, env: dict[str, str]) -> subprocess.Popen[str]:
    with log.open("w") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "ddiloco.cli", *args],
            env=env, stdout=out, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip


def wait_for(path: Path, pattern: str, timeout: float) -> re.Match[str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if found := re.search(pattern, path.read_text()):
            return found
        time.sleep(0.2)
    raise AssertionError(f"no {pattern!r} in {path} within {timeout}s:\n{path.read_text()}")


def test_a_restarted_learner_copies_its_peer_over_a_slow_link(tmp_path):
    sets = [
        *TINY,
        "train.batch_size=2",
        "train.tokens=100000000",  # the time limit ends the run
        "train.max_virtual_seconds=70.0",
        "train.eval_every=100000000",
        "data.eval_batches=1",
        "sync.fragments=2",
        "sync.sync_every=4",
        "processes.detect_seconds=2.0",
        "processes.learner_checkpoint_every=0.0",
    ]
    (tmp_path / "run.toml").write_text(to_toml(load_config(None, sets)))
    common = ["--config", str(tmp_path / "run.toml"), "--run-id", "slow-peer"]
    env = {**os.environ, SECRET_ENV: bytes(range(32)).hex()}
    address = f"127.0.0.1:{free_port('127.0.0.1')}"
    port = free_port("127.0.0.1")  # learner 0's snapshots: 127.0.0.2 behind the relay's 127.0.0.1
    relay = SlowLink(("127.0.0.1", port), ("127.0.0.2", port))
    run = tmp_path / "run"
    logs = {name: tmp_path / f"{name}.log" for name in ("s", "l0", "l1", "l1b")}
    procs = [start("syncer", "--bind", address, "--out", str(run), *common, log=logs["s"], env=env)]
    donor = ["--peer-bind", "127.0.0.2", "--peer-host", "127.0.0.1", "--peer-port", str(port)]
    for m, extra in ((0, donor), (1, [])):
        learner = ["learner", "--syncer", address, "--id", str(m), *common, *extra]
        procs.append(start(*learner, log=logs[f"l{m}"], env=env))
    try:
        wait_for(logs["s"], r"rounds .* 1:(up|s\d)", timeout=90)  # both train, rounds merge
        procs[2].send_signal(signal.SIGKILL)
        procs[2].wait(timeout=10)
        wait_for(logs["s"], r"learner 1 is silent", timeout=30)
        join = ["learner", "--syncer", address, "--id", "1", "--join", *common]
        procs.append(start(*join, log=logs["l1b"], env=env))
        copied = wait_for(logs["l1b"], r"copied ([\d.]+) MB from peer \S+ in ([\d.]+)s", 120)
        assert procs[0].wait(timeout=120) == 0, logs["s"].read_text()
        for p, name in ((procs[1], "l0"), (procs[3], "l1b")):
            assert p.wait(timeout=60) == 0, logs[name].read_text()
    finally:
        relay.listener.close()
        for p in procs:
            if p.poll() is None:
                p.kill()
    megabytes, seconds = float(copied[1]), float(copied[2])
    assert seconds > 10.0, f"the copy was not slow ({seconds}s): is the relay in the path?"
    said = logs["l1b"].read_text()
    assert len(re.findall(r"copying peer 127\.0\.0\.1:\d+: [\d.]+ / [\d.]+ MB", said)) >= 2, said
    assert "no snap_data" not in said and "failed" not in said, said
    lines = logs["s"].read_text().splitlines()
    status = [line for line in lines if re.search(r"rounds .* 0:", line)]
    assert status and re.search(r"1:(up|s\d)", status[-1]), status[-3:]  # learner 1 ends up
    recovered = [r for r in events_in(logs["l1b"]) if r["kind"] == "recovered"]
    assert recovered and recovered[-1]["peer"] == 0, recovered
    # a snapshot taken for this life, not the one the killed life was copying at step ~20
    assert recovered[-1]["step"] > 100, recovered
    assert abs(recovered[-1]["bytes"] / 1e6 - megabytes) < 0.1, (recovered, megabytes)
