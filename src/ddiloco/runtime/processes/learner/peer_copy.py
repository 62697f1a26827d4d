"""Peer recovery, the newcomer's side: copy a donor's snapshot (peer.py serves it).

A copy has no deadline as a whole, only a stall deadline: a donor that sends nothing for
``stall_seconds`` is given up; one that merely pauses, or whose connection drops, is asked
again for the missing chunks of the same snapshot on a fresh connection. The head comes
first; it is checked before anything it describes is allocated, then every chunk is written
straight into the preallocated tensors (transport/tree.py's :class:`TreeWriter`), and the
whole stream is checked against the donor's BLAKE3 digest at the end.

A copy never mixes donors: two learners' states differ in every parameter and moment, so
chunks of two snapshots would build a state no learner had; a copy whose donor is gone
starts over from the next one (docs/decisions.md, "peer copies of any size").
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import zmq
from blake3 import blake3

from ddiloco.errors import ConfigError
from ddiloco.runtime.processes.learner.peer import (
    MAX_CHUNK_BYTES,
    STALL_SECONDS,
    WAIT_SECONDS,
    PeerError,
)
from ddiloco.runtime.processes.transport.auth import present
from ddiloco.runtime.processes.transport.sockets import Socket, configure, new_session
from ddiloco.runtime.processes.transport.tree import TreeWriter
from ddiloco.runtime.processes.transport.wire import Limits, Message, Wire, WireError

log = logging.getLogger(__name__)

CHUNK_SECONDS = 0.25  # a chunk is sized to about this long on the link (its measured rate)
FIRST_CHUNK_BYTES = 64 << 10  # before any is measured: 0.5 s at 1 Mbit/s
MIN_CHUNK_BYTES = 16 << 10
WINDOW = 4  # requests in flight: about a second of the link, more than a round trip
PROGRESS_SECONDS = 5.0  # a copy's progress line on the learner's log, at most this often
PROBE_SECONDS = 2.0  # a donor that does not answer a ping within this is tried last


@dataclass(frozen=True)
class Copied:
    """A snapshot that arrived whole and matched its digest."""

    tree: Any
    nbytes: int
    seconds: float
    resumes: int  # times the missing chunks were asked again after a hiccup


class _Fetch:
    """One copy from one donor (see the module's docstring for the rules).

    Chunks are sized to the measured rate (about :data:`CHUNK_SECONDS` of the link each,
    between :data:`MIN_CHUNK_BYTES` and :data:`MAX_CHUNK_BYTES`), so on any link a healthy
    donor's chunks arrive well within a third of the stall deadline: silence that long is a
    hiccup, and the chunks still missing are asked again on a fresh connection (a reset or
    half-open one would swallow them); silence for the whole deadline is a donor gone.
    """

    def __init__(
        self, address: str, run: str, secret: bytes, learner: int, label: str, stall: float
    ) -> None:
        self.address, self.run, self.secret, self.learner = address, run, secret, learner
        self.label, self.stall = label, stall
        limits = Limits(max_payload=MAX_CHUNK_BYTES)
        self.wire = Wire(run, secret, f"R{learner}", new_session(), limits)
        self.req = secrets.randbits(62)
        self.sock: Socket | None = None
        self.resumes = 0
        self.rate = FIRST_CHUNK_BYTES / CHUNK_SECONDS  # bytes/s, measured once chunks flow
        self.connect()

    def fail(self, why: str) -> PeerError:
        return PeerError("peer", self.address, why)

    def connect(self) -> None:
        if self.sock is not None:
            self.sock.close(0)
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        configure(self.sock, self.wire.limits)
        present(self.sock, self.secret, self.run, f"L{self.learner}")
        self.sock.connect(f"tcp://{self.address}")

    def resume(self, pending: Mapping[int, int] | None = None, sid: int = 0) -> None:
        """A hiccup: a fresh connection, and the missing chunks asked again."""
        self.resumes += 1
        log.info("%s: peer %s went quiet; asking again", self.label, self.address)
        self.connect()
        for offset, length in (pending or {}).items():
            self.send("snap_chunk", {"id": sid, "off": offset, "len": length})

    def send(self, kind: str, meta: dict[str, Any]) -> None:
        assert self.sock is not None
        with contextlib.suppress(zmq.ZMQError):
            self.sock.send_multipart(self.wire.encode(kind, learner=self.learner, meta=meta))

    def receive(self, until: float) -> Message | None:
        """The next authentic frame before ``until``; raises on ``snap_gone``, ``snap_busy``."""
        assert self.sock is not None
        while (left := until - time.monotonic()) > 0:
            if not self.sock.poll(max(1, int(left * 1000))):
                return None
            try:
                msg = self.wire.decode([f.buffer for f in self.sock.recv_multipart(copy=False)])
            except WireError:
                continue
            if msg.kind == "snap_gone":
                raise self.fail("it no longer holds the snapshot (snap_gone)")
            if msg.kind == "snap_busy":
                raise self.fail("it serves too many newcomers at once (snap_busy)")
            return msg
        return None

    def ask(self, kind: str, meta: dict[str, Any], want: str, patience: float) -> Message:
        """One request and its answer; the donor's heartbeats keep it waiting (up to
        ``patience``: its loop takes the snapshot between two steps)."""
        started = alive = asked = time.monotonic()
        self.send(kind, meta)
        while True:
            now = time.monotonic()
            if now - alive >= self.stall or now - started >= patience:
                raise self.fail(f"no {want} within {now - started:.0f}s")
            if now - max(alive, asked) >= self.stall / 3:
                self.resume()
                self.send(kind, meta)
                asked = now
            until = min(max(alive, asked) + self.stall / 3, alive + self.stall, started + patience)
            msg = self.receive(until)
            if msg is None:
                continue
            alive = time.monotonic()
            if msg.kind == want and ("id" not in meta or msg.header.meta.get("id") == meta["id"]):
                return msg

    def pull(
        self, writer: TreeWriter, sid: int, start: int, end: int, window: int, shown: _Progress
    ) -> None:
        """Bytes [start, end) of snapshot ``sid`` into ``writer``, ``window`` chunks in
        flight, each written where it belongs as it arrives."""
        pending: dict[int, int] = {}  # offset -> length, asked and not arrived
        following, received = start, 0
        first = last = quiet = time.monotonic()
        while following < end or pending:
            while following < end and len(pending) < window:
                size = int(min(MAX_CHUNK_BYTES, max(MIN_CHUNK_BYTES, self.rate * CHUNK_SECONDS)))
                length = min(size, end - following)
                pending[following] = length
                self.send("snap_chunk", {"id": sid, "off": following, "len": length})
                following += length
            msg = self.receive(min(last + self.stall, quiet + self.stall / 3))
            now = time.monotonic()
            if msg is None:
                if now - last >= self.stall:
                    raise self.fail(f"stalled: no chunk for {now - last:.0f}s")
                if now - quiet >= self.stall / 3:
                    quiet = now
                    self.resume(pending, sid)
                continue
            meta = msg.header.meta
            offset = meta.get("off")
            if msg.kind != "snap_data" or meta.get("id") != sid or not isinstance(offset, int):
                continue  # a late heartbeat or answer
            length = pending.pop(offset, -1)
            if length < 0:
                continue  # a duplicate of a re-asked chunk
            if msg.payload.nbytes != length:
                why = f"sent {msg.payload.nbytes} bytes at offset {offset}, asked {length}"
                raise self.fail(why)
            try:
                writer.write(offset, msg.payload)
            except ConfigError as exc:
                raise self.fail(f"sent bytes that do not fit its snapshot: {exc}") from None
            received += length  # the pace since the start: a burst out of buffers is none
            if now - first >= 0.5:
                self.rate = received / (now - first)
            last = quiet = now
            shown.add(length)

    def close(self, linger_ms: int = 0) -> None:
        """Close (``linger_ms``: let a last message, the ``snap_done``, leave)."""
        if self.sock is not None:
            self.sock.close(linger_ms)
        self.wire.close()


class _Progress:
    """A copy's progress on the learner's log, at most every PROGRESS_SECONDS."""

    def __init__(self, label: str, peer: str, total: int) -> None:
        self.label, self.peer, self.total = label, peer, total
        self.done = 0
        self.started = self.shown = time.monotonic()

    def add(self, nbytes: int) -> None:
        self.done += nbytes
        now = time.monotonic()
        if now - self.shown >= PROGRESS_SECONDS:
            self.shown = now
            rate = self.done / max(now - self.started, 1e-9)
            done = f"{self.done / 1e6:.1f} / {self.total / 1e6:.1f} MB"
            eta = (self.total - self.done) / max(rate, 1e-9)
            share = 100 * self.done / max(self.total, 1)
            said = f"{done} ({share:.0f}%), {rate / 1e6:.2f} MB/s, ETA {eta:.0f}s"
            log.info("%s: copying peer %s: %s", self.label, self.peer, said)


def fetch_snapshot(
    address: str,
    run: str,
    secret: bytes,
    learner: int,
    *,
    max_bytes: int,
    stall_seconds: float = STALL_SECONDS,
    wait_seconds: float = WAIT_SECONDS,
    window: int = WINDOW,
    label: str = "",
) -> Copied:
    """Copy one donor's snapshot, the head first, then its tensors written in place; raise
    :class:`PeerError` naming the donor if it is gone, stalls, or sends something wrong
    (anything larger than ``max_bytes`` is refused before it is allocated)."""
    label = label or f"learner {learner}"
    fetch = _Fetch(address, run, secret, learner, label, stall_seconds)
    linger = 0
    try:
        meta = fetch.ask("snap_begin", {"req": fetch.req}, "snap_meta", wait_seconds).header.meta
        started = time.monotonic()
        try:
            sid, size, head = int(meta["id"]), int(meta["size"]), int(meta["head"])
            writer = TreeWriter(size, head, max_bytes)
        except (KeyError, TypeError, ValueError) as exc:
            raise fetch.fail(f"announced a snapshot we refuse: {exc}") from None
        shown = _Progress(label, address, size)
        fetch.pull(writer, sid, 0, writer.head_end, window, shown)
        try:
            writer.parse_head()
        except ConfigError as exc:
            raise fetch.fail(f"sent a snapshot head we refuse: {exc}") from None
        fetch.pull(writer, sid, writer.head_end, size, window, shown)
        while True:  # "" while the donor is still hashing
            answer = fetch.ask("snap_sum", {"id": sid}, "snap_sum", wait_seconds)
            if digest := answer.header.meta.get("blake3"):
                break
            time.sleep(0.2)
        if digest != writer.digest(threads=blake3.AUTO):  # we are not training yet
            raise fetch.fail("the snapshot does not match its BLAKE3 digest")
        try:
            tree = writer.tree()
        except ConfigError as exc:
            raise fetch.fail(f"sent a snapshot tree we refuse: {exc}") from None
        fetch.send("snap_done", {"id": sid, "req": fetch.req})
        linger = 1000
        seconds = time.monotonic() - started
        said = f"{size / 1e6:.1f} MB from peer {address} in {seconds:.1f}s"
        resumed = f", {fetch.resumes} resumes" if fetch.resumes else ""
        log.info(
            "%s: copied %s (%.2f MB/s%s)", label, said, size / 1e6 / max(seconds, 1e-9), resumed
        )
        return Copied(tree, size, seconds, fetch.resumes)
    finally:
        fetch.close(linger)


def by_round_trip(
    peers: Mapping[str, str], run: str, secret: bytes, learner: int, timeout: float = PROBE_SECONDS
) -> list[tuple[str, str]]:
    """The donors, nearest first: a ping to each in parallel; those within twice the best
    round trip (plus 5 ms) count as near, and the syncer's order (the furthest trained
    first) decides among equals; one that does not answer comes last. A round trip is a
    hint of a donor on the same site or network, and costs one ping."""
    wire = Wire(run, secret, f"R{learner}", new_session(), Limits(max_payload=1024))
    ctx: zmq.Context[Socket] = zmq.Context.instance()
    socks: dict[Socket, str] = {}
    rtt: dict[str, float] = {}
    poller = zmq.Poller()
    started = time.monotonic()
    try:
        for pid, address in peers.items():
            sock = ctx.socket(zmq.DEALER)
            configure(sock, wire.limits)
            present(sock, secret, run, f"L{learner}")
            sock.connect(f"tcp://{address}")
            sock.send_multipart(wire.encode("snap_ping", learner=learner))
            socks[sock] = pid
            poller.register(sock, zmq.POLLIN)
        while len(rtt) < len(socks) and (left := started + timeout - time.monotonic()) > 0:
            for sock, _ in poller.poll(max(1, int(left * 1000))):
                with contextlib.suppress(WireError):
                    wire.decode([f.buffer for f in sock.recv_multipart(copy=False)])
                    rtt.setdefault(socks[sock], time.monotonic() - started)
    finally:
        for sock in socks:
            sock.close(0)
        wire.close()
    best = min(rtt.values(), default=0.0)
    order = list(peers)

    def tier(pid: str) -> tuple[int, int]:
        if pid not in rtt:
            return 2, order.index(pid)
        return (0 if rtt[pid] <= 2 * best + 0.005 else 1), order.index(pid)

    ranked = sorted(peers, key=tier)
    if len(peers) > 1:
        shown = ", ".join(
            f"{p} ({1000 * rtt[p]:.1f} ms)" if p in rtt else f"{p} (no answer)" for p in ranked
        )
        log.info("learner %d: donors by round trip: %s", learner, shown)
    return [(p, peers[p]) for p in ranked]


def copy_from_peers(
    peers: Mapping[str, str],
    run: str,
    secret: bytes,
    learner: int,
    *,
    probe: bool = True,
    refuse: Callable[[Copied], str | None] = lambda copied: None,
    **options: Any,
) -> tuple[str, Copied] | None:
    """Copy the first donor that delivers, nearest first (:func:`by_round_trip`), else in
    the syncer's order; a donor that fails is logged and the copy starts over from the
    next (never a mix of two donors' chunks). ``refuse(copied)`` says why a delivered
    snapshot cannot be taken (a donor that lies about its state), or None: a refused donor
    is logged as one that failed. None when no donor delivered."""
    if probe and len(peers) > 1:
        ordered = by_round_trip(peers, run, secret, learner)
    else:
        ordered = list(peers.items())
    for pid, address in ordered:
        try:
            copied = fetch_snapshot(address, run, secret, learner, **options)
        except PeerError as exc:
            log.warning("learner %d: peer %s failed: %s", learner, pid, exc)
            continue
        why = refuse(copied)
        if why is None:
            return pid, copied
        log.warning("learner %d: peer %s refused: %s", learner, pid, why)
    return None
