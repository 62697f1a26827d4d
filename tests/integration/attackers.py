"""Clients for the attack tests: a real syncer process, an insider holding the run secret,
and raw peers that hold nothing."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import zmq

from ddiloco.config import load_config, to_toml
from ddiloco.runtime.processes.launcher.fragments import free_port
from ddiloco.runtime.processes.transport.auth import present
from ddiloco.runtime.processes.transport.events import EVENT_PREFIX
from ddiloco.runtime.processes.transport.sockets import SECRET_ENV
from ddiloco.runtime.processes.transport.wire import Message, Wire, WireError

SECRET = bytes(range(32))
RUN = "r1"
OVERRIDES = [
    "model='gpt-tiny'",
    "train.learners=2",
    "sync.fragments=2",
    "sync.sync_every=2",
    "data.eval_batches=1",
    "train.tokens=100000000",
]


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


class SyncerProcess:
    """``ddiloco syncer`` in a subprocess; its events collected as they come."""

    def __init__(
        self, tmp: Path, overrides: list[str] | None = None, address: str | None = None
    ) -> None:
        self.config = load_config(None, [*OVERRIDES, *(overrides or [])])
        (tmp / "config.toml").write_text(to_toml(self.config))
        self.config_path = tmp / "config.toml"
        self.address = address or f"127.0.0.1:{free_port('127.0.0.1')}"
        self.stderr_path = tmp / "syncer.err"
        self.env = {**os.environ, SECRET_ENV: SECRET.hex()}
        cmd = [
            sys.executable,
            "-m",
            "ddiloco.cli",
            "syncer",
            "--bind",
            self.address,
            "--run-id",
            RUN,
            "--config",
            str(self.config_path),
            "--store",
            str(tmp / "store"),
        ]
        with self.stderr_path.open("w") as err:
            self.proc = subprocess.Popen(
                cmd, env=self.env, stdout=subprocess.PIPE, stderr=err, text=True
            )
        self.events: list[dict[str, Any]] = []
        self.up = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()
        assert self.up.wait(60), self.stderr_path.read_text()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(EVENT_PREFIX):
                event = json.loads(line[len(EVENT_PREFIX) :])
                self.events.append(event)
                if event["kind"] == "syncer_up":
                    self.up.set()

    def stop(self) -> dict[str, Any]:
        """SIGTERM (a clean end) and the summary it prints."""
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(timeout=60)
        time.sleep(0.2)
        (summary,) = [e for e in self.events if e["kind"] == "summary"]
        return summary

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    @property
    def stderr(self) -> str:
        return self.stderr_path.read_text()


class Insider:
    """A peer holding the run secret, speaking the protocol by hand (or abusing it)."""

    def __init__(
        self, address: str, m: int = 0, session: int = 5, secret: bytes = SECRET, run: str = RUN
    ) -> None:
        self.m = m
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        present(self.sock, secret, run, f"L{m}")
        self.sock.connect(f"tcp://{address}")
        self.wire = Wire(run, secret, f"L{m}", session)
        self.to = 0  # the syncer's session, once heard

    def send(self, kind: str, **kw: Any) -> None:
        self.sock.send_multipart(self.wire.encode(kind, learner=self.m, to=self.to, **kw))

    def recv(self, timeout: float = 5.0) -> Message | None:
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            if not self.sock.poll(int(left * 1000)):
                return None
            try:
                msg = self.wire.decode(self.sock.recv_multipart())
            except WireError:
                continue
            self.to = msg.header.session
            return msg
        return None

    def expect(self, kind: str, timeout: float = 10.0) -> Message:
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            msg = self.recv(left)
            if msg is not None and msg.kind == kind:
                return msg
        raise AssertionError(f"no {kind} within {timeout}s")

    def sync(self) -> None:
        """Wait until the syncer has handled everything sent so far (it answers in order)."""
        self.send("peers")
        self.expect("peers")

    def prove(self) -> None:
        """A new connection's first frame is answered with a challenge; echo its nonce."""
        self.send("peers")
        nonce = self.expect("challenge").header.meta["nonce"]
        self.send("proof", meta={"nonce": nonce})

    def register(self, fragments: int = 2) -> Message:
        self.prove()  # (the challenge says the syncer's session: the hello is addressed)
        hello = {"inc": self.wire.session, "step": 0, "versions": [0] * fragments}
        self.send("hello", meta=hello)
        return self.expect("welcome")

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


def start_learner(
    config_path, address: str, secret: bytes, run: str, *extra: str, stdout=subprocess.DEVNULL
):
    env = {**os.environ, SECRET_ENV: secret.hex()}
    cmd = [
        sys.executable,
        "-m",
        "ddiloco.cli",
        "learner",
        "--syncer",
        address,
        "--id",
        "0",
        "--run-id",
        run,
        "--config",
        str(config_path),
        *extra,
    ]
    return subprocess.Popen(cmd, env=env, stdout=stdout, stderr=subprocess.PIPE, text=True)


def events_in(path) -> list[dict]:
    prefix = EVENT_PREFIX
    lines = path.read_text().splitlines()
    return [json.loads(line[len(prefix) :]) for line in lines if line.startswith(prefix)]
