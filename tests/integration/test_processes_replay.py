"""An eavesdropper's capture and a second process with a learner's id take nobody's place.

The PLAIN handshake carries a learner's credential in clear and frames can be captured: a
recorder on loopback relays one learner life's connection to the syncer and keeps every byte
it sent; after the syncer restarts, those bytes are replayed verbatim (handshake and frames)
while a new life of that learner trains: the handshake's one-time ticket is refused (the
restarted syncer read its journal), so nothing reaches the syncer, not even an unterminated
multipart message for libzmq to buffer. A second ``ddiloco learner --id 0`` started by mistake
is told so by name and stops; the first one trains on.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from pathlib import Path

import zmq
from attackers import RUN, SECRET, Insider, SyncerProcess, events_in, rss_bytes, start_learner

from ddiloco.errors import FATAL_EXIT

GIVE_UP = ["--set", "processes.give_up_seconds=5"]


class Recorder(threading.Thread):
    """A TCP relay on loopback that forwards one connection and keeps what the client sent."""

    def __init__(self, target: str) -> None:
        super().__init__(daemon=True)
        host, port = target.rsplit(":", 1)
        self.target = (host, int(port))
        self.server = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.server.getsockname()[1]}"
        self.sent = bytearray()  # client -> server, as it crossed the wire

    def run(self) -> None:
        client, _ = self.server.accept()
        upstream = socket.create_connection(self.target)

        def pump(src: socket.socket, dst: socket.socket, keep: bytearray | None) -> None:
            while data := src.recv(65536):
                if keep is not None:
                    keep.extend(data)
                dst.sendall(data)

        threading.Thread(target=pump, args=(upstream, client, None), daemon=True).start()
        with contextlib.suppress(OSError):
            pump(client, upstream, self.sent)


def zmtp(capture: bytes) -> tuple[tuple[bytes, bytes], list[list[bytes]]]:
    """Read a captured ZMTP 3 client stream: the PLAIN credentials (in clear in its HELLO
    command) and the multipart messages it carried."""
    at, creds, messages, parts = 64, None, [], []  # (after the 64-byte greeting)
    while at < len(capture):
        flags = capture[at]
        if flags & 0x02:
            size, at = int.from_bytes(capture[at + 1 : at + 9], "big"), at + 9
        else:
            size, at = capture[at + 1], at + 2
        body, at = capture[at : at + size], at + size
        if flags & 0x04:  # a command
            if body[1 : 1 + body[0]] == b"HELLO":
                rest = body[1 + body[0] :]
                user, rest = rest[1 : 1 + rest[0]], rest[1 + rest[0] :]
                creds = (user, rest[1 : 1 + rest[0]])
            continue
        parts.append(body)
        if not flags & 0x01:  # the last part
            messages.append(parts)
            parts = []
    assert creds is not None, "no PLAIN HELLO in the capture"
    return creds, messages


def replay(address: str, capture: bytes, times: int = 3) -> int:
    """An eavesdropper: connect with the credentials read off the capture and send the
    captured frames again, on fresh connections; how many frames were sent."""
    (user, password), messages = zmtp(capture)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sent = 0
    try:
        for _ in range(times):
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.plain_username, sock.plain_password = user, password
            sock.connect(f"tcp://{address}")
            for parts in messages:
                sock.send_multipart(parts)
                sent += 1
            time.sleep(1.0)
            sock.close(0)
    finally:
        ctx.term()
    return sent


def flood(address: str, capture: bytes, mib: int = 256) -> int:
    """An eavesdropper's memory attack: the captured greeting and handshake sent again as
    raw bytes, then one multipart message that never ends (1 MiB parts with MORE set), as
    long as the server reads; how many MiB went out. (Against a server that admits the
    handshake, libzmq buffers every part: +509 MiB in 1.8 s measured.)"""
    hello = 64 + 2 + capture[65]  # the greeting, then the HELLO command (short)
    end = at = hello
    while at < len(capture) and capture[at] & 0x04:  # INITIATE: the commands end there
        size = int.from_bytes(capture[at + 1 : at + 9], "big") if capture[at] & 0x02 else None
        at = at + 9 + size if size is not None else at + 2 + capture[at + 1]
        end = at
    host, port = address.rsplit(":", 1)
    part = bytes([0x03]) + (1 << 20).to_bytes(8, "big") + bytes(1 << 20)  # MORE | LONG
    sent = 0
    with socket.create_connection((host, int(port))) as raw:
        raw.settimeout(5.0)
        try:
            raw.sendall(capture[:hello])
            time.sleep(0.5)  # the server's greeting and WELCOME (or ERROR) come back
            raw.recv(65536)
            raw.sendall(capture[hello:end])
            for _ in range(mib):
                raw.sendall(part)
                sent += 1
        except OSError:  # refused: the server closed the connection
            pass
    return sent


def steps_of(path: Path) -> list[dict]:
    return [e for e in events_in(path) if e["kind"] == "step"]


def test_a_replayed_capture_after_a_syncer_restart_locks_no_learner_out(tmp_path):
    (tmp_path / "syncer").mkdir()
    syncer = SyncerProcess(tmp_path / "syncer")
    recorder = Recorder(syncer.address)
    recorder.start()
    # an earlier life of learner 0, through the recorder: handshake, proof, hello, reports
    life = Insider(recorder.address, session=11)
    life.register()
    for step in (1, 2, 3):
        meta = {"inc": 11, "step": step, "tokens": 64, "secs": 0.1, "rebased": []}
        life.send("progress", meta={**meta, "total": 64 * step, "rebases": [0, 0]})
    life.sync()
    life.close()
    capture = bytes(recorder.sent)
    assert len(capture) > 200
    syncer.kill()  # the syncer restarts (same address, same store): it knows no session now
    syncer = SyncerProcess(tmp_path / "syncer", address=syncer.address)
    out = (tmp_path / "learner.out").open("w")
    learner = start_learner(syncer.config_path, syncer.address, SECRET, RUN, *GIVE_UP, stdout=out)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and len(steps_of(tmp_path / "learner.out")) < 3:
            time.sleep(0.2)
        before = len(steps_of(tmp_path / "learner.out"))
        rss = rss_bytes(syncer.proc.pid)
        flooded = flood(syncer.address, capture)  # the eavesdropper, in this syncer life
        grown = rss_bytes(syncer.proc.pid) - rss
        replayed = replay(syncer.address, capture)
        time.sleep(6.0)  # longer than the learner's give-up time
        alive = learner.poll() is None
        summary = syncer.stop()
        learner.wait(timeout=30)
    finally:
        out.close()
        if learner.poll() is None:
            learner.kill()
        syncer.kill()
    assert alive, learner.communicate()[1]
    # the real learner kept training and being merged after the replay
    assert len(steps_of(tmp_path / "learner.out")) > before + 3
    rounds = [e for e in syncer.events if e["kind"] == "round" and e["weights"].get("0")]
    assert rounds and max(r["t"] for r in rounds) > min(r["t"] for r in rounds)
    # the flood behind the replayed handshake cost the syncer nothing: refused at once
    assert flooded < 256 and grown < 64 << 20, (flooded, grown >> 20)
    # the replayed handshakes were refused: no frame reached the syncer, nothing retired
    assert replayed >= 3 * 6  # three connections of proof, hello, 3 reports, peers
    gate = summary["gatekeeper"]
    assert gate.get("refused_replayed", 0) >= 4, gate  # the flood + 3 replays
    assert summary["service"].get("refused_proof", 0) == 0, summary["service"]  # none came
    assert summary["refused"].get("replay", 0) == 0, summary["refused"]
    assert "a connection ticket used before (a replayed capture?)" in syncer.stderr


def test_a_second_process_with_a_learners_id_is_told_so_and_the_first_trains_on(tmp_path):
    syncer = SyncerProcess(tmp_path)
    first_out = (tmp_path / "first.out").open("w")
    first = start_learner(syncer.config_path, syncer.address, SECRET, RUN, stdout=first_out)
    second = None
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and len(steps_of(tmp_path / "first.out")) < 3:
            time.sleep(0.2)
        second = start_learner(syncer.config_path, syncer.address, SECRET, RUN)
        code = second.wait(timeout=90)
        err = second.communicate()[1]
        stopped_at = len(steps_of(tmp_path / "first.out"))
        time.sleep(3.0)
        alive = first.poll() is None
        summary = syncer.stop()
        first.wait(timeout=30)
    finally:
        first_out.close()
        for p in (first, second):
            if p is not None and p.poll() is None:
                p.kill()
        syncer.kill()
    assert code == FATAL_EXIT, err
    assert "learner 0 is already running" in err and "--id 0" in err, err
    assert alive and len(steps_of(tmp_path / "first.out")) > stopped_at  # it trained on
    assert summary["service"].get("refused_second", 0) >= 1, summary["service"]
    assert "refused a second process claiming learner 0" in syncer.stderr
    assert summary["refused"].get("replay", 0) == 0  # the first life was never retired
