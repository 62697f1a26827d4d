"""A real syncer process under attack, from outside (no secret) and from inside (a learner
holding it): every attack is refused, counted and logged, and the run goes on."""

from __future__ import annotations

import socket
import struct
import time
from typing import Any

import torch
import zmq
from attackers import (
    OVERRIDES,
    RUN,
    SECRET,
    Insider,
    SyncerProcess,
    events_in,
    rss_bytes,
    start_learner,
)

from ddiloco.config import load_config, to_toml
from ddiloco.core.codec import CodecSpec, encode_tensors
from ddiloco.core.fragments import gather
from ddiloco.errors import FATAL_EXIT
from ddiloco.runtime.processes.launcher.fragments import free_port
from ddiloco.runtime.processes.transport.tickets import make_ticket
from ddiloco.runtime.processes.transport.wire import FLAG_SHM, PREFIX, VERSION, Wire, decode_update
from ddiloco.runtime.run import RunSetup


def progress(step: int, tokens: int = 64) -> dict:
    return {"inc": 5, "step": step, "tokens": tokens, "secs": 0.1, "rebased": []}


def test_peers_without_the_secret_get_nothing_crash_nothing_and_displace_nobody(tmp_path):
    syncer = SyncerProcess(tmp_path)
    learner = Insider(syncer.address)
    attackers: list[zmq.Socket] = []
    ctx = zmq.Context()
    try:
        learner.register()
        # the frame that used to kill the syncer: the shared-memory flag, a missing slot and
        # a routing id of L + 30 nines
        crash = Wire(RUN, b"x" * 32, "L0", 1).encode("hello", learner=0)
        head = bytearray(crash[0])
        head[5] = FLAG_SHM
        for identity, password in ((b"L" + b"9" * 30, None), (b"L0", None), (None, b"bad")):
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            if identity is not None:
                sock.setsockopt(zmq.IDENTITY, identity)  # take learner 0's route, as before
            if password is not None:
                sock.plain_username, sock.plain_password = make_ticket("L0").encode(), password
            sock.connect(f"tcp://{syncer.address}")
            attackers.append(sock)
        for _ in range(10):  # reconnects that once shut learner 0 out for good
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.IDENTITY, b"L0")
            sock.connect(f"tcp://{syncer.address}")
            sock.send_multipart([bytes(head), b"ref", bytes(crash[2])], zmq.NOBLOCK)
            attackers.append(sock)
        for sock in attackers[:3]:
            for _ in range(20):
                try:
                    sock.send_multipart([bytes(head), b"ref", bytes(crash[2])], zmq.NOBLOCK)
                except zmq.Again:  # nothing queues: no connection was ever accepted
                    break
        learner.send("progress", meta=progress(1))
        learner.sync()
        assert learner.expect("beat", 3.0).header.meta["live"]  # learner 0 is still heard
        assert all(not sock.poll(200) for sock in attackers)  # ...and the attackers hear nothing
        assert syncer.proc.poll() is None
        summary = syncer.stop()
    finally:
        for sock in attackers:
            sock.close(0)
        ctx.term()
        learner.close()
        syncer.kill()
    assert summary["tokens"] == 64  # learner 0's report, and nothing else
    assert summary["gatekeeper"]["refused_bad_credentials"] >= 1
    service = summary["service"]
    assert service.get("handshake_failed_protocol", 0) + service.get("handshake_failed", 0) >= 1
    assert "wrong secret or run id" in syncer.stderr


def zmtp_greeting(mechanism: bytes) -> bytes:
    return (
        b"\xff"
        + b"\0" * 8
        + b"\x7f"
        + b"\x03\x00"
        + mechanism.ljust(20, b"\0")
        + b"\0"
        + b"\0" * 31
    )


