"""A real syncer process refuses bad frames and bad updates, logs them, counts them, and
never applies them."""

from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys
import time

import torch
import zmq

from ddiloco.config import load_config, to_toml
from ddiloco.core.codec import CodecSpec, encode_tensors
from ddiloco.core.plans import gather
from ddiloco.runtime.processes.common import EVENT_PREFIX, SECRET_ENV
from ddiloco.runtime.processes.launcher import free_port
from ddiloco.runtime.processes.setup import RunSetup
from ddiloco.runtime.processes.wire import PREFIX, VERSION, Wire

SECRET = bytes(range(32))
OVERRIDES = ["model='gpt-tiny'", "train.learners=1", "sync.fragments=2", "sync.sync_every=2",
             "data.eval_batches=1"]  # fmt: skip


def events_of(text: str) -> list[dict]:
    return [json.loads(line[len(EVENT_PREFIX) :]) for line in text.splitlines()
            if line.startswith(EVENT_PREFIX)]  # fmt: skip


def test_bad_frames_and_nan_updates_are_refused_logged_counted_and_never_applied(tmp_path):
    cfg = load_config(None, OVERRIDES)
    (tmp_path / "config.toml").write_text(to_toml(cfg))
    address = f"127.0.0.1:{free_port('127.0.0.1')}"
    env = {**os.environ, SECRET_ENV: SECRET.hex()}
    cmd = [
        sys.executable,
        "-m",
        "ddiloco.cli",
        "syncer",
        "--bind",
        address,
        "--run-id",
        "r1",
        "--config",
        str(tmp_path / "config.toml"),
        "--store",
        str(tmp_path / "store"),
    ]
    pipe = subprocess.PIPE
    syncer = subprocess.Popen(cmd, env=env, stdout=pipe, stderr=pipe, text=True)
    try:
        assert syncer.stdout is not None
        for line in syncer.stdout:  # wait until it serves
            if '"syncer_up"' in line:
                break
        ctx = zmq.Context.instance()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, b"L0")
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://{address}")
        wire = Wire("r1", SECRET, "L0", 5)
        hello = wire.encode("hello", learner=0, meta={"inc": 5, "step": 0, "versions": [0, 0]})
        sock.send_multipart(hello)
        assert sock.poll(30_000) and wire.decode(sock.recv_multipart()).kind == "welcome"

        good = wire.encode("progress", learner=0,
                           meta={"inc": 5, "step": 1, "tokens": 64, "secs": 0.1})  # fmt: skip
        sock.send_multipart(good)
        corrupted = [bytes(p) for p in wire.encode("progress", learner=0, meta={"inc": 5})]
        corrupted[0] = corrupted[0][:-1] + bytes([corrupted[0][-1] ^ 1])
        head, body, _ = wire.encode("progress", learner=0, meta={"inc": 5})
        truncated = [head, body]
        oversized = [PREFIX.pack(b"DDWF", VERSION, 0, 0, 10, 2**40) + b"x" * 10, b"", b"t" * 64]
        forged = Wire("r1", b"y" * 32, "L0", 5).encode("progress", learner=0, meta={"inc": 5})
        other_run = Wire("r2", SECRET, "L0", 5).encode("progress", learner=0, meta={"inc": 5})
        for frame in (corrupted, truncated, oversized, good, forged, other_run):  # good: replay
            sock.send_multipart(frame)

        setup = RunSetup(cfg)
        shapes = [t.shape for t in gather(setup.plan, 0, setup.initial)]
        payload = bytearray(encode_tensors([torch.zeros(s) for s in shapes], CodecSpec("fp32")))
        payload[-4:] = struct.pack("<f", float("nan"))
        meta = {"learner": 0, "incarnation": 5, "seq": 0, "fragment": 0, "round_id": -1,
                "base_version": 0, "local_step": 1, "c_steps": 1, "c_tokens": 64}  # fmt: skip
        sock.send_multipart(wire.encode("answer", learner=0, fragment=0, meta=meta,
                                        payload=payload))  # fmt: skip
        deadline = time.monotonic() + 30
        verdict = None
        while verdict is None and time.monotonic() < deadline:
            if not sock.poll(500):
                continue
            msg = wire.decode(sock.recv_multipart())
            if msg.kind == "verdict":
                verdict = msg.header.meta["verdict"]
        assert verdict == "refused_nonfinite"
        sock.close(0)
        syncer.send_signal(signal.SIGTERM)
        out, err = syncer.communicate(timeout=60)
    finally:
        if syncer.poll() is None:
            syncer.kill()
    (summary,) = [e for e in events_of(out) if e["kind"] == "summary"]
    assert summary["refused"] == {"checksum": 1, "truncated": 1, "oversized": 1, "replay": 1,
                                  "auth": 1, "run": 1}  # fmt: skip
    assert summary["service"]["refused_nonfinite"] == 1
    assert summary["versions"] == [0, 0] and summary["rounds"] == 0  # nothing was applied
    assert summary["tokens"] == 64  # the good progress report, once
    for reason in ("checksum", "truncated", "oversized", "replay", "auth", "run"):
        assert f"({reason})" in err  # one clear log line each
