"""The syncer's socket: who is on the other end of each frame, and how to reach them.

One concern, kept apart from the protocol (:mod:`.service`): the PLAIN server behind a
:class:`Gatekeeper` (only a holder of the run secret completes a handshake, as the learner
its credentials name), the wire's checks, and the routes. A frame reaches the service only
if its signed sender is the learner its connection authenticated as, and it is addressed to
this syncer life's session; a learner's route is the connection its latest such frame came
on (no routing id can be taken over). A frame for an earlier life of ours (or a first hello,
which knows none) gets a ``rehello`` carrying this life's session, at most every
``REHELLO_SECONDS`` per learner, and nothing else happens. Every refusal is counted and
logged rate-limited (a flood stays one line); nothing here raises on what a peer sends.

The socket belongs to a network thread of its own (decision 87), so the syncer's liveness
never depends on its work: the thread receives and checks every frame (stamping when it came),
forwards what the service sends, and beats every learner of :attr:`beats` every
``BEAT_SECONDS`` whatever the service's loop is doing (a long merge, a store write). The
service's thread never touches the socket: it takes checked messages from a queue and hands
frames over an inproc pipe. Counters are shared: each key is incremented by one thread only
(the network thread: the wire's and the handshake's refusals, ``rehello``, ``send_dropped``),
so no increment is lost.

Call order: :meth:`receive` (or :meth:`poll` first) in the loop; :meth:`send` any time after
the constructor, from the service's thread; :meth:`close` once, last.
"""

from __future__ import annotations

import faulthandler
import itertools
import logging
import os
import queue
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import zmq

from ddiloco.runtime.processes import protocol
from ddiloco.runtime.processes.syncer.admission import Admission, Verdict
from ddiloco.runtime.processes.transport.auth import (
    Gatekeeper,
    HandshakeCounter,
    Link,
    link_of,
    serve_plain,
)
from ddiloco.runtime.processes.transport.ratelog import RateLimitedLog, Throttle
from ddiloco.runtime.processes.transport.shm import writer_for
from ddiloco.runtime.processes.transport.sockets import Socket, configure, new_session
from ddiloco.runtime.processes.transport.tickets import TicketBook
from ddiloco.runtime.processes.transport.wire import (
    Header,
    Limits,
    Wire,
    WireError,
    payload_size,
)

log = logging.getLogger(__name__)

REHELLO_SECONDS = 0.25  # at most one rehello per learner this often
BEAT_SECONDS = 0.5  # every learner hears from the syncer at least this often
BUSY_WARN_SECONDS = 10.0  # the service's loop not turning this long is said (once a spell)
BURST = 256  # frames taken from the socket before the pipe and the beats get a turn
UNPROVEN_SAID = 3  # unproven frames from one connection before it is said
_pipes = itertools.count()


STUCK_EXIT = 70  # a syncer whose loop stopped turning exits so (EX_SOFTWARE): restarted


def exit_stuck(seconds: float) -> None:
    """End a syncer whose service loop has not turned for ``seconds``: say so, dump every
    thread's stack (where it is stuck), and exit at once, without the loop's cooperation
    (it is the part that is stuck). Its launcher, SLURM script or Ray restarts it from its
    store; what it acknowledged is there."""
    log.error(
        "syncer: the main loop has not turned for %.0fs (processes.stuck_seconds): stuck; "
        "exiting (code %d) to be restarted from the store, so that the learners do not "
        "train alone behind this process's beats. Every thread's stack follows.",
        seconds,
        STUCK_EXIT,
    )
    for handler in logging.getLogger().handlers:
        handler.flush()
    faulthandler.dump_traceback(all_threads=True)
    sys.stderr.flush()
    os._exit(STUCK_EXIT)


@dataclass(frozen=True)
class Incoming:
    """An authenticated message for this syncer life, from learner ``learner``."""

    learner: int
    kind: str
    meta: dict[str, Any]
    payload: memoryview
    at: float = 0.0  # when it came (the service's clock), however late the loop reads it
    rank: int = 0  # > 0: on rank ``rank``'s link of a sharded learner (its answer parts)