def test_an_unterminated_multipart_message_and_a_flood_grow_the_syncer_by_little(tmp_path):
    syncer = SyncerProcess(tmp_path, ["processes.detect_seconds=30"])  # a slow, busy machine
    learner = Insider(syncer.address)
    host, port = syncer.address.rsplit(":", 1)
    try:
        learner.register()
        learner.send("progress", meta=progress(1))
        before = rss_bytes(syncer.proc.pid)
        sent, connections = 0, 0
        part = struct.pack(">BQ", 0x03, 1 << 20) + b"\0" * (1 << 20)  # MORE | LONG, 1 MiB
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline and sent < 1 << 30:  # up to 1 GiB, never one end
            with socket.create_connection((host, int(port))) as raw:
                connections += 1
                try:
                    raw.sendall(zmtp_greeting(b"NULL"))
                    while time.monotonic() < deadline:
                        raw.sendall(part)
                        sent += len(part)
                except OSError:  # the syncer hung up on us: reconnect, again and again
                    pass
        growth = rss_bytes(syncer.proc.pid) - before
        learner.send("progress", meta=progress(2))
        learner.sync()
        summary = syncer.stop()
    finally:
        learner.close()
        syncer.kill()
    assert growth <= 64 << 20, f"grew {growth >> 20} MiB after {sent >> 20} MiB"
    assert summary["tokens"] == 128
    service = summary["service"]
    assert connections >= 1
    assert service.get("handshake_failed_protocol", 0) + service.get("handshake_failed", 0) >= 1
    assert len(syncer.stderr.splitlines()) < 40  # rate-limited, however many refusals


ANSWER = {  # a well-formed answer's meta, for learner 0 of incarnation 5
    "learner": 0,
    "incarnation": 5,
    "seq": 0,
    "fragment": 0,
    "round_id": -1,
    "base_version": 0,
    "local_step": 1,
    "c_steps": 1,
    "c_tokens": 64,
}

SHAPES = [
    ("hello", {"inc": "abc", "step": 0, "versions": [0, 0]}),
    ("hello", {"inc": 5, "step": 0, "versions": []}),
    ("hello", {"inc": 5, "step": float("inf"), "versions": [0, 0]}),
    ("hello", {"inc": 5, "step": 0, "versions": {"a": 1}}),
    ("progress", {"inc": 5, "step": 2, "tokens": "x", "secs": 0.1}),
    ("progress", {"inc": 5, "step": float("nan"), "tokens": 64, "secs": 0.1}),
    (
        "answer",
        {**ANSWER, "c_tokens": "x"},
    ),
    ("progress", {"inc": 5, "step": 2, "tokens": 64, "secs": 0.1, "rebased": [7, -1]}),
]


def test_malformed_metadata_from_an_insider_is_refused_counted_and_logged(tmp_path):
    syncer = SyncerProcess(tmp_path)
    learner = Insider(syncer.address)
    try:
        learner.register()
        for kind, meta in SHAPES:
            learner.send(kind, meta=meta)
        deep: list = []
        node = deep
        for _ in range(1000):  # a header nested ~1000 deep
            node.append([])
            node = node[0]
        learner.send("progress", meta={"inc": 5, "step": 2, "x": deep})
        learner.send("progress", meta=progress(1))  # and then an honest report
        learner.sync()
        assert syncer.proc.poll() is None
        summary = syncer.stop()
    finally:
        learner.close()
        syncer.kill()
    assert summary["service"]["refused_meta"] == len(SHAPES)
    assert summary["refused"]["header"] == 1  # the deep one, refused by the wire
    assert summary["tokens"] == 64
    assert "(refused_meta)" in syncer.stderr and "(header)" in syncer.stderr


