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

Call order: :meth:`receive` (or :meth:`poll` first) in the loop; :meth:`send` any time after
the constructor; :meth:`close` once, last.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Literal

import zmq

from ddiloco.runtime.processes.transport.auth import (
    Gatekeeper,
    HandshakeCounter,
    learner_of,
    serve_plain,
)
from ddiloco.runtime.processes.transport.ratelog import RateLimitedLog, Throttle
from ddiloco.runtime.processes.transport.shm import writer_for
from ddiloco.runtime.processes.transport.sockets import Socket, configure, new_session
from ddiloco.runtime.processes.transport.wire import Limits, Wire, WireError, payload_size

log = logging.getLogger(__name__)

REHELLO_SECONDS = 0.25  # at most one rehello per learner this often


@dataclass(frozen=True)
class Incoming:
    """An authenticated message for this syncer life, from learner ``learner``."""

    learner: int
    kind: str
    meta: dict[str, Any]
    payload: memoryview


class Connections:
    """The syncer's ROUTER socket and what it knows of each learner's connection."""

    def __init__(
        self, bind: str, run_id: str, secret: bytes, slots: int, limits: Limits, shm: bool
    ) -> None:
        self.slots = slots
        session = new_session()
        writer = writer_for(run_id, "S", session, bind.rpartition(":")[0], shm)
        self.wire = Wire(run_id, secret, "S", session, limits, shm=writer)
        self.ctx: zmq.Context[Socket] = zmq.Context()
        self.gate = Gatekeeper(self.ctx, secret, run_id, self.is_member)
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
        self.rehellos = Throttle(REHELLO_SECONDS)  # per learner
        self.inline: set[int] = set()  # learners that cannot read our /dev/shm slots
        self.bytes_sent = 0

    @property
    def session(self) -> int:
        """This syncer life's session: frames addressed to another are not acted on."""
        return self.wire.session

    def is_member(self, name: str) -> bool:
        """Which names may connect: the run's learner slots."""
        m = learner_of(name)
        return m is not None and m < self.slots

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
        """Wait at most ``seconds`` for a frame (at least a millisecond)."""
        return bool(self.sock.poll(max(1, int(seconds * 1000))))

    def receive(self) -> Incoming | Literal[False] | None:
        """The next frame, checked: an :class:`Incoming`, ``None`` for one refused or handled
        here (a rehello), ``False`` when none is waiting."""
        try:
            frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return False
        return self.check(frames)

    def check(self, frames: list[zmq.Frame]) -> Incoming | None:
        """Who sent it (from the handshake), then the wire's checks, then its session."""
        user = str(frames[-1].get("User-Id")) if len(frames) > 1 else None
        m = learner_of(user)
        if m is None or not 0 <= m < self.slots:  # the gatekeeper admits no such peer
            self.refuse("refused_identity", None, f"connection authenticated as {user!r}")
            return None
        if len(frames) != 4:  # routing id + a frame's three parts
            self.refuse("refused_parts", m, f"{len(frames) - 1} parts, a frame has 3")
            return None
        ident = frames[0].bytes
        try:
            msg = self.wire.decode([f.buffer for f in frames[1:]])
        except WireError as exc:  # logged (rate-limited) and counted by the wire
            if exc.reason == "shm_missing":  # it cannot reach us through /dev/shm
                self._send_to(ident, "no_shm", learner=m)
            return None
        h = msg.header
        if h.sender != user or h.learner != m:
            self.refuse("refused_identity", m, f"a frame of {h.sender!r} on {user}'s connection")
            return None
        self.routes[m] = ident  # an authenticated, fresh frame: this is m's connection now
        self.sessions[m] = h.session
        if h.to != self.wire.session:  # for an earlier life of ours, or a first hello
            if self.rehellos.ready(m):
                self.send(m, "rehello")
            self.counts["rehello"] += 1
            return None
        return Incoming(m, h.kind, h.meta, msg.payload)

    def send(self, m: int, kind: str, **kw: Any) -> None:
        """To learner ``m``'s latest authenticated connection, addressed to its session;
        dropped (and counted) when it has none or its queue is full."""
        route = self.routes.get(m)
        if route is None:
            self.counts["send_unrouted"] += 1
            return
        self._send_to(
            route, kind, learner=m, inline=m in self.inline, to=self.sessions.get(m, 0), **kw
        )

    def _send_to(self, route: bytes, kind: str, **kw: Any) -> None:
        parts = self.wire.encode(kind, **kw)
        try:
            self.sock.send_multipart([route, *parts], zmq.NOBLOCK, copy=False)
            self.bytes_sent += payload_size(parts)
        except (zmq.Again, zmq.ZMQError):  # unreachable or its queue is full (frozen)
            self.counts["send_dropped"] += 1

    def close(self) -> None:
        self.handshakes.close()
        self.sock.close(0)
        self.gate.close()
        self.ctx.term()
        self.wire.close()
