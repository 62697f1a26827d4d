"""A sharded learner's rank link (learner/part_link.py) against a stand-in syncer on loopback:
it proves itself when challenged, sends its part of an answer to the syncer life it heard,
keeps it until a verdict, sends it again to a new syncer life, and a refusal is fatal; it
says its learner's versions to each syncer life and keeps the newest rows of each merged
fragment it receives, refusing rows of the wrong shape."""

from __future__ import annotations

import time

import pytest
import torch
import zmq

from ddiloco.core.codec import CodecSpec, decode_tensors, encode_tensors
from ddiloco.core.learner_state import Answer
from ddiloco.core.rounds import AnswerMeta
from ddiloco.runtime.processes import protocol
from ddiloco.runtime.processes.launcher.fragments import free_port
from ddiloco.runtime.processes.learner.part_link import PartLink
from ddiloco.runtime.processes.transport.auth import Gatekeeper, link_of, serve_plain
from ddiloco.runtime.processes.transport.wire import Limits, Message, Wire

SECRET, RUN = b"p" * 32, "run"
META = AnswerMeta(1, 5, 3, 0, 2, 1, 10, 4, 256)
SHAPES = [[(2, 3)], [(4,)], [(1,)], [(2,)]]  # rank 1's rows of each of 4 fragments
FP32 = CodecSpec("fp32")


class Syncer:
    """One syncer life: a ROUTER behind the run's gatekeeper, its own wire session."""

    def __init__(self, ctx: zmq.Context, port: int, session: int) -> None:
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        serve_plain(self.sock)
        for _ in range(50):  # (a closed life's port is freed by zmq's I/O thread, soon)
            try:
                self.sock.bind(f"tcp://127.0.0.1:{port}")
                break
            except zmq.ZMQError:
                time.sleep(0.1)
        self.wire = Wire(RUN, SECRET, "S", session, Limits())
        self.route = b""

    def next(self, kind: str, timeout: float = 5.0) -> Message:
        """The next frame of ``kind`` from the rank link (others skipped)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.sock.poll(100):
                frames = self.sock.recv_multipart(copy=False)
                assert link_of(str(frames[-1].get("User-Id"))) == (1, 1)
                self.route = frames[0].bytes
                msg = self.wire.decode([f.bytes for f in frames[1:]])
                if msg.header.kind == kind:
                    return msg
        raise AssertionError(f"no {kind} frame in {timeout}s")

    def send(self, message: protocol.Message, to: int, **kw: object) -> None:
        parts = self.wire.encode(message.KIND, learner=1, to=to, meta=message.meta(), **kw)  # type: ignore[arg-type]
        self.sock.send_multipart([self.route, *parts])

    def close(self) -> None:
        self.sock.close(0)


class Rig:
    """A rank link (learner 1, rank 1 of 2) and the syncer life it talks to (restartable)."""

    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.gate = Gatekeeper(self.ctx, SECRET, RUN, lambda n: link_of(n) is not None)
        self.gate.start()
        self.port = free_port("127.0.0.1")
        self.syncer = Syncer(self.ctx, self.port, session=101)
        wire = Wire(RUN, SECRET, "L1r1", 55, Limits())
        self.link = PartLink(f"127.0.0.1:{self.port}", wire, 1, 1, 2, FP32, SHAPES,
                             beat_seconds=0.1)  # fmt: skip
        self.link.start()

    def restart(self, session: int) -> Syncer:
        self.syncer.close()
        self.syncer = Syncer(self.ctx, self.port, session)
        return self.syncer

    def close(self) -> None:
        self.link.close()
        self.syncer.close()
        self.gate.close()
        self.ctx.term()


@pytest.fixture
def rig():
    r = Rig()
    yield r
    r.close()


def wait_for(check, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not check() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert check()


def test_a_rank_link_proves_itself_sends_its_part_and_keeps_it_until_a_verdict(rig):
    syncer, link = rig.syncer, rig.link
    beat = syncer.next("beat")  # its first frame, before it knows a syncer life
    syncer.send(protocol.Challenge("n" * 32), to=beat.header.session)
    proof = syncer.next("proof")
    assert proof.header.meta["nonce"] == "n" * 32
    rows = [torch.arange(6.0).view(2, 3)]
    link.push(Answer(META, rows))
    part = syncer.next("answer_part")
    assert part.header.to == 101  # the life it heard (from the challenge)
    got = protocol.AnswerPart.parse(part.header.meta, 4)
    assert got == protocol.AnswerPart(META.key, 0, 1, 2)
    assert torch.equal(decode_tensors(part.payload, expected_shapes=[(2, 3)])[0], rows[0])
    assert list(link.pending) == [META.key]
    syncer = rig.restart(202)  # the syncer restarts: its new life hears the part again
    beat = syncer.next("beat", timeout=10.0)
    syncer.send(protocol.Rehello(), to=beat.header.session)
    again = syncer.next("answer_part")
    assert again.header.to == 202
    syncer.send(protocol.Verdict(META.key, "merged"), to=beat.header.session)
    wait_for(lambda: not link.pending)  # acknowledged: never sent again
    syncer.send(protocol.Refused("this rank is not welcome"), to=beat.header.session)
    wait_for(lambda: link.fatal is not None)
    assert "not welcome" in str(link.fatal)


def test_a_rank_link_says_its_versions_to_each_syncer_life_and_keeps_the_newest_rows(rig):
    syncer, link = rig.syncer, rig.link
    beat = syncer.next("beat")
    syncer.send(protocol.Challenge("n" * 32), to=beat.header.session)
    syncer.next("proof")
    with pytest.raises(AssertionError, match="no part_hello"):  # its versions unknown yet
        syncer.next("part_hello", timeout=0.5)
    link.versions = [0] * 4  # the engine knows them now (a copy, a resume: not before)
    hello = syncer.next("part_hello")  # to the life it heard
    assert hello.header.to == 101
    assert protocol.PartHello.parse(hello.header.meta, 4) == protocol.PartHello(1, 2, [0] * 4)
    to = beat.header.session

    def rows(version: int, fragment: int, values: torch.Tensor) -> None:
        payload = encode_tensors([values], FP32)
        syncer.send(protocol.Fragment(version, []), to, fragment=fragment, payload=payload)

    rows(3, 1, torch.full((4,), 3.0))
    rows(2, 1, torch.full((4,), 2.0))  # an older version, late: not kept
    rows(5, 0, torch.zeros(3, 2))  # rows of another shape: refused, not kept
    rows(1, 2, torch.ones(1))
    wait_for(lambda: link.bytes_received >= 4 * 16)
    time.sleep(0.3)
    inbox = link.inbox.take()
    assert sorted(inbox) == [1, 2]
    assert inbox[1][0] == 3 and torch.equal(inbox[1][1][0], torch.full((4,), 3.0))
    assert inbox[2][0] == 1 and link.inbox.take() == {}  # taken: gone
    link.versions = [0, 3, 1, 0]  # (the engine applied them)
    syncer = rig.restart(202)  # a new syncer life hears the versions the learner holds now
    beat = syncer.next("beat", timeout=10.0)
    syncer.send(protocol.Rehello(), to=beat.header.session)
    hello = syncer.next("part_hello")
    assert hello.header.to == 202
    assert protocol.PartHello.parse(hello.header.meta, 4).versions == [0, 3, 1, 0]
