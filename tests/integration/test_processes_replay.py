"""An eavesdropper's capture and a second process with a learner's id take nobody's place.

The PLAIN handshake carries a learner's credential in clear and frames can be captured: a
recorder on loopback relays one learner life's connection to the syncer and keeps every byte
it sent; after the syncer restarts, those bytes are replayed verbatim (handshake and frames)
while a new life of that learner trains. A second ``ddiloco learner --id 0`` started by
mistake is told so by name and stops; the first one trains on.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from pathlib import Path

import zmq
from attackers import RUN, SECRET, Insider, SyncerProcess, events_in, start_learner

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
        replayed = replay(syncer.address, capture)  # the eavesdropper, in this syncer life
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
    # the replayed frames were dropped unread: counted, said once, nothing retired
    assert replayed >= 3 * 6  # three connections of proof, hello, 3 reports, peers
    service = summary["service"]  # (the replayed proofs echo an old nonce: refused)
    assert service.get("unproven", 0) + service.get("refused_proof", 0) >= replayed, service
    assert service.get("refused_proof", 0) >= 3, service
    assert summary["gatekeeper"].get("accepted", 0) >= 3  # its handshakes did pass
    assert summary["refused"].get("replay", 0) == 0, summary["refused"]
    assert "does not prove it holds the run secret now" in syncer.stderr


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
