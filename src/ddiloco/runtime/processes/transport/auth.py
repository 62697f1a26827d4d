"""Connection authentication: nobody reaches a ddiloco socket without the run's secret.

Every listening socket of a run (the syncer's, each learner's snapshot server, the fault
proxy's front) is a ZMTP PLAIN server whose handshakes a :class:`Gatekeeper` checks (the ZAP
handler of its zmq context) *before* libzmq routes, buffers or delivers a single message:
the username is a one-time ticket naming who connects (``L3.<time>.<nonce>``: learner 3;
tickets.py), the password is HMAC-SHA256(secret, "ddiloco-connect-v2" | run id | username).
A server admits a ticket once, so a captured handshake cannot be replayed. A peer without them never
completes the handshake, so it can send nothing (no frame to hash, no multipart message to
grow, no routing id to take over) and libzmq closes its connection. Every message that does
arrive carries the authenticated name as its ``User-Id`` property, so the syncer learns
which learner a connection belongs to from the handshake, never from what the peer says.

Why PLAIN + ZAP and not CurveZMQ (docs/decisions.md 36): CURVE encrypts every byte (about
0.25 GB/s per core here), which would cost the bulk path most of its throughput; frames are
already authenticated one by one with HMAC-SHA256 (wire.py). PLAIN's password crosses the
wire in clear; being a one-time ticket, it is worth nothing once seen. An eavesdropper still
reads the traffic: across untrusted networks, run the links inside WireGuard or TLS
(docs/security.md).

The gatekeeper bounds what failed handshakes may cost: a token bucket per source address,
and an address that keeps failing is shut out for a while (its refusals are then counted as
``banned`` and not logged). Valid credentials are always admitted, even from a shut-out
address: learners and attackers may share one (loopback, a NAT), and a learner refused for
its neighbour's sake would stop, believing its secret wrong. Every refusal is counted;
logging is rate-limited (one line per reason per few seconds, with the count suppressed).
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import re
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import zmq

from ddiloco.runtime.processes.transport.ratelog import RateLimitedLog
from ddiloco.runtime.processes.transport.sockets import configure
from ddiloco.runtime.processes.transport.tickets import (
    SKEW_SECONDS,
    TicketBook,
    make_ticket,
    parse_ticket,
)
from ddiloco.runtime.processes.transport.wire import Limits

log = logging.getLogger(__name__)

ZAP_ENDPOINT = "inproc://zeromq.zap.01"
DOMAIN = b"ddiloco"
LABEL = b"ddiloco-connect-v2"  # v2: the username is a one-time ticket
LEARNER_NAME = re.compile(r"L(\d{1,6})")
PART_NAME = re.compile(r"L(\d{1,6})r([1-9]\d{0,3})")  # rank r >= 1 of a sharded learner
Link = tuple[int, int]  # a connection's (learner, rank): rank 0 is the learner's own link
MAX_ADDRESSES = 4096  # source addresses remembered by the rate limiter (oldest forgotten)
WHY = {
    "bad_credentials": "wrong secret or run id",
    "unknown_name": "not a member of this run",
    "mechanism": "no ddiloco credentials (PLAIN) presented",
    "handshake_rate": "too many failed handshakes",
    "banned": "address shut out after repeated failures",
    "not_a_ticket": "not a connection ticket (a ddiloco older than this one?)",
    "replayed": "a connection ticket used before (a replayed capture?)",
    "clock": f"a ticket whose time is over {SKEW_SECONDS:.0f}s from ours (clocks out of sync?)",
    "tickets_full": "too many connections with fresh tickets",
}


def credential(secret: bytes, run: str, name: str) -> bytes:
    """The password ``name`` presents when connecting to a socket of run ``run``."""
    mac = hmac.new(secret, LABEL + b"|" + run.encode() + b"|" + name.encode(), "sha256")
    return mac.hexdigest().encode("ascii")


def present(sock: zmq.Socket[bytes], secret: bytes, run: str, name: str) -> None:
    """Make a connecting socket present a fresh ticket of ``name`` (before ``connect``).

    A ticket is good for one handshake: libzmq reconnects a socket with the ticket it was
    given, which the server refuses, so the owner replaces a socket whose connection closed
    (:class:`HandshakeWatch` says when)."""
    user = make_ticket(name)
    sock.plain_username = user.encode()
    sock.plain_password = credential(secret, run, user)


def learner_of(user: str | None) -> int | None:
    """The learner an authenticated name (``"L3"``) stands for; None for anything else."""
    match = LEARNER_NAME.fullmatch(user or "")
    return int(match.group(1)) if match else None


def link_of(user: str | None) -> Link | None:
    """The learner and rank a connection's authenticated name stands for: ``"L3"`` is
    learner 3 (rank 0: its one link, or its sharded ranks' rank 0), ``"L3r1"`` rank 1 of
    sharded learner 3 (core/parts.py); None for anything else."""
    m = learner_of(user)
    if m is not None:
        return m, 0
    match = PART_NAME.fullmatch(user or "")
    return (int(match.group(1)), int(match.group(2))) if match else None


def link_name(learner: int, rank: int) -> str:
    """The name learner ``learner``'s rank ``rank`` authenticates as (see :func:`link_of`)."""
    return f"L{learner}" if rank == 0 else f"L{learner}r{rank}"


@dataclass(frozen=True)
class Bounds:
    """What handshakes from one source address may cost."""

    burst: int = 64  # handshakes at once
    per_second: float = 16.0  # sustained
    fail_limit: int = 32  # failures in fail_window seconds before the address is shut out
    fail_window: float = 60.0
    ban_seconds: float = 60.0


class _Address:
    __slots__ = ("at", "banned_until", "failures", "tokens")

    def __init__(self, burst: int, now: float) -> None:
        self.tokens = float(burst)
        self.at = now
        self.failures: list[float] = []
        self.banned_until = 0.0


class Gatekeeper(threading.Thread):
    """The ZAP handler of one zmq context: checks every PLAIN handshake of its servers.

    Call order: construct and :meth:`start` *before* binding any server socket (a PLAIN
    server whose context has no handler would refuse nobody: ``ZAP_ENFORCE_DOMAIN`` is set
    too, where libzmq has it), then :func:`serve_plain` each server socket; :meth:`close`
    after closing them. ``accept(name)`` says which names may connect at all; ``tickets``
    remembers the one-time tickets admitted (the syncer's journals them in its store).
    """

    def __init__(
        self,
        ctx: zmq.Context[zmq.Socket[bytes]],
        secret: bytes,
        run: str,
        accept: Callable[[str], bool],
        bounds: Bounds | None = None,
        clock: Callable[[], float] = time.monotonic,
        tickets: TicketBook | None = None,
    ) -> None:
        super().__init__(name="zap-gatekeeper", daemon=True)
        self.tickets = tickets or TicketBook()
        self.secret = secret
        self.run_id = run
        self.accept = accept
        self.bounds = bounds or Bounds()
        self.clock = clock
        self.counts: Counter[str] = Counter()
        self._addresses: OrderedDict[bytes, _Address] = OrderedDict()
        self._say = RateLimitedLog(log)
        self._closing = threading.Event()
        self.sock = ctx.socket(zmq.REP)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(ZAP_ENDPOINT)

    def run(self) -> None:
        while not self._closing.is_set():
            try:
                if not self.sock.poll(100):
                    continue
                request = self.sock.recv_multipart()
            except zmq.ZMQError:
                return
            try:
                self.sock.send_multipart(self.decide(request))
            except zmq.ZMQError:
                return

    def close(self) -> None:
        self._closing.set()
        self.join(timeout=2.0)
        self.sock.close(0)

    # -- one handshake ----------------------------------------------------------------------
    def decide(self, request: list[bytes]) -> list[bytes]:
        """The ZAP reply to one request (RFC 27): 200 with the user id, or 400."""
        if len(request) < 6:
            self.counts["refused_malformed"] += 1
            return [b"1.0", b"", b"500", b"malformed ZAP request", b"", b""]
        version, rid, _domain, address, _identity, mechanism, *creds = request
        status, text, user = self._check(address, mechanism, creds)
        return [version, rid, status, text.encode(), user.encode(), b""]

    def _check(
        self, address: bytes, mechanism: bytes, creds: list[bytes]
    ) -> tuple[bytes, str, str]:
        name, reason = self._verify(mechanism, creds)
        if reason is None:
            self.counts["accepted"] += 1
            return b"200", "OK", name
        now = self.clock()
        source = self._source(address, now)
        where = address.decode(errors="replace")[:64]
        if source.banned_until > now:  # shut out: counted, not logged
            self.counts["refused_banned"] += 1
            return b"400", WHY["banned"], ""
        refill = (now - source.at) * self.bounds.per_second
        source.tokens, source.at = min(self.bounds.burst, source.tokens + refill), now
        if source.tokens < 1.0:
            reason = "handshake_rate"
        else:
            source.tokens -= 1.0
        self.counts[f"refused_{reason}"] += 1
        window = now - self.bounds.fail_window
        source.failures = [t for t in source.failures if t > window] + [now]
        if len(source.failures) >= self.bounds.fail_limit:
            source.banned_until = now + self.bounds.ban_seconds
            source.failures.clear()
            self._say(
                "ban",
                "shutting out %s for %.0fs after %d failed handshakes",
                where,
                self.bounds.ban_seconds,
                self.bounds.fail_limit,
            )
        self._say(reason, "refused a connection from %s (%s): %s", where, name or "-", WHY[reason])
        return b"400", WHY[reason], ""

    def _verify(self, mechanism: bytes, creds: list[bytes]) -> tuple[str, str | None]:
        """(the name presented, why it is refused or None); compared in constant time."""
        if mechanism != b"PLAIN" or len(creds) != 2:
            return mechanism.decode(errors="replace")[:16], "mechanism"
        try:
            ticket = parse_ticket(creds[0].decode("ascii"))
        except UnicodeDecodeError:
            return "<not ascii>", "unknown_name"
        if ticket is None:
            return creds[0].decode("ascii", errors="replace")[:32], "not_a_ticket"
        name, stamp, nonce = ticket
        if len(name) > 32 or not self.accept(name):
            return name[:32], "unknown_name"
        expected = credential(self.secret, self.run_id, creds[0].decode("ascii"))
        if not hmac.compare_digest(expected, creds[1]):
            return name, "bad_credentials"
        refused = self.tickets.admit(stamp, nonce)  # only genuine tickets reach the book
        if self.tickets.journal_error is not None:
            log.error("cannot journal connection tickets (%s)", self.tickets.journal_error)
            self.tickets.journal_error = None
        return name, refused

    def _source(self, address: bytes, now: float) -> _Address:
        source = self._addresses.get(address)
        if source is None:
            source = self._addresses[address] = _Address(self.bounds.burst, now)
            while len(self._addresses) > MAX_ADDRESSES:
                self._addresses.popitem(last=False)
        else:
            self._addresses.move_to_end(address)
        return source


def serve_plain(sock: zmq.Socket[bytes]) -> None:
    """Make a (not yet bound) socket a PLAIN server whose handshakes the gatekeeper checks."""
    sock.plain_server = True
    sock.zap_domain = DOMAIN
    enforce = getattr(zmq, "ZAP_ENFORCE_DOMAIN", None)
    if enforce is not None:
        with contextlib.suppress(zmq.ZMQError):  # a libzmq built without draft options
            sock.setsockopt(enforce, 1)


WATCHED = (
    zmq.EVENT_HANDSHAKE_SUCCEEDED
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_DISCONNECTED
)
RENEW_SECONDS = 60.0  # a ticket older than this, refused, is renewed rather than fatal


class HandshakeWatch:
    """Tells a connecting socket's owner, within milliseconds, why its handshakes fail, and
    when its ticket is spent.

    libzmq retries a refused connection quietly for ever; a learner must instead stop and say
    that the server refused its credentials (wrong secret or run id). Other failures (a
    handshake cut short by a server restarting, or a server that is not ddiloco's) are
    counted in :attr:`failures`: the learner gives up on them only after its give-up time,
    and says how many there were. :attr:`renew` is set once the socket's ticket is spent (its
    connection closed after a handshake, or an old ticket refused): the owner replaces the
    socket, with a fresh ticket (:func:`present`). Poll it from the thread that owns the socket.
    """

    def __init__(self, sock: zmq.Socket[bytes], address: str) -> None:
        self.address = address
        self.sock = sock
        self.mon = sock.get_monitor_socket(WATCHED)
        self.failures = 0
        self.made = time.monotonic()
        self.admitted = False  # a handshake with this socket's ticket succeeded
        self.renew = False

    def poll(self) -> str | None:
        """Why the server refused us for good (our credentials), else None."""
        from zmq.utils.monitor import recv_monitor_message

        while self.mon.poll(0):
            event = recv_monitor_message(self.mon)
            kind = event["event"]
            if kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.admitted = True
            elif kind == zmq.EVENT_DISCONNECTED:
                self.renew = self.renew or self.admitted  # zmq would reuse the spent ticket
            elif kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                if self.admitted or time.monotonic() - self.made > RENEW_SECONDS:
                    self.renew = True  # a spent or stale ticket: a fresh one will do
                    continue
                return (
                    f"{self.address} refused our credentials (ZAP status "
                    f"{event['value']}): wrong secret or run id, or this machine's clock is "
                    f"over {SKEW_SECONDS:.0f}s from the server's"
                )
            else:
                self.failures += 1
        return None

    def close(self) -> None:
        with contextlib.suppress(zmq.ZMQError):
            self.sock.disable_monitor()
        self.mon.close(0)


SERVER_EVENTS: dict[int, str] = {
    int(zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL): "handshake_failed_protocol",  # no credentials
    int(zmq.EVENT_HANDSHAKE_FAILED_AUTH): "handshake_failed_auth",  # the gatekeeper said no
    int(zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL): "handshake_failed",
    int(zmq.EVENT_DISCONNECTED): "disconnected",
}


class HandshakeCounter:
    """A server's side of :class:`HandshakeWatch`: counts (and says, rate-limited) the
    connections libzmq refused before any message. A peer with no credentials at all fails
    there, before the gatekeeper sees it, so without this its refusal would go uncounted.
    Make it before the socket binds; :meth:`drain` now and then, :meth:`close` before the
    socket is closed."""

    def __init__(self, sock: zmq.Socket[bytes], counts: dict[str, int], say: RateLimitedLog):
        self.sock = sock
        self.counts = counts
        self.say = say
        self.mon = sock.get_monitor_socket(sum(SERVER_EVENTS))

    def drain(self) -> None:
        from zmq.utils.monitor import recv_monitor_message

        while self.mon.poll(0):
            event = recv_monitor_message(self.mon)
            name = SERVER_EVENTS.get(int(event["event"]), "handshake_failed")
            self.counts[name] = self.counts.get(name, 0) + 1
            if name != "disconnected":
                self.say(name, "refused a connection: %s (%s)", name, event["value"])

    def close(self) -> None:
        with contextlib.suppress(zmq.ZMQError):
            self.sock.disable_monitor()
        self.mon.close(0)


def dial(
    ctx: zmq.Context[zmq.Socket[bytes]],
    limits: Limits,
    secret: bytes,
    run: str,
    name: str,
    address: str,
) -> tuple[zmq.Socket[bytes], HandshakeWatch]:
    """A DEALER connected to ``address`` as ``name`` (a fresh ticket), queueing nothing for
    a server that is not there, and the watch on its handshake."""
    sock = ctx.socket(zmq.DEALER)
    configure(sock, limits)
    present(sock, secret, run, name)
    sock.setsockopt(zmq.IMMEDIATE, 1)
    watch = HandshakeWatch(sock, address)
    sock.connect(f"tcp://{address}")
    return sock, watch


def hang_up(sock: zmq.Socket[bytes] | None, watch: HandshakeWatch | None) -> tuple[None, None]:
    """Close what :func:`dial` opened (the watch first; either may be None already), for
    ``sock, watch = hang_up(sock, watch)``."""
    if watch is not None:
        watch.close()
    if sock is not None:
        sock.close(0)
    return None, None
