"""Syncer memory and log volume under a bounded flood of unauthenticated traffic.

Starts a real ``ddiloco syncer``, registers one honest learner (a client holding the
secret), and for ``--seconds`` floods the syncer's port from peers that hold nothing:
connections presenting wrong credentials, connections presenting none, and raw TCP clients
that send a ZMTP greeting and then an unterminated multipart message (1 MiB parts, the MORE
flag always set) for as long as the syncer lets them. Prints the syncer's RSS growth
(target: <= 64 MiB), the bytes and connections thrown at it, the refusals it counted, the
lines it logged, and whether the honest learner is still heard.

    .venv/bin/python benchmarks/bench_flood.py --seconds 10
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import struct
import tempfile
import threading
import time
from pathlib import Path

import zmq

from ddiloco.config import load_config
from ddiloco.runtime.processes.transport.auth import present
from ddiloco.runtime.processes.transport.events import EVENT_PREFIX
from ddiloco.runtime.processes.transport.tickets import make_ticket
from ddiloco.runtime.processes.transport.wire import Wire
from syncer_process import start_syncer

SECRET = os.urandom(32)
RUN = "flood"
PART = struct.pack(">BQ", 0x03, 1 << 20) + b"\0" * (1 << 20)  # MORE | LONG, 1 MiB
GREETING = b"\xff" + b"\0" * 8 + b"\x7f\x03\x00" + b"NULL".ljust(20, b"\0") + b"\0" * 32


def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) << 10
    return 0


def raw_flood(host: str, port: int, until: float, totals: dict[str, int]) -> None:
    while time.monotonic() < until:
        try:
            with socket.create_connection((host, port), timeout=1.0) as raw:
                totals["raw_connections"] += 1
                raw.sendall(GREETING)
                while time.monotonic() < until:
                    raw.sendall(PART)
                    totals["raw_bytes"] += len(PART)
        except OSError:
            continue


def zmq_flood(address: str, until: float, totals: dict[str, int], password: bytes | None):
    ctx = zmq.Context()
    while time.monotonic() < until:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        if password is not None:
            sock.plain_username, sock.plain_password = make_ticket("L0").encode(), password
        sock.connect(f"tcp://{address}")
        with contextlib.suppress(zmq.Again):
            sock.send(b"x" * 4096, zmq.NOBLOCK)
        time.sleep(0.01)
        sock.close(0)
        totals["zmq_connections"] += 1
    ctx.term()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--raw", type=int, default=2, help="raw TCP flooders")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="ddiloco-flood-"))
    config = load_config(
        None,
        [
            "model='gpt-tiny'",
            "train.learners=1",
            "sync.fragments=2",
            "sync.sync_every=2",
            "train.tokens=1000000000",
            "processes.detect_seconds=60",
        ],
    )
    err = (tmp / "syncer.err").open("w")
    syncer, address = start_syncer(tmp, config, RUN, SECRET, stderr=err)
    lines: list[str] = []
    up = threading.Event()

    def read() -> None:
        for line in syncer.stdout or ():
            lines.append(line)
            if '"syncer_up"' in line:
                up.set()

    threading.Thread(target=read, daemon=True).start()
    ctx = zmq.Context()
    learner = ctx.socket(zmq.DEALER)
    present(learner, SECRET, RUN, "L0")
    learner.connect(f"tcp://{address}")
    try:
        if not up.wait(60):
            raise SystemExit("the syncer did not start")
        wire, to = Wire(RUN, SECRET, "L0", 5), 0
        hello = {"inc": 5, "step": 0, "versions": [0, 0]}
        for _ in range(2):  # the first hello is answered with the syncer's session (rehello)
            learner.send_multipart(wire.encode("hello", learner=0, to=to, meta=hello))
            to = wire.decode(learner.recv_multipart()).header.session
        time.sleep(1.0)
        before = rss(syncer.pid)
        until = time.monotonic() + args.seconds
        totals = {"raw_connections": 0, "raw_bytes": 0, "zmq_connections": 0}
        host, port = address.rsplit(":", 1)
        threads = [
            threading.Thread(target=raw_flood, args=(host, int(port), until, totals))
            for _ in range(args.raw)
        ]
        threads += [
            threading.Thread(target=zmq_flood, args=(address, until, totals, pw))
            for pw in (None, b"wrong")
        ]
        for t in threads:
            t.start()
        peak = before
        while time.monotonic() < until:
            peak = max(peak, rss(syncer.pid))
            time.sleep(0.1)
        for t in threads:
            t.join()
        peak = max(peak, rss(syncer.pid))
        learner.send_multipart(
            wire.encode(
                "progress",
                learner=0,
                to=to,
                meta={"inc": 5, "step": 1, "tokens": 64, "secs": 0.1, "rebased": []},
            )
        )
        heard = learner.poll(3000) > 0
        syncer.send_signal(signal.SIGTERM)
        syncer.wait(timeout=60)
    finally:
        learner.close(0)
        ctx.term()
        if syncer.poll() is None:
            syncer.kill()
        err.close()
    time.sleep(0.2)
    summary = [json.loads(x[len(EVENT_PREFIX) :]) for x in lines if '"summary"' in x][-1]
    logged = len((tmp / "syncer.err").read_text().splitlines())
    growth = (peak - before) / (1 << 20)
    print(
        f"flood {args.seconds:.0f}s: {totals['raw_connections']} raw connections sending "
        f"{totals['raw_bytes'] / (1 << 20):.0f} MiB of one unterminated message, "
        f"{totals['zmq_connections']} zmq connections without / with wrong credentials"
    )
    print(
        f"syncer RSS {before / (1 << 20):.0f} MiB -> peak {peak / (1 << 20):.0f} MiB: "
        f"growth {growth:.1f} MiB (target <= 64)"
    )
    refusals = {k: v for k, v in summary["service"].items() if k.startswith("handshake")}
    print(
        f"refusals counted: {refusals} {summary['gatekeeper']}; "
        f"{logged} log lines; honest learner heard after: {heard}, tokens {summary['tokens']}"
    )


if __name__ == "__main__":
    main()
