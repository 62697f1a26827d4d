"""A sharded learner's rank link (learner/part_link.py) against a stand-in syncer on loopback:
it proves itself when challenged, sends its part of an answer to the syncer life it heard,
keeps it until a verdict, sends it again to a new syncer life, and a refusal is fatal."""

from __future__ import annotations

import time

import torch
import zmq

from ddiloco.core.codec import CodecSpec, decode_tensors
from ddiloco.core.learner_state import Answer
from ddiloco.core.rounds import AnswerMeta
from ddiloco.runtime.processes import protocol
from ddiloco.runtime.processes.launcher.fragments import free_port
from ddiloco.runtime.processes.learner.part_link import PartLink
from ddiloco.runtime.processes.transport.auth import Gatekeeper, link_of, serve_plain
from ddiloco.runtime.processes.transport.wire import Limits, Message, Wire

SECRET, RUN = b"p" * 32, "run"
META = AnswerMeta(1, 5, 3, 0, 2, 1, 10, 4, 256)


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

    def send(self, message: protocol.Message, to: int) -> None:
        parts = self.wire.encode(message.KIND, learner=1, to=to, meta=message.meta())
        self.sock.send_multipart([self.route, *parts])

    def close(self) -> None:
        self.sock.close(0)


def test_a_rank_link_proves_itself_sends_its_part_and_keeps_it_until_a_verdict():
    ctx = zmq.Context()
    gate = Gatekeeper(ctx, SECRET, RUN, lambda n: link_of(n) is not None)
    gate.start()
    port = free_port("127.0.0.1")
    syncer = Syncer(ctx, port, session=101)
    link = PartLink(f"127.0.0.1:{port}", Wire(RUN, SECRET, "L1r1", 55, Limits()), 1, 1, 2,
                    CodecSpec("fp32"), beat_seconds=0.1)  # fmt: skip
    link.start()
    try:
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
        syncer.close()  # the syncer restarts: its new life hears the part again
        syncer = Syncer(ctx, port, session=202)
        beat = syncer.next("beat", timeout=10.0)
        syncer.send(protocol.Rehello(), to=beat.header.session)
        again = syncer.next("answer_part")
        assert again.header.to == 202
        syncer.send(protocol.Verdict(META.key, "merged"), to=beat.header.session)
        deadline = time.monotonic() + 5
        while link.pending and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not link.pending  # acknowledged: never sent again
        syncer.send(protocol.Refused("this rank is not welcome"), to=beat.header.session)
        deadline = time.monotonic() + 5
        while link.fatal is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert link.fatal is not None and "not welcome" in link.fatal
    finally:
        link.close()
        syncer.close()
        gate.close()
        ctx.term()