def test_bad_frames_and_nan_updates_are_refused_logged_counted_and_never_applied(tmp_path):
    syncer = SyncerProcess(tmp_path, ["train.learners=1"])
    learner = Insider(syncer.address)
    try:
        learner.register()
        wire, to = learner.wire, learner.to
        good = wire.encode("progress", learner=0, to=to, meta=progress(1))
        corrupted = [bytes(p) for p in wire.encode("progress", learner=0, to=to, meta={})]
        corrupted[0] = corrupted[0][:-1] + bytes([corrupted[0][-1] ^ 1])
        head, body, _ = wire.encode("progress", learner=0, to=to, meta={})
        oversized = [PREFIX.pack(b"DDWF", VERSION, 0, 0, 10, 2**40) + b"x" * 10, b"", b"t" * 64]
        forged = Wire(RUN, b"y" * 32, "L0", 5).encode("progress", learner=0, to=to, meta={})
        other_run = Wire("r2", SECRET, "L0", 5).encode("progress", learner=0, to=to, meta={})
        for frame in (corrupted, [head, body], oversized, good, forged, other_run, good):
            learner.sock.send_multipart(frame)  # the second good one: a replay
        setup = RunSetup(syncer.config)
        shapes = [t.shape for t in gather(setup.plan, 0, setup.initial)]
        payload = bytearray(encode_tensors([torch.zeros(s) for s in shapes], CodecSpec("fp32")))
        payload[-4:] = struct.pack("<f", float("nan"))
        meta = dict(ANSWER)
        learner.send("answer", fragment=0, meta=meta, payload=payload)
        assert learner.expect("verdict").header.meta["verdict"] == "refused_nonfinite"
        summary = syncer.stop()
    finally:
        learner.close()
        syncer.kill()
    assert summary["refused"] == {"checksum": 1, "oversized": 1, "replay": 1, "auth": 1, "run": 1}
    assert summary["service"]["refused_parts"] == 1  # the truncated one: 2 parts
    assert summary["service"]["refused_nonfinite"] == 1
    assert summary["versions"] == [0, 0] and summary["rounds"] == 0  # nothing was applied
    assert summary["tokens"] == 64  # the good progress report, once
    for reason in ("checksum", "refused_parts", "oversized", "replay", "auth", "run"):
        assert f"({reason})" in syncer.stderr  # one clear log line each


def test_a_learner_started_before_its_syncer_waits_for_it_instead_of_training_alone(tmp_path):
    # it used to train at once and report it all on its welcome: on a cold CI box the
    # learners were up 1 s before their syncer and spent the whole token budget before a merge
    address = f"127.0.0.1:{free_port('127.0.0.1')}"
    config_path = tmp_path / "learner.toml"
    config_path.write_text(to_toml(load_config(None, OVERRIDES)))
    out = (tmp_path / "learner.out").open("w")
    learner = start_learner(config_path, address, SECRET, RUN, stdout=out)
    syncer = None
    try:
        time.sleep(8.0)  # long enough to build its model and take many steps
        assert learner.poll() is None
        before = events_in(tmp_path / "learner.out")
        assert not [e for e in before if e["kind"] == "step"], before
        (tmp_path / "syncer").mkdir()
        syncer = SyncerProcess(tmp_path / "syncer", address=address)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not any(
            e["kind"] == "step" for e in events_in(tmp_path / "learner.out")
        ):
            time.sleep(0.2)
        summary = syncer.stop()
        assert learner.wait(timeout=30) == 0, learner.communicate()[1]
    finally:
        if learner.poll() is None:
            learner.kill()
        if syncer is not None:
            syncer.kill()
        out.close()
    steps = [e for e in events_in(tmp_path / "learner.out") if e["kind"] == "step"]
    assert steps and steps[0]["step"] == 1  # it started with the syncer, from the start
    assert summary["tokens"] > 0


def test_a_learner_refused_or_without_a_syncer_stops_at_once_naming_the_cause(tmp_path):
    syncer = SyncerProcess(tmp_path)
    nobody = f"127.0.0.1:{free_port('127.0.0.1')}"
    started = time.monotonic()
    give_up = ["--set", "processes.give_up_seconds=3"]
    learners = {
        "wrong secret": start_learner(
            syncer.config_path, syncer.address, bytes(range(99, 131)), RUN
        ),
        "wrong run id": start_learner(syncer.config_path, syncer.address, SECRET, "r-other"),
        "no syncer": start_learner(syncer.config_path, nobody, SECRET, RUN, *give_up),
    }
    try:
        results = {name: (p.wait(timeout=90), p.communicate()[1]) for name, p in learners.items()}
        elapsed = time.monotonic() - started
        assert syncer.proc.poll() is None
        summary = syncer.stop()
    finally:
        for p in learners.values():
            if p.poll() is None:
                p.kill()
        syncer.kill()
    for name, (code, err) in results.items():
        assert code == FATAL_EXIT, (name, err)
    assert "wrong secret or run id" in results["wrong secret"][1]
    assert "wrong secret or run id" in results["wrong run id"][1]
    assert "no syncer answered" in results["no syncer"][1]
    assert elapsed < 60  # seconds, not for ever
    assert summary["gatekeeper"]["refused_bad_credentials"] >= 2 and summary["tokens"] == 0


