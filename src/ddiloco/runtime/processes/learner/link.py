"""A learner's link to the syncer: a background thread, so training never waits on the network.

Owns the learner's DEALER socket. The training loop hands it progress reports and answer
snapshots (queues, never blocking) and, between two steps, takes the asks and the merged
fragments that arrived. The thread encodes answers (the codec runs here, not in the training
loop), keeps every answer until the syncer has merged or dropped it, and re-pushes them
after the syncer restarts (the core recognises duplicates, so a re-push is never applied
twice). When the syncer goes silent it reconnects with capped exponential backoff and
jitter, and registers again. No algorithm logic: the core's LearnerSync stays in the
training thread.

Liveness does not depend on the training thread: while LIVE the thread sends a ``beat``
whenever it has sent nothing for ``beat_seconds``, so a learner in a step or an evaluation of
any length is alive to the syncer; a frozen (SIGSTOPped) or killed process sends nothing and
is detected as before. Torch releases the GIL in its kernels and Python code yields it every
few milliseconds, so this thread gets its turns; a turn that comes late (an overloaded
machine) is measured and said (:attr:`SyncerLink.longest_gap`).

The link is always in one :class:`LinkState`: UNREGISTERED (started; the training thread
has not asked for a hello yet), HELLO (saying hello, with capped backoff, until a welcome),
LIVE (welcomed by the current syncer life; a rehello, a new syncer session or a silence sends
it back to HELLO), STOPPED (the syncer said ``stop``: the run is over, and the syncer closes
its socket while this learner finishes its step; its silence then is no reason to reconnect),
FAILED (the learner must stop; :attr:`SyncerLink.fatal` says why). STOPPED and FAILED are
final. What the syncer told that outlives a connection (the final rounds began, an operator
asked this learner to leave) is kept as :class:`Order` values. Both change in one method each, under
one condition the training thread waits on (:meth:`SyncerLink.await_welcome`). The
training thread hands it the protocol's messages (``protocol.Progress``, ``Hello``, ``Bye``,
``AskPeers``; an answer as a :class:`Push`, encoded here) through one queue, so their order is
kept. What the syncer sends is parsed into its message class (every field checked: a
malformed one is dropped, counted and said) and handed to its entry in
:attr:`SyncerLink.handlers`.

It never trains alone in silence: a syncer that refuses its credentials (wrong secret or run
id), or one that has not answered for ``give_up_seconds``, sets :attr:`SyncerLink.fatal` to
a message naming the cause, and the learner stops with it.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any, assert_never

import zmq

from ddiloco.core.codec import CodecSpec, encode_tensors
from ddiloco.core.learner_state import Answer
from ddiloco.errors import DDiLoCoError
from ddiloco.runtime.processes import protocol
from ddiloco.runtime.processes.learner.inbox import FragmentInbox
from ddiloco.runtime.processes.learner.pending import Key, PendingAnswers
from ddiloco.runtime.processes.transport.auth import HandshakeWatch, dial, hang_up
from ddiloco.runtime.processes.transport.ratelog import RateLimitedLog
from ddiloco.runtime.processes.transport.sockets import Backoff, Socket, received
from ddiloco.runtime.processes.transport.wire import (
    FLAG_SHM,
    PREFIX,
    Header,
    Part,
    Wire,
    WireError,
    payload_size,
)

log = logging.getLogger(__name__)


KILLED_EXIT = 1  # a learner killed from the status page exits as a crashed one (restarted)
INVALID_RESYNC = 8  # answers refused as invalid in a row before the link registers again
INVALID_RESYNCS = 3  # ... and registrations that did not help before the learner stops


class LinkState(Enum):
    UNREGISTERED = "unregistered"
    HELLO = "hello"
    LIVE = "live"
    STOPPED = "stopped"
    FAILED = "failed"


SETTLED = (LinkState.LIVE, LinkState.STOPPED, LinkState.FAILED)  # past saying hello
FINAL = (LinkState.STOPPED, LinkState.FAILED)


class Order(Enum):
    """What the syncer ordered this learner that outlives a connection (kept across
    reconnects; the training thread reads it between two steps)."""

    FINISH = "finish"  # a final ask came: the syncer's final rounds, train no more
    LEAVE = "leave"  # an operator asked this learner to leave


@dataclass(frozen=True)
class Push:
    """An answer to encode, send, and keep until the syncer acknowledges it."""

    answer: Answer
    ranks: int = 1  # > 1: rank 0's part of a sharded learner's answer (core/parts.py)


# what the training thread hands the link, in order: the protocol's messages but an answer
# (its delta is encoded here, on the link's thread); a Hello says hello (again) until welcomed
Outgoing = protocol.Progress | Push | protocol.Hello | protocol.Bye | protocol.AskPeers
Peers = protocol.Peers


class SyncerLink(threading.Thread):
    """The network side of one learner."""

    def __init__(
        self,
        address: str,
        wire: Wire,
        learner: int,
        codec: CodecSpec,
        shapes: list[list[tuple[int, ...]]],
        *,
        silence_seconds: float = 3.0,
        beat_seconds: float = 1.0,
        max_pending: int = 64,
        give_up_seconds: float = 60.0,
    ) -> None:
        super().__init__(name=f"syncer-link-{learner}", daemon=True)
        self.address = address
        self.wire = wire
        self.learner = learner
        self.codec = codec
        self.shapes = shapes
        self.silence = silence_seconds
        self.beat = beat_seconds  # say something at least this often while LIVE
        self.give_up = give_up_seconds
        self.fatal: str | None = None  # why this learner must stop (set once, by the thread)
        self.watch: HandshakeWatch | None = None
        self.failed_handshakes = 0  # not for our credentials: a restart, or not a syncer
        self.last_welcome = time.monotonic()  # since when we have been without a syncer
        self.backoff = Backoff(0.2, 2.0)
        self.outbox: queue.SimpleQueue[Outgoing] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._asks: dict[int, int] = {}
        self.inbox = FragmentInbox(shapes, f"learner {learner}", self.wire.refused)
        self.pending = PendingAnswers(max_pending)  # until the syncer acknowledges each
        self.status: protocol.Hello | None = None  # what a hello says (training thread's)
        self.state = LinkState.UNREGISTERED  # changed by _enter only, under _changed
        self.orders: set[Order] = set()  # added to by _order only, under _changed
        self._changed = threading.Condition()  # whoever waits on the state wakes on a change
        self.welcome: protocol.Welcome | None = None
        self._closing = threading.Event()  # close(): the thread's own end, not the link's
        self._peers: queue.SimpleQueue[Peers] = queue.SimpleQueue()
        self._asking_peers = False  # a request_peers call is waiting
        self.syncer_session: int | None = None
        self.reconnects = 0
        self.invalid_in_a_row = 0  # answers the syncer refused as invalid since one was not
        self.resyncs = 0  # registrations for that reason since an answer was not refused
        self.next_hello = 0.0
        self.carry: protocol.Progress | None = None  # progress not yet delivered
        # this life's running totals (tokens reported, rebases per fragment), stamped on every
        # report and answer: the syncer counts a lost report from the next message
        self.total_tokens = 0
        self.rebases = [0] * len(shapes)
        self.bytes_sent = 0
        self.bytes_received = 0
        self.ctx: zmq.Context[Socket] = zmq.Context.instance()
        self.sock: Socket | None = None
        self.last_rx = time.monotonic()
        self.last_tx = time.monotonic()
        self.longest_gap = 0.0  # the longest this thread went without a turn (GIL, CPU)
        self.say = RateLimitedLog(log)
        # the syncer's messages, by kind, and who handles each (docs/extending.md); a kind
        # not here is ignored, as an older learner does (a challenge is answered first)
        self.handlers: dict[str, Callable[[Any, Header, memoryview], None]] = {
            "challenge": lambda *_: None,
            "ask": self._on_ask,
            "fragment": self._on_fragment,
            "verdict": self._on_verdict,
            "welcome": self._on_welcome,
            "rehello": lambda *_: self._rehello(),
            "beat": self._on_beat,
            "peers": lambda peers, *_: self._peers.put(peers),
            "stop": lambda *_: self._enter(LinkState.STOPPED),
            "leave": self._on_leave,
            "kill": self._on_kill,
            "refused": self._on_refused,
            "no_shm": self._on_no_shm,
        }

    # -- the training thread's side (never blocks, but await_welcome) -----------------------
    @property
    def stopped(self) -> bool:
        """The syncer said stop: the run is over."""
        return self.state is LinkState.STOPPED

    @property
    def finishing(self) -> bool:
        """The syncer's final rounds began (set before their first ask is handed over)."""
        return Order.FINISH in self.orders

    @property
    def asked_to_leave(self) -> bool:
        return Order.LEAVE in self.orders

    def await_welcome(self, timeout: float | None = None) -> bool:
        """Wait until the link is past saying hello: LIVE, or final (STOPPED, FAILED: there
        is no welcome to wait for); False if ``timeout`` passed first."""
        with self._changed:
            return self._changed.wait_for(lambda: self.state in SETTLED, timeout)

    def progress(self, report: protocol.Progress) -> None:
        self.outbox.put(report)

    def push(self, answer: Answer, ranks: int = 1) -> None:
        """Send ``answer`` (``ranks`` > 1: rank 0's part of it, its rows; the other ranks
        send theirs on their own links, learner/part_link.py)."""
        self.outbox.put(Push(answer, ranks))

    def register(self, hello: protocol.Hello) -> None:
        self.status = hello
        self.outbox.put(hello)

    def bye(self, why: str) -> None:
        self.outbox.put(protocol.Bye(why))

    def take_asks(self) -> dict[int, int]:
        with self._lock:
            asks, self._asks = self._asks, {}
        return asks

    def take_inbox(self) -> dict[int, tuple[int, list[Any]]]:
        return dict(self.inbox.take())

    def request_peers(self, timeout: float) -> Peers:
        """Ask the syncer for the live peers' recovery addresses (used before training)."""
        deadline = time.monotonic() + timeout
        while not self._peers.empty():  # answers to an earlier ask (sent again): stale now
            self._peers.get_nowait()
        self._asking_peers = True
        try:
            while time.monotonic() < deadline and self.fatal is None:
                self.outbox.put(protocol.AskPeers())
                try:  # (an ask before the link is up is lost; one to no syncer session is
                    # answered with a rehello, and asked again at once: see _handle)
                    return self._peers.get(timeout=0.25)
                except queue.Empty:
                    continue
            return protocol.Peers({})
        finally:
            self._asking_peers = False

    def close(self, flush_seconds: float = 0.5) -> None:
        """Stop the thread once it has sent what is queued (a goodbye, the last progress),
        waiting up to ``flush_seconds`` for that."""
        if self.state is not LinkState.UNREGISTERED:
            deadline = time.monotonic() + flush_seconds
            while not self.outbox.empty() and time.monotonic() < deadline:
                time.sleep(0.01)
            time.sleep(0.05)  # the item taken last: sent by the thread, written by zmq's
        self._closing.set()
        self.join(timeout=5.0)
        self.wire.close()

    # -- the thread -------------------------------------------------------------------------
    def run(self) -> None:
        self._connect()
        turned = time.monotonic()
        while not self._closing.is_set() and self.fatal is None:
            gap = time.monotonic() - turned
            turned += gap
            if gap > self.longest_gap:  # a turn takes ~20 ms; much more: starved (said)
                self.longest_gap = gap
                if gap > self.beat:
                    log.warning(
                        "learner %d: the link thread did not run for %.1fs (stopped, an "
                        "overloaded machine, or native code holding the GIL); the syncer "
                        "gives a learner up after processes.detect_seconds of silence",
                        self.learner,
                        gap,
                    )
            assert self.sock is not None
            assert self.watch is not None
            refused = self.watch.poll()
            if refused is not None:
                self._fail(f"the syncer at {refused}")
                break
            self.failed_handshakes += self.watch.failures
            self.watch.failures = 0
            if self.watch.renew and self.state is LinkState.STOPPED:
                self.watch.renew = False  # the run is over: the syncer closed, as it should
            elif self.watch.renew:  # its one-time ticket is spent: zmq must not reuse it
                self._reconnect("the connection to the syncer closed")
            if self.sock.poll(20):
                for frames in received(self.sock):
                    self._handle(frames)
            self._drain()
            now = time.monotonic()
            if self.state is LinkState.HELLO and now >= self.next_hello:
                self._hello()  # until the syncer answers, with capped, jittered backoff
            elif self.state is LinkState.LIVE and now - self.last_rx > self.silence:
                self._reconnect(f"syncer silent for {now - self.last_rx:.1f}s")
            elif self.state is LinkState.LIVE and now - self.last_tx > self.beat:
                self._send(
                    protocol.Beat()
                )  # alive mid-step, mid-evaluation: whatever training does
            if self.state is LinkState.HELLO:
                if now - self.last_welcome > self.give_up:
                    failed = self.failed_handshakes
                    hint = (
                        (f"; {failed} handshakes failed: is it a ddiloco syncer of this version?")
                        if failed
                        else ""
                    )
                    self._fail(
                        f"no syncer answered at {self.address} for {self.give_up:.0f}s "
                        "(not started, already finished, or unreachable); giving up "
                        f"(processes.give_up_seconds){hint}"
                    )
            else:
                self.last_welcome = now
                self.failed_handshakes = 0
        self._disconnect()

    def _fail(self, why: str) -> None:
        log.error("learner %d: %s", self.learner, why)
        self.fatal = why
        self._enter(LinkState.FAILED)  # whoever waits for a welcome wakes: there is none

    def _enter(self, state: LinkState) -> None:
        """The one place the state changes (whoever waits on it wakes)."""
        with self._changed:
            if self.state in FINAL:
                return
            self.state = state
            self._changed.notify_all()

    def _order(self, order: Order) -> None:
        """The one place what the syncer ordered is kept."""
        with self._changed:
            self.orders.add(order)
            self._changed.notify_all()

    def _rehello(self) -> None:
        """Back to saying hello (if registered): the syncer does not know this life."""
        if self.state in (LinkState.HELLO, LinkState.LIVE):
            self._enter(LinkState.HELLO)
            self._hello()

    def _connect(self) -> None:
        w = self.wire
        self.sock, self.watch = dial(self.ctx, w.limits, w.secret, w.run, w.sender, self.address)
        self.last_rx = time.monotonic()

    def _disconnect(self) -> None:
        self.sock, self.watch = hang_up(self.sock, self.watch)

    def _reconnect(self, why: str) -> None:
        """The syncer went silent, or the connection closed: drop the socket (and whatever
        zmq queued in it) and start over on a new one, with a fresh ticket (zmq would
        reconnect with the spent one); hellos follow with capped exponential backoff and
        jitter until welcomed."""
        log.warning("learner %d: %s; reconnecting", self.learner, why)
        self._disconnect()
        if self.state is LinkState.LIVE:
            self._enter(LinkState.HELLO)
        self.reconnects += 1
        self._connect()
        self.next_hello = time.monotonic() + self.backoff.next_delay()

    def _hello(self) -> None:
        if self.status is not None:
            self._send(self.status)
        self.next_hello = time.monotonic() + self.backoff.next_delay()

    def _send(self, message: protocol.Message, **kw: Any) -> list[Part] | None:
        """Encode and send one frame (``kw``: the header's fragment and round, the payload);
        its parts, or None if zmq could not take it."""
        assert self.sock is not None
        to = self.syncer_session or 0
        parts = self.wire.encode(
            message.KIND, learner=self.learner, to=to, meta=message.meta(), **kw
        )
        try:
            self.sock.send_multipart(parts, zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return None
        self.bytes_sent += payload_size(parts)
        self.last_tx = time.monotonic()
        return parts

    def _drain(self) -> None:
        while True:
            try:
                item = self.outbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(item, Push):
                self._answer(item.answer, item.ranks)
            elif isinstance(item, protocol.Progress):
                self._progress(item)
            elif isinstance(item, protocol.Hello):
                if self.state in FINAL:
                    continue  # final: the run is over, or this learner must stop
                if self.state is not LinkState.LIVE:
                    self._enter(LinkState.HELLO)
                self._hello()
            elif isinstance(item, protocol.Bye | protocol.AskPeers):
                self._send(item)
            else:  # a new Outgoing kind without its branch: mypy says so, and so does this
                assert_never(item)

    def _progress(self, report: protocol.Progress) -> None:
        """Send a progress report; while unregistered (or unsent), fold it into the next one,
        so the syncer's ledger sees every trained token and rebase, in order. It carries the
        life's running totals too (one sent and lost on the way is counted from the next)."""
        self.total_tokens += report.tokens
        for p in set(report.rebased):
            self.rebases[p] += 1
        report = dataclasses.replace(report, totals=self._totals())
        if self.carry is not None:
            report = dataclasses.replace(
                report,
                tokens=self.carry.tokens + report.tokens,
                rebased=sorted({*self.carry.rebased, *report.rebased}),
            )
            self.carry = None
        if not (self.state is LinkState.LIVE and self._send(report) is not None):
            self.carry = report

    def _totals(self) -> protocol.Totals:
        return self.total_tokens, list(self.rebases)

    def _answer(self, answer: Answer, ranks: int) -> None:
        message = protocol.Answer(answer.meta, self._totals(), ranks)
        payload = encode_tensors(answer.delta, self.codec)
        self.pending.add(message, payload)
        if self.state is LinkState.LIVE:
            self._send_answer(message.answer.key)

    def _send_answer(self, key: Key) -> None:
        """Send a pending answer (:mod:`.pending`): it stays pending until the syncer
        acknowledges it, and so does the shared-memory slot it went in, which the next
        answers must not overwrite (the syncer may not have read it yet)."""
        entry = self.pending[key]
        answer = entry.message.answer
        parts = self._send(
            entry.message,
            fragment=answer.fragment,
            round=answer.round_id,
            payload=entry.payload,
            busy=self.pending.slots(),
        )
        if parts is not None:
            entry.session = self.syncer_session
            if PREFIX.unpack_from(parts[0], 0)[2] & FLAG_SHM:
                entry.slot = bytes(parts[1])

    def _handle(self, frames: list[zmq.Frame]) -> None:
        try:
            msg = self.wire.decode([f.buffer for f in frames])
        except WireError as exc:
            if exc.reason == "shm_missing":  # the syncer sees another /dev/shm than ours
                self._send(protocol.Inline())
            return
        h = msg.header
        if h.sender != "S" or h.learner != self.learner:
            return
        if h.to != self.wire.session and not (h.to == 0 and h.kind == "no_shm"):
            self.wire.refused["misaddressed"] += 1  # for an earlier life of this slot
            return
        self.last_rx = time.monotonic()
        self.bytes_received += msg.payload.nbytes
        kind, handler = protocol.FROM_SYNCER.get(h.kind), self.handlers.get(h.kind)
        if kind is None or handler is None:
            return  # a kind this learner does not know: ignored, as an older one does
        try:
            message = kind.parse(h.meta, len(self.shapes))
        except DDiLoCoError as exc:  # authenticated, yet malformed: a buggy syncer
            self.wire.refused["meta"] += 1
            self.say("meta", "learner %d: refused the syncer's %s: %s", self.learner, h.kind, exc)
            return
        if isinstance(message, protocol.Challenge):  # a new connection proves it holds the
            self._prove(h.session, message.nonce)  # secret now
        if h.session != self.syncer_session:  # a syncer (life) we have not talked to yet
            if self.syncer_session is not None:
                log.warning("learner %d: the syncer restarted; registering again", self.learner)
            self.syncer_session = h.session
            if h.kind not in ("welcome", "rehello"):
                self._rehello()
            if self._asking_peers:  # our ask went to no session: it was not read
                self._send(protocol.AskPeers())
        handler(message, h, msg.payload)

    def _on_ask(self, ask: protocol.Ask, h: Header, _: memoryview) -> None:
        if ask.final:  # the run's end: train no more, answer, wait for the stop
            self._order(Order.FINISH)
        with self._lock:  # an older round's ask overtaken on the way is obsolete
            self._asks[h.fragment] = max(h.round, self._asks.get(h.fragment, h.round))

    def _on_verdict(self, verdict: protocol.Verdict, h: Header, _: memoryview) -> None:
        self.pending.forget(verdict.key)
        self._judged(verdict.verdict)

    def _on_welcome(self, welcome: protocol.Welcome, h: Header, _: memoryview) -> None:
        self.welcome = welcome
        self._enter(LinkState.LIVE)
        self.backoff.reset()
        if self.carry is not None:  # trained tokens first, then the answers they back
            self._progress(dataclasses.replace(self.carry, tokens=0, rebased=[]))
        # a restarted syncer lost what was sent to its earlier life
        self._resend(self.pending.not_sent_to(h.session))

    def _on_beat(self, beat: protocol.Beat, h: Header, _: memoryview) -> None:
        if not beat.live:  # the syncer no longer waits for us: say hello to be waited for
            self._rehello()

    def _on_leave(self, leave: protocol.Leave, h: Header, _: memoryview) -> None:
        log.warning("learner %d: asked to leave by %s", self.learner, leave.why[:200])
        self._order(Order.LEAVE)

    def _on_kill(self, kill: protocol.Kill, h: Header, _: memoryview) -> None:
        log.error("learner %d: killed by %s (a crash on purpose)", self.learner, kill.why[:200])
        logging.shutdown()
        os._exit(KILLED_EXIT)

    def _on_refused(self, refused: protocol.Refused, h: Header, _: memoryview) -> None:
        self._fail(f"the syncer refused this learner: {refused.why[:400]}")

    def _on_no_shm(self, _: protocol.NoShm, h: Header, __: memoryview) -> None:
        """The answers that went by shared memory never reached the syncer: send them
        again, inline (else each stays pending, unmerged, until a syncer restart)."""
        if self.wire.shm is None:
            return
        by_shm = self.pending.by_shared_memory()
        log.warning(
            "learner %d: the syncer cannot read our /dev/shm; sending inline (%d pending "
            "answers again)",
            self.learner,
            len(by_shm),
        )
        self.wire.shm.close()
        self.wire.shm = None
        self._resend(by_shm)

    def _judged(self, verdict: str) -> None:
        """An answer refused as ``invalid`` names a fragment version or a round the syncer
        never made: one is a race, many in a row mean this learner's state is not the run's
        (a lying peer's snapshot, a foreign save). Register again: the syncer then refuses
        versions ahead of its own by name, or sends what it holds; if that does not help
        either, stop, saying so, rather than train for nothing."""
        if verdict != "invalid":
            self.invalid_in_a_row = self.resyncs = 0
            return
        self.invalid_in_a_row += 1
        if self.invalid_in_a_row < INVALID_RESYNC:
            return
        self.invalid_in_a_row = 0
        self.resyncs += 1
        if self.resyncs > INVALID_RESYNCS:
            self._fail(
                f"{INVALID_RESYNC * INVALID_RESYNCS} answers refused as invalid, through "
                f"{INVALID_RESYNCS} registrations: this learner's fragment versions or rounds "
                "are not the run's (a foreign save or peer?)"
            )
            return
        log.warning(
            "learner %d: %d answers in a row refused as invalid (a fragment version or round "
            "the syncer never made); registering again to resynchronise",
            self.learner,
            INVALID_RESYNC,
        )
        self._rehello()

    def _prove(self, session: int, nonce: str) -> None:
        """Answer a challenge (syncer/admission.py): the frames this connection sent before
        were dropped unread, so a live link says hello again and re-pushes its answers."""
        self._send(protocol.Proof(nonce[:64]))
        if self.state is LinkState.LIVE and session == self.syncer_session:
            self.pending.unsent()  # (a re-push the syncer did see is recognised, not re-applied)
            self._rehello()

    def _resend(self, keys: list[Key]) -> None:
        """Send pending answers again: the syncer never read them."""
        for key in keys:
            self._send_answer(key)

    def _on_fragment(self, fragment: protocol.Fragment, h: Header, payload: memoryview) -> None:
        if not self.inbox.put(h.fragment, fragment.version, payload):
            return
        # merged answers, and older ones of the same life, fragment and base (superseded
        # or now "base already merged"), need no re-push
        for k in fragment.keys:
            if self.pending.merged(k):
                self.invalid_in_a_row = self.resyncs = 0  # one of ours was merged
