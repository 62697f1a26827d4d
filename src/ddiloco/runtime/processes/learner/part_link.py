"""Rank r (>= 1) of a sharded learner: its own authenticated link to the syncer, for its parts.

Every rank of a learner whose parameters are sharded answers its rows of each fragment itself
(core/parts.py): rank 0's part goes with the answer's metadata on the learner's link
(:mod:`.link`), rank r's on this one, as ``L{m}r{r}`` (transport/auth.py's ``link_of``), so no
rank gathers another's rows and each rank's NIC carries 1/R of the learner's answers. The
syncer counts an answer only once all its parts came. The learner's life stays rank 0's
(hello, progress, asks, liveness); this link sends parts and hears their verdicts, and
receives this rank's rows of each merged fragment (syncer/broadcast.py): to a syncer life it
has not spoken to it says which versions its learner holds (``part_hello``, once the engine
knows them: after a copy or a resume, not before), and that life sends the rows of every
newer fragment. The rows wait in its :class:`~.inbox.FragmentInbox`, the
newest of each fragment, until the ranks agree to apply them (learner/sharded_engine.py).

A thread, like the learner's link: the training thread hands it a part (never blocking), the
thread encodes and sends it, and keeps it until the syncer's verdict on it (merged, or
dropped and why). It sends a part again whenever the syncer may not have it: a syncer life
it has not sent it to (it learns a life from any frame of it: a rehello answers its first
frame), or a connection that had to prove itself (the syncer drops an unproven connection's
frames unread). It beats while idle, so a restarted syncer answers it (with a rehello) and
it re-sends what that life never had. A syncer that refuses this link's credentials sets
:attr:`PartLink.fatal`: the learner stops with it (``sharded_engine``).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass

import zmq

from ddiloco.core.codec import CodecSpec, encode_tensors
from ddiloco.core.learner_state import Answer
from ddiloco.errors import DDiLoCoError
from ddiloco.runtime.processes import protocol
from ddiloco.runtime.processes.learner.inbox import FragmentInbox
from ddiloco.runtime.processes.transport.auth import HandshakeWatch, dial, hang_up
from ddiloco.runtime.processes.transport.sockets import Socket, received
from ddiloco.runtime.processes.transport.wire import Wire, WireError, payload_size

log = logging.getLogger(__name__)

Key = tuple[int, int, int]


@dataclass
class PendingPart:
    """One part: what was sent, and to which syncer life (None: not yet)."""

    message: protocol.AnswerPart
    fragment: int
    round_id: int
    payload: bytes
    session: int | None = None


class PartLink(threading.Thread):
    """The network side of one rank (>= 1) of a sharded learner (see the module doc).

    Call order: :meth:`start`, then :meth:`push` per answer this rank makes, :meth:`close`
    once, last."""

    def __init__(
        self,
        address: str,
        wire: Wire,
        learner: int,
        rank: int,
        ranks: int,
        codec: CodecSpec,
        shapes: list[list[tuple[int, ...]]],
        *,
        beat_seconds: float = 1.0,
        max_pending: int = 64,
    ) -> None:
        super().__init__(name=f"part-link-{learner}.{rank}", daemon=True)
        self.address = address
        self.wire = wire
        self.learner, self.rank, self.ranks = learner, rank, ranks
        self.codec = codec
        # the versions the learner holds, set by the engine once it knows them (after a
        # copy, a resume or an apply): said to each syncer life, not before
        self.versions: list[int] | None = None
        # this rank's rows of each merged fragment (core/shards.py), the newest of each
        self.inbox = FragmentInbox(shapes, f"learner {learner} rank {rank}", wire.refused)
        self.hello_session: int | None = None  # the syncer life our versions were said to
        self.beat = beat_seconds
        self.max_pending = max_pending
        self.fatal: str | None = None
        self.pending: dict[Key, PendingPart] = {}  # (the thread's)
        self.syncer_session: int | None = None
        self.bytes_sent = 0
        self.bytes_received = 0
        self.ctx: zmq.Context[Socket] = zmq.Context()
        self.sock: Socket | None = None
        self.watch: HandshakeWatch | None = None
        self.outbox: queue.SimpleQueue[Answer] = queue.SimpleQueue()
        self.last_tx = 0.0
        self._closing = threading.Event()

    def push(self, answer: Answer) -> None:
        """This rank's part of ``answer`` (its rows of the fragment): sent from the thread."""
        self.outbox.put(answer)

    def close(self, flush_seconds: float = 0.5) -> None:
        """Send what is queued (for at most ``flush_seconds``), then stop and close."""
        deadline = time.monotonic() + flush_seconds
        while not self.outbox.empty() and time.monotonic() < deadline and self.is_alive():
            time.sleep(0.01)
        self._closing.set()
        if self.is_alive():
            self.join(timeout=5.0)
        self.ctx.term()

    # -- the thread -------------------------------------------------------------------------
    def run(self) -> None:
        self._connect()
        while not self._closing.is_set() and self.fatal is None:
            assert self.sock is not None and self.watch is not None
            refused = self.watch.poll()
            if refused is not None:
                self._fail(f"the syncer at {refused}")
                break
            if self.watch.renew:  # its one-time ticket is spent: a new socket, a new ticket
                self._disconnect()
                self._connect()
                self._unsent()
            if self.sock.poll(20):
                for frames in received(self.sock):
                    self._handle(frames)
            while not self.outbox.empty():
                self._add(self.outbox.get_nowait())
            self._hello()
            if time.monotonic() - self.last_tx > self.beat:
                self._send(protocol.Beat())
        self._disconnect()

    def _fail(self, why: str) -> None:
        log.error("learner %d rank %d: %s", self.learner, self.rank, why)
        self.fatal = why

    def _connect(self) -> None:
        w = self.wire  # (its sender is this rank's link name)
        self.sock, self.watch = dial(self.ctx, w.limits, w.secret, w.run, w.sender, self.address)

    def _disconnect(self) -> None:
        self.sock, self.watch = hang_up(self.sock, self.watch)

    def _send(self, message: protocol.Message, **kw: object) -> bool:
        assert self.sock is not None
        parts = self.wire.encode(
            message.KIND,
            learner=self.learner,
            to=self.syncer_session or 0,
            meta=message.meta(),
            inline=True,
            **kw,  # type: ignore[arg-type]
        )
        try:
            self.sock.send_multipart(parts, zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return False
        self.bytes_sent += payload_size(parts)
        self.last_tx = time.monotonic()
        return True

    def _add(self, answer: Answer) -> None:
        meta = answer.meta
        message = protocol.AnswerPart(meta.key, meta.fragment, self.rank, self.ranks)
        entry = PendingPart(
            message, meta.fragment, meta.round_id, encode_tensors(answer.delta, self.codec)
        )
        self.pending[meta.key] = entry
        while len(self.pending) > self.max_pending:  # its round is long closed
            del self.pending[next(iter(self.pending))]
        self._send_part(entry)

    def _send_part(self, entry: PendingPart) -> None:
        if self.syncer_session is None:
            return  # no syncer life heard yet: sent once one answers our beat
        ok = self._send(
            entry.message, fragment=entry.fragment, round=entry.round_id, payload=entry.payload
        )
        if ok:
            entry.session = self.syncer_session

    def _unsent(self) -> None:
        """The syncer did not read what this connection sent before: every part again, and
        the versions we hold."""
        for entry in self.pending.values():
            entry.session = None
        self.hello_session = None

    def _resend(self) -> None:
        for entry in list(self.pending.values()):
            if entry.session != self.syncer_session:
                self._send_part(entry)

    def _handle(self, frames: list[zmq.Frame]) -> None:
        try:
            msg = self.wire.decode([f.buffer for f in frames])
        except WireError:
            return  # counted and logged by the wire
        h = msg.header
        self.bytes_received += msg.payload.nbytes
        if h.sender != "S" or h.learner != self.learner or h.to != self.wire.session:
            self.wire.refused["misaddressed"] += 1
            return
        kind = protocol.FROM_SYNCER.get(h.kind)
        if kind is None:
            return
        try:
            message = kind.parse(h.meta, 1 << 30)
        except DDiLoCoError:
            self.wire.refused["meta"] += 1
            return
        if isinstance(message, protocol.Challenge):  # frames before the proof went unread
            self._send(protocol.Proof(message.nonce[:64]))
            self._unsent()
        elif isinstance(message, protocol.Verdict):
            self.pending.pop(message.key, None)
        elif isinstance(message, protocol.Fragment):
            self.inbox.put(h.fragment, message.version, msg.payload)
        elif isinstance(message, protocol.Refused):
            self._fail(f"the syncer refused this rank's link: {message.why[:400]}")
            return
        if h.session != self.syncer_session:  # a syncer life we have not sent to
            self.syncer_session = h.session
        self._hello()
        self._resend()

    def _hello(self) -> None:
        """Say the learner's versions to a syncer life we have not said them to."""
        versions = self.versions
        if versions is None or self.syncer_session in (None, self.hello_session):
            return
        if self._send(protocol.PartHello(self.rank, self.ranks, list(versions))):
            self.hello_session = self.syncer_session
