"""Peer recovery, the donor's side: every learner serves snapshots of its state to newcomers.

Owns the snapshot server (a ROUTER thread in each learner); the newcomer's side is
peer_copy.py. The server never stops training: it asks the training loop for a snapshot,
which the loop takes between two steps as cloned tensors (:meth:`SnapshotServer.wanted` /
:meth:`SnapshotServer.provide`), then serves byte ranges of it straight from those tensors
(transport/tree.py's :class:`Layout`: no serialized copy) while training goes on, and frees
it once no requester needs it. A snapshot serves the requesters who ask within
``SHARE_SECONDS`` of its taking (a burst of restarts shares one clone); a later one gets a
fresh snapshot, never one left held by a copy that died mid-way minutes ago. Chunks are
authenticated frames like everything else; the whole stream is checked against its BLAKE3
digest at the end. The server's socket, like the syncer's, lets only holders of the run
secret complete a handshake (auth.py), and it has a zmq context of its own, so its
gatekeeper is the only one there. What a snapshot holds (parameters, inner optimizer, step,
data position, base versions; not the bases, which a newcomer replaces) is the Trainer's and
LearnerSync's business.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import zmq

from ddiloco.errors import ConfigError, DDiLoCoError
from ddiloco.runtime.processes.transport.auth import LEARNER_NAME, Gatekeeper, serve_plain
from ddiloco.runtime.processes.transport.sockets import Socket, configure, new_session
from ddiloco.runtime.processes.transport.tree import PREFIX, Layout
from ddiloco.runtime.processes.transport.wire import Limits, Wire, WireError

log = logging.getLogger(__name__)

MAX_CHUNK_BYTES = 4 << 20  # the most a server sends for one request
STALL_SECONDS = 10.0  # a requester hearing nothing for this long gives the donor up
WAIT_SECONDS = 120.0  # the most a requester waits for a donor's loop to take its snapshot
IDLE_KEEP_SECONDS = 30.0  # a snapshot nobody asked anything of for this long is freed
SHARE_SECONDS = 5.0  # a snapshot this young serves a new requester too (a burst of restarts)
MAX_HELD = 3  # past this many held, a new requester shares the newest whatever its age
MAX_WAITING = 16  # newcomers waiting for one snapshot at once; more are told the donor is busy
BEGIN_SECONDS = 1.0  # one connection's snapshot requests are served at most this often
LOOP_ALIVE_SECONDS = 60.0  # a donor whose loop looked this recently sends heartbeats
HEARTBEAT_SECONDS = 1.0


class PeerError(DDiLoCoError):
    """A peer could not deliver its snapshot (gone, frozen, or sent something wrong)."""


@dataclass
class _Held:
    """A snapshot being served: its stream, digest (once computed) and who is copying it."""

    layout: Layout
    touched: float
    taken: float = field(default_factory=time.monotonic)
    readers: set[int] = field(default_factory=set)
    digest: str = ""


class SnapshotServer(threading.Thread):
    """Serves this learner's snapshots to newcomers."""

    def __init__(
        self,
        bind_host: str,
        run: str,
        secret: bytes,
        learner: int,
        *,
        port: int = 0,
        advertise_host: str | None = None,
        advertise_port: int = 0,
    ) -> None:
        """Listen on ``bind_host:port`` (port 0: a free one); peers are told to dial
        ``advertise_host:advertise_port`` (default the bound address), so a learner can
        listen on 0.0.0.0 and advertise its routable address, or a port that a NAT, a
        Kubernetes service or a relay forwards. A fixed port that is taken is refused, naming
        it: firewalls and Kubernetes open that port and no other."""
        super().__init__(name=f"snapshot-server-{learner}", daemon=True)
        self.learner = learner
        self.wire = Wire(run, secret, f"P{learner}", new_session(), Limits(max_payload=1024))
        self.ctx: zmq.Context[Socket] = zmq.Context()
        self.gate = Gatekeeper(self.ctx, secret, run, lambda n: bool(LEARNER_NAME.fullmatch(n)))
        self.gate.start()  # before the bind: no handshake goes unchecked
        self.sock = self.ctx.socket(zmq.ROUTER)
        configure(self.sock, self.wire.limits)
        serve_plain(self.sock)
        try:
            if port:
                self.sock.bind(f"tcp://{bind_host}:{port}")
            else:
                port = self.sock.bind_to_random_port(f"tcp://{bind_host}")
        except zmq.ZMQError as exc:
            self.sock.close(0)
            self.gate.close()
            self.ctx.term()
            why = f"cannot listen for peer recovery on {bind_host}:{port}: {exc}"
            if exc.errno == zmq.EADDRINUSE:  # never another port silently: it is the open one
                why += " (another process holds it: stop that one, or choose another; 0: any)"
                raise ConfigError("--peer-port", port, why) from None
            raise ConfigError("--peer-bind", bind_host, why) from None
        self.port = port
        self.address = f"{advertise_host or bind_host}:{advertise_port or port}"
        self._want = threading.Event()
        self._lock = threading.Lock()
        self._waiting: dict[int, tuple[bytes, float]] = {}  # request -> ident, asked at
        self._held: dict[int, _Held] = {}
        self._next_id = 0
        self._polled = -1e9  # when the training loop last looked at `wanted`
        self._closing = threading.Event()
        self._began: dict[bytes, float] = {}  # connection -> its latest snap_begin served
        self.served = 0
        self.refused: dict[str, int] = {}  # requests refused, by reason (counted, said)

    @property
    def wanted(self) -> bool:
        self._polled = time.monotonic()  # the loop is alive: waiting requesters are told so
        return self._want.is_set()

    @property
    def held_bytes(self) -> int:
        """Bytes of snapshots held now (for tests and logs)."""
        with self._lock:
            return sum(h.layout.size for h in self._held.values())

    def provide(self, state: Any) -> None:
        """Called by the training loop, between two steps, when :attr:`wanted`, with a state
        of tensors nobody else writes (clones): they are served as they are. The digest is
        computed on a thread of its own (BLAKE3 releases the GIL), not in the loop."""
        held = _Held(Layout(state), time.monotonic())
        with self._lock:
            self._next_id += 1
            self._held[self._next_id] = held
            self._want.clear()
        threading.Thread(target=self._digest, args=(held,), daemon=True).start()

    @staticmethod
    def _digest(held: _Held) -> None:
        held.digest = held.layout.digest()

    def close(self) -> None:
        self._closing.set()
        self.join(timeout=2.0)

    def run(self) -> None:
        beat = 0.0
        while not self._closing.is_set():
            for _ in range(64):  # drain a burst, then do the bookkeeping
                if not self.sock.poll(50 if _ == 0 else 0):
                    break
                try:
                    frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
                    self._handle(frames)
                except zmq.Again:
                    break
                except (KeyError, TypeError, ValueError) as exc:  # a peer's malformed meta
                    log.warning("snapshot server %d: refused a request: %s", self.learner, exc)
            now = time.monotonic()
            self._expire(now)
            if self._waiting and now - beat >= HEARTBEAT_SECONDS:
                beat = now
                if now - self._polled < LOOP_ALIVE_SECONDS:  # the snapshot is coming
                    for ident, _ in list(self._waiting.values()):
                        self._reply(ident, "snap_wait", {})
        self.sock.close(0)
        self.gate.close()
        self.ctx.term()

    def _expire(self, now: float) -> None:
        """Announce to each waiter the newest snapshot if it was taken since they asked (a
        newcomer is never handed one held from before; one that waits on asks the loop
        again); free one no requester touched for IDLE_KEEP_SECONDS (one whose requesters
        all said done is freed at once)."""
        with self._lock:
            for sid in [s for s, h in self._held.items() if now - h.touched > IDLE_KEEP_SECONDS]:
                del self._held[sid]
            for req in [r for r, (_, at) in self._waiting.items() if now - at > WAIT_SECONDS]:
                del self._waiting[req]
            if not self._waiting:
                self._want.clear()  # nobody waits any more: no snapshot for nobody
            newest = self._held.get(self._next_id)
        for req, (ident, at) in list(self._waiting.items()):
            if newest is not None and newest.taken >= at:
                self._announce(ident, req, self._next_id, newest)
                del self._waiting[req]
        if self._waiting:
            self._want.set()

    def _announce(self, ident: bytes, req: int, sid: int, held: _Held) -> None:
        held.readers.add(req)
        held.touched = time.monotonic()
        head = held.layout.head_end - PREFIX
        self._reply(ident, "snap_meta", {"id": sid, "size": held.layout.size, "head": head})

    def _handle(self, frames: list[zmq.Frame]) -> None:
        if len(frames) < 2:
            return
        try:
            msg = self.wire.decode([f.buffer for f in frames[1:]])
        except WireError:
            return
        ident, meta = frames[0].bytes, msg.header.meta
        if msg.kind == "snap_ping":
            self._reply(ident, "snap_pong", {})
            return
        if msg.kind == "snap_begin":  # a fresh held snapshot serves a late requester too
            req = int(meta["req"])
            if not self._admit_begin(ident, req):
                return
            with self._lock:
                sid = self._next_id
                held = self._held.get(sid)
                full = len(self._held) >= MAX_HELD  # (a flood of requests: memory bounded)
            fresh = held is not None and time.monotonic() - held.taken < SHARE_SECONDS
            if held is not None and (fresh or full):
                self._announce(ident, req, sid, held)
            else:
                self._waiting[req] = (ident, time.monotonic())
                self._want.set()
            return
        sid = int(meta["id"])
        with self._lock:
            held = self._held.get(sid)
            if held is not None:
                held.touched = time.monotonic()
                if msg.kind == "snap_done":
                    held.readers.discard(int(meta["req"]))
                    if not held.readers:
                        del self._held[sid]
                    return
        if held is None:
            self._reply(ident, "snap_gone", {"id": sid})
        elif msg.kind == "snap_chunk":
            offset, length = int(meta["off"]), min(int(meta["len"]), MAX_CHUNK_BYTES)
            chunk = held.layout.read(offset, length)  # a view of the tensors: no copy
            self._reply(ident, "snap_data", {"id": sid, "off": offset}, chunk)
            self.served += len(chunk)
        elif msg.kind == "snap_sum":  # "" until the digest thread is done
            self._reply(ident, "snap_sum", {"id": sid, "blake3": held.digest})

    def _admit_begin(self, ident: bytes, req: int) -> bool:
        """A snapshot request is cheap to send and costs the donor a clone: one connection
        is served at most every BEGIN_SECONDS (an honest newcomer asks every few seconds),
        and at most MAX_WAITING newcomers wait at once (more: ``snap_busy``, and the
        newcomer tries its next donor). Counted in :attr:`refused` and said, rate-limited."""
        now = time.monotonic()
        if now - self._began.get(ident, -1e9) < BEGIN_SECONDS:
            return self._refuse("begin_rate", None)
        if req not in self._waiting and len(self._waiting) >= MAX_WAITING:
            return self._refuse("busy", ident)
        self._began[ident] = now
        if len(self._began) > 4 * MAX_WAITING:  # forget the connections gone quiet
            self._began = {i: t for i, t in self._began.items() if now - t < BEGIN_SECONDS}
        return True

    def _refuse(self, why: str, ident: bytes | None) -> bool:
        self.refused[why] = self.refused.get(why, 0) + 1
        if self.refused[why] in (1, 10, 100, 1000) or self.refused[why] % 10000 == 0:
            log.warning(
                "snapshot server %d: refused %d snapshot requests (%s)",
                self.learner,
                self.refused[why],
                "too many newcomers at once" if why == "busy" else "asked too often",
            )
        if ident is not None:
            self._reply(ident, "snap_busy", {})
        return False

    def _reply(
        self, ident: bytes, kind: str, meta: dict[str, Any], payload: bytes | memoryview = b""
    ) -> None:
        parts = self.wire.encode(kind, learner=self.learner, meta=meta, payload=payload)
        with contextlib.suppress(zmq.ZMQError):
            self.sock.send_multipart([ident, *parts], zmq.NOBLOCK, copy=False)