def drive(learners, shapes, steps: range, delta_of) -> dict[int, list]:
    """The insiders report ``steps`` and answer every ask with ``delta_of(m, fragment)``;
    learner 1 claims 10^12 tokens in every report and answer, and running totals (syncer/
    totals.py) far beyond them, as if reports had been lost. Returns the last value of each
    fragment broadcast to learner 0 (decoded)."""
    fragments: dict[int, list] = {}

    def totals(m: int, step: int) -> dict[str, Any]:
        if m == 1:
            return {"total": 10**15 * step, "rebases": [step, step]}
        return {"total": 256 * step, "rebases": [0, 0]}

    for step in steps:
        for m, learner in learners.items():
            tokens = 10**12 if m == 1 else 256
            meta = {
                "inc": learner.wire.session,
                "step": step,
                "tokens": tokens,
                "secs": 0.01,
                "rebased": [],
                **totals(m, step),
            }
            learner.send("progress", meta=meta)
        time.sleep(0.05)
        for m, learner in learners.items():
            while (msg := learner.recv(0.05)) is not None:
                f = msg.header.fragment
                if msg.kind == "fragment" and m == 0:
                    fragments[f] = [t.clone() for t in decode_update(msg.payload)]
                if msg.kind != "ask":
                    continue
                learner.seq = getattr(learner, "seq", -1) + 1
                meta = {
                    "learner": m,
                    "incarnation": learner.wire.session,
                    "seq": learner.seq,
                    "fragment": f,
                    "round_id": msg.header.round,
                    "base_version": 0,
                    "local_step": step,
                    "c_steps": 2,
                    "c_tokens": 10**12 if m == 1 else 512,
                    **totals(m, step + 1),  # (ahead of the last report: it was "lost")
                }
                payload = encode_tensors(delta_of(m, f), CodecSpec("fp32"))
                learner.send(
                    "answer", fragment=f, round=msg.header.round, meta=meta, payload=payload
                )
    return fragments


def test_lies_about_tokens_and_huge_or_zero_deltas_neither_take_nor_freeze_the_merge(tmp_path):
    syncer = SyncerProcess(tmp_path, ["train.batch_size=4", "sync.max_staleness=1000"])
    setup = RunSetup(syncer.config)
    per_step = 4 * setup.seq_len  # batch x sequence length: what one step can hold
    initial = [[t.detach().clone() for t in gather(setup.plan, p, setup.initial)] for p in range(2)]
    honest = [[torch.full_like(t, 1e-3) for t in frag] for frag in initial]
    learners = {m: Insider(syncer.address, m=m, session=5 + m) for m in (0, 1)}
    scale = {"liar": 1e6}

    def delta_of(m: int, f: int) -> list:
        return honest[f] if m == 0 else [t * scale["liar"] for t in honest[f]]

    try:
        for learner in learners.values():
            learner.register()
        drive(learners, None, range(1, 13), delta_of)  # a delta a million times too long
        scale["liar"] = 0.0
        fragments = drive(learners, None, range(13, 37), delta_of)  # a zero delta
        scale["liar"] = 1.0
        drive(learners, None, range(37, 49), delta_of)  # a sane delta, claiming 10^12 tokens
        summary = syncer.stop()
    finally:
        for learner in learners.values():
            learner.close()
        syncer.kill()
    answers = summary["answers"]
    assert answers.get("outlier_absurd", 0) >= 1 and answers.get("outlier_zero", 0) >= 1
    assert summary["rounds"] > 0 and fragments  # the honest learner's answers still merge
    for f, values in fragments.items():
        moved = max(float((v - i).abs().max()) for v, i in zip(values, initial[f], strict=True))
        assert all(bool(torch.isfinite(v).all()) for v in values)
        assert 1e-5 < moved < 1.0  # moved by the honest answers, not frozen, not blown up
    # 10^12 tokens claimed in every report, credited at most one step's worth per step
    assert summary["tokens"] <= 2 * 48 * per_step
    assert summary["service"]["progress_capped"] >= 1
    assert answers.get("capped", 0) >= 1  # its merge weight: what was credited, not claimed