class Connections:
    """The syncer's ROUTER socket and what it knows of each learner's connection."""

    def __init__(
        self,
        bind: str,
        run_id: str,
        secret: bytes,
        slots: int,
        limits: Limits,
        shm: bool,
        clock: Callable[[], float] = time.monotonic,
        tickets: TicketBook | None = None,
        stuck_seconds: float = 0.0,
        on_stuck: Callable[[float], None] | None = None,
    ) -> None:
        """``stuck_seconds`` (0: never): a service loop that has not turned this long is
        stuck; the network thread stops beating and calls ``on_stuck(seconds)`` (by default
        :func:`exit_stuck`: the process ends, to be restarted from its store)."""
        self.slots = slots
        self.stuck_seconds = stuck_seconds
        self.on_stuck = on_stuck or exit_stuck
        self.clock = clock
        session = new_session()
        writer = writer_for(run_id, "S", session, bind.rpartition(":")[0], shm)
        self.wire = Wire(run_id, secret, "S", session, limits, shm=writer)
        self.ctx: zmq.Context[Socket] = zmq.Context()
        self.gate = Gatekeeper(self.ctx, secret, run_id, self.is_member, tickets=tickets)
        self.gate.start()  # before the bind: no handshake goes unchecked
        self.sock = self.ctx.socket(zmq.ROUTER)
        configure(self.sock, limits)
        serve_plain(self.sock)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.counts: dict[str, int] = defaultdict(int)
        self.say = RateLimitedLog(log)
        self.handshakes = HandshakeCounter(self.sock, self.counts, self.say)  # before the bind
        self.sock.bind(f"tcp://{bind}")
        self.routes: dict[int, bytes] = {}  # learner -> its authenticated connection
        self.sessions: dict[int, int] = {}  # learner -> the session its frames come from
        # a sharded learner's rank links (learner, rank >= 1): the same, for its parts only
        self.part_routes: dict[Link, bytes] = {}
        self.part_sessions: dict[Link, int] = {}
        self.rehellos = Throttle(REHELLO_SECONDS)  # per learner
        self.inline: set[int] = set()  # learners that cannot read our /dev/shm slots
        self.bytes_sent = 0
        self._tally = threading.Lock()  # bytes_sent and send_unrouted: counted by both threads
        # learner -> live?: who the network thread beats (replaced whole by the service)
        self.beats: dict[int, bool] = {}
        self.heard: dict[int, float] = {}  # learner -> when its latest checked frame came
        self._heard_mono: dict[int, float] = {}  # ... on this process's monotonic clock
        self.admission = Admission()  # which connections proved themselves (network thread)
        self.stale = Throttle(1.0)  # a replaced life is told so at most once a second
        self.turned = time.monotonic()  # the service's loop's latest turn (see :meth:`poll`)
        self._inbox: queue.SimpleQueue[Incoming] = queue.SimpleQueue()
        self._next: Incoming | None = None
        pipe = f"inproc://syncer-sends-{next(_pipes)}"
        self._pipe_in = self.ctx.socket(zmq.PULL)  # the network thread's end
        self._pipe_in.bind(pipe)
        self._pipe_out = self.ctx.socket(zmq.PUSH)  # the service's end
        self._pipe_out.setsockopt(zmq.SNDHWM, 0)  # never dropped here: the socket decides
        self._pipe_out.connect(pipe)
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="syncer-network", daemon=True)
        self._thread.start()

    @property
    def session(self) -> int:
        """This syncer life's session: frames addressed to another are not acted on."""
        return self.wire.session

    def is_member(self, name: str) -> bool:
        """Which names may connect: the run's learner slots (and their ranks' links)."""
        link = link_of(name)
        return link is not None and link[0] < self.slots

    def refuse(self, reason: str, m: int | None, why: str) -> None:
        """Count one refused message and say why (rate-limited)."""
        self.counts[reason] += 1
        self.say(
            reason,
            "syncer: refused a message from %s: %s (%s)",
            "?" if m is None else f"learner {m}",
            why,
            reason,
        )

    def poll(self, seconds: float) -> bool:
        """Wait at most ``seconds`` for a checked message; a call is the loop's turn."""
        self.turned = time.monotonic()
        if self._next is None:
            try:
                self._next = self._inbox.get(timeout=max(0.001, seconds))
            except queue.Empty:
                return False
        return True

    def receive(self) -> Incoming | Literal[False] | None:
        """The next checked message (the network thread refused or handled the rest), or
        ``False`` when none is waiting."""
        msg, self._next = self._next, None
        if msg is not None:
            return msg
        try:
            return self._inbox.get_nowait()
        except queue.Empty:
            return False

    def stop_watching(self) -> None:
        """The run is over (its learners are told to stop): a long last step of the loop
        (the final evaluation, the last checkpoint) is no longer watched for being stuck."""
        self.stuck_seconds = 0.0

    # -- the network thread -----------------------------------------------------------------
    def _serve(self) -> None:
        """Receive and check, forward the service's frames, beat: nothing here waits on the
        service's loop, and its work never holds this thread up (torch releases the GIL in
        its kernels; Python code yields it every few milliseconds)."""
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self._pipe_in, zmq.POLLIN)
        last_beat = 0.0
        busy_said = False
        while not self._closing.is_set():
            now = time.monotonic()
            wait = max(0.0, min(0.1, last_beat + BEAT_SECONDS - now))
            ready = dict(poller.poll(int(wait * 1000) + 1))
            if self._pipe_in in ready:
                self._forward()
            if self.sock in ready:
                for _ in range(BURST):
                    try:
                        frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    msg = self.check(frames)
                    if msg is not None:
                        self._inbox.put(msg)
            now = time.monotonic()
            if now - last_beat >= BEAT_SECONDS:
                last_beat = now
                for m, live in list(self.beats.items()):
                    self._send_to_learner(m, protocol.Beat(live))
                busy = now - self.turned
                if self.stuck_seconds and busy > self.stuck_seconds:
                    self.on_stuck(busy)
                    return  # (beats no more: its learners see the silence)
                if busy > BUSY_WARN_SECONDS and not busy_said:
                    log.warning(
                        "syncer: the main loop has been busy for %.0fs (a merge, a store "
                        "write?); the network thread keeps the learners' links alive",
                        busy,
                    )
                busy_said = busy > BUSY_WARN_SECONDS

    def _forward(self) -> None:
        """Send what the service queued, in its order."""
        while True:
            try:
                frames = self._pipe_in.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            try:
                self.sock.send_multipart(frames, zmq.NOBLOCK, copy=False)
            except (zmq.Again, zmq.ZMQError):  # unreachable or its queue is full (frozen)
                self.counts["send_dropped"] += 1

    def check(self, frames: list[zmq.Frame]) -> Incoming | None:
        """Who sent it (from the handshake), then the wire's checks, then whether its
        connection proved itself and its life is the learner's (:mod:`.admission`), then
        its session."""
        user = str(frames[-1].get("User-Id")) if len(frames) > 1 else None
        link = link_of(user)
        if link is None or not 0 <= link[0] < self.slots:  # the gatekeeper admits no such peer
            self.refuse("refused_identity", None, f"connection authenticated as {user!r}")
            return None
        m, rank = link
        if len(frames) != 4:  # routing id + a frame's three parts
            self.refuse("refused_parts", m, f"{len(frames) - 1} parts, a frame has 3")
            return None
        ident = frames[0].bytes
        try:  # (the replay window is consulted below, once the connection is trusted)
            msg = self.wire.decode([f.buffer for f in frames[1:]], admit=False)
        except WireError as exc:  # logged (rate-limited) and counted by the wire
            if exc.reason == "shm_missing" and self.admission.proven(ident, m):
                self._send_to(ident, protocol.NoShm(), learner=m)  # it cannot reach our /dev/shm
            return None
        h = msg.header
        if h.sender != user or h.learner != m:
            self.refuse("refused_identity", m, f"a frame of {h.sender!r} on {user}'s connection")
            return None
        if rank:
            return self._check_part(ident, m, rank, h, msg.payload)
        if not self.admission.proven(ident, m):
            self._prove(ident, m, h)
            return None
        if not self._admit(ident, m, h):
            return None
        self.routes[m] = ident  # a proven, fresh frame of m's life: its connection now
        self.sessions[m] = h.session
        at = self.clock()
        self.heard[m] = at
        self._heard_mono[m] = time.monotonic()
        if h.to != self.wire.session:  # for an earlier life of ours, or a first hello
            if self.rehellos.ready(m):
                self._send_to_learner(m, protocol.Rehello())
            self.counts["rehello"] += 1
            return None
        return Incoming(m, h.kind, h.meta, msg.payload, at)

    def _check_part(
        self, ident: bytes, m: int, rank: int, h: Header, payload: memoryview
    ) -> Incoming | None:
        """A frame on rank ``rank``'s link of sharded learner ``m``: proven as any connection
        is, then through the replay window. It carries the rank's answer parts only: the
        learner's life, liveness and route stay its rank 0 link's."""
        link = (m, rank)
        if not self.admission.proven(ident, link):
            self._prove(ident, m, h, link)
            return None
        try:
            self.wire.admit(h)
        except WireError:  # counted and logged by the wire
            return None
        self.part_routes[link] = ident
        self.part_sessions[link] = h.session
        if h.to != self.wire.session:  # it learns this life's session from the rehello
            if self.rehellos.ready(link):
                self._send_to(ident, protocol.Rehello(), learner=m, to=h.session)
            self.counts["rehello"] += 1
            return None
        return Incoming(m, h.kind, h.meta, payload, self.clock(), rank)

    def _prove(self, ident: bytes, m: int, h: Header, link: Link | None = None) -> None:
        """A frame on a connection that has not proved itself: a proof, or a challenge
        (``link``: a sharded learner's rank link, else learner ``m``'s own)."""
        who = m if link is None else link
        if h.kind == protocol.Proof.KIND:
            if self.admission.prove(ident, who, h.meta.get("nonce")):  # (compared, not parsed)
                return  # (not through the replay window: a new life's proof must not
                # retire the current life's session; the nonce makes it fresh)
            self.refuse("refused_proof", m, "a proof that does not echo this connection's nonce")
            return
        self.counts["unproven"] += 1
        nonce, unproven = self.admission.challenge(ident, who, time.monotonic())
        if nonce is not None:
            self._send_to(ident, protocol.Challenge(nonce), learner=m, to=h.session)
        if unproven == UNPROVEN_SAID:  # a learner proves itself at its first challenge
            self.say(
                "unproven",
                "syncer: a connection with learner %d's credentials sends frames but does not "
                "prove it holds the run secret now (a replayed capture?): dropped (unproven)",
                m,
            )

    def _admit(self, ident: bytes, m: int, h: Header) -> bool:
        """The replay window, after the life check: a new life on another connection
        replaces the current one only once that one is gone (else it is held, then told
        it is a second process with this id)."""
        current, route = self.sessions.get(m), self.routes.get(m)
        if current is not None and h.session != current and route not in (None, ident):
            verdict = self.admission.newcomer(
                m,
                h.session,
                route_open=route is not None and self._route_open(route, m),
                heard_at=self._heard_mono.get(m),
                now=time.monotonic(),
            )
            if verdict is not Verdict.ADMIT:
                self.counts["held_newcomer" if verdict is Verdict.HOLD else "refused_second"] += 1
                if verdict is Verdict.REFUSE:
                    self._refuse_second(ident, m, h.session)
                return False
        try:
            self.wire.admit(h)
        except WireError as exc:  # counted and logged by the wire
            if exc.field == "session" and self.stale.ready(ident):  # a replaced life
                why = (
                    f"learner {m} was taken over by a newer process (another life of this "
                    "learner said hello while this one was silent: frozen, cut off or "
                    "restarted); this process is out of date"
                )
                self._send_to(ident, protocol.Refused(why), learner=m, to=h.session)
            return False
        return True

    def _route_open(self, route: bytes, m: int) -> bool:
        """Whether ``route`` is still connected (a beat to it; libzmq drops a closed
        connection's route, and ROUTER_MANDATORY then refuses the send)."""
        beat = protocol.Beat(live=True)
        parts = self.wire.encode(beat.KIND, learner=m, to=self.sessions.get(m, 0), meta=beat.meta())
        try:
            self.sock.send_multipart([route, *parts], zmq.NOBLOCK, copy=False)
        except zmq.ZMQError as exc:
            return exc.errno == zmq.EAGAIN  # a full queue: connected, only slow
        return True

    def _refuse_second(self, ident: bytes, m: int, session: int) -> None:
        why = (
            f"learner {m} is already running: another process with this id is connected and "
            "speaking to the syncer. Is a second `ddiloco learner --id "
            f"{m}` running? Stop one of them."
        )
        log.error("syncer: refused a second process claiming learner %d: %s", m, why)
        self._send_to(ident, protocol.Refused(why), learner=m, to=session)
        self.admission.forget(ident)

    def send(self, m: int, kind: str, **kw: Any) -> None:
        """To learner ``m``'s latest authenticated connection, addressed to its session
        (the service's thread: handed to the network thread); dropped (and counted) when it
        has none or its queue is full."""
        parts = self._encode(m, kind, **kw)
        if parts is not None:
            self._pipe_out.send_multipart(parts, copy=False)

    def send_part(self, m: int, rank: int, kind: str, **kw: Any) -> None:
        """To rank ``rank``'s link of sharded learner ``m`` (inline; as :meth:`send`)."""
        route = self.part_routes.get((m, rank))
        if route is None:
            with self._tally:
                self.counts["send_unrouted"] += 1
            return
        to = self.part_sessions.get((m, rank), 0)
        parts = self.wire.encode(kind, learner=m, inline=True, to=to, **kw)
        with self._tally:
            self.bytes_sent += payload_size(parts)
        self._pipe_out.send_multipart([route, *parts], copy=False)

    def _encode(self, m: int, kind: str, **kw: Any) -> list[Any] | None:
        route = self.routes.get(m)
        if route is None:
            with self._tally:
                self.counts["send_unrouted"] += 1
            return None
        to = self.sessions.get(m, 0)
        parts = self.wire.encode(kind, learner=m, inline=m in self.inline, to=to, **kw)
        with self._tally:  # (both threads send)
            self.bytes_sent += payload_size(parts)
        return [route, *parts]

    def _send_to_learner(self, m: int, message: protocol.Message) -> None:
        """Send from the network thread itself (a beat, a rehello)."""
        parts = self._encode(m, message.KIND, meta=message.meta())
        if parts is not None:
            self._send_raw(parts)

    def _send_to(self, route: bytes, message: protocol.Message, **kw: Any) -> None:
        """Send on connection ``route`` (kw: the header's learner and to)."""
        self._send_raw([route, *self.wire.encode(message.KIND, meta=message.meta(), **kw)])

    def _send_raw(self, parts: list[Any]) -> None:
        try:
            self.sock.send_multipart(parts, zmq.NOBLOCK, copy=False)
        except (zmq.Again, zmq.ZMQError):  # unreachable or its queue is full (frozen)
            self.counts["send_dropped"] += 1

    def close(self) -> None:
        """Stop the network thread (what the service queued is sent first), then close."""
        self._closing.set()
        self._thread.join(timeout=5.0)
        self._forward()
        self.handshakes.close()
        self._pipe_out.close(0)
        self._pipe_in.close(0)
        self.sock.close(0)
        self.gate.close()
        self.ctx.term()
        self.wire.close()
