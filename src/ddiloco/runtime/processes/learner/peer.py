"""Peer recovery: every learner serves a snapshot of its state; a newcomer pulls it in chunks.

Owns the snapshot server (a ROUTER thread in each learner) and the client a (re)starting
learner uses. The server never stops training: it asks the training loop for a snapshot,
which the loop builds between two steps (:meth:`SnapshotServer.wanted` /
:meth:`SnapshotServer.provide`), then serves its chunks from memory while training goes
on. Chunks are authenticated frames like everything else; the whole snapshot is checked
against its SHA-256 at the end. The server's socket, like the syncer's, lets only holders
of the run secret complete a handshake (auth.py), and it has a zmq context of its own, so
its gatekeeper is the only one there. What a snapshot holds (parameters, inner optimizer, step,
data position, base versions and bases) is the Trainer's and LearnerSync's business.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import threading
import time
from typing import Any

import zmq

from ddiloco.errors import ConfigError, DDiLoCoError
from ddiloco.runtime.processes.transport.auth import LEARNER_NAME, Gatekeeper, present, serve_plain
from ddiloco.runtime.processes.transport.sockets import Socket, configure, new_session
from ddiloco.runtime.processes.transport.wire import Limits, Wire, WireError

log = logging.getLogger(__name__)

CHUNK_BYTES = 1 << 20
KEEP_SECONDS = 60.0


class PeerError(DDiLoCoError):
    """A peer could not deliver its snapshot (gone, frozen, or sent something wrong)."""


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
    ) -> None:
        """Listen on ``bind_host:port`` (port 0: a free one); peers are told to dial
        ``advertise_host`` (default ``bind_host``), so a learner can listen on 0.0.0.0 and
        advertise its routable address. A fixed port that is taken is refused, naming it:
        firewalls and Kubernetes open that port and no other."""
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
        self.address = f"{advertise_host or bind_host}:{port}"
        self._want = threading.Event()
        self._lock = threading.Lock()
        self._waiting: list[bytes] = []  # requesters waiting for the next snapshot
        self._blobs: dict[int, tuple[bytes, str, float]] = {}  # id -> blob, digest, made at
        self._next_id = 0
        self._closing = threading.Event()
        self.served = 0

    @property
    def wanted(self) -> bool:
        return self._want.is_set()

    def provide(self, blob: bytes) -> None:
        """Called by the training loop, between two steps, when :attr:`wanted`."""
        with self._lock:
            self._next_id += 1
            self._blobs[self._next_id] = (blob, hashlib.sha256(blob).hexdigest(), time.time())
            self._want.clear()

    def close(self) -> None:
        self._closing.set()
        self.join(timeout=2.0)

    def run(self) -> None:
        announced = 0
        while not self._closing.is_set():
            if self.sock.poll(50):
                try:
                    frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
                    self._handle(frames)
                except zmq.Again:
                    pass
            with self._lock:
                newest = self._next_id
                for sid in [
                    s
                    for s, (_, _, made) in self._blobs.items()
                    if time.time() - made > KEEP_SECONDS and s != newest
                ]:
                    del self._blobs[sid]
            if newest != announced and self._waiting:
                blob, digest, _ = self._blobs[newest]
                chunks = -(-len(blob) // CHUNK_BYTES)
                meta = {"id": newest, "size": len(blob), "chunks": chunks, "sha256": digest}
                for ident in self._waiting:
                    self._reply(ident, "snap_meta", meta)
                self._waiting.clear()
                announced = newest
        self.sock.close(0)
        self.gate.close()
        self.ctx.term()

    def _handle(self, frames: list[zmq.Frame]) -> None:
        if len(frames) < 2:
            return
        try:
            msg = self.wire.decode([f.buffer for f in frames[1:]])
        except WireError:
            return
        ident = frames[0].bytes
        if msg.kind == "snap_begin":
            self._waiting.append(ident)
            self._want.set()
        elif msg.kind == "snap_chunk":
            sid, index = int(msg.header.meta["id"]), int(msg.header.meta["index"])
            with self._lock:
                held = self._blobs.get(sid)
            if held is None:
                self._reply(ident, "snap_gone", {"id": sid})
                return
            chunk = memoryview(held[0])[index * CHUNK_BYTES : (index + 1) * CHUNK_BYTES]
            self._reply(ident, "snap_data", {"id": sid, "index": index}, chunk)
            self.served += chunk.nbytes

    def _reply(
        self, ident: bytes, kind: str, meta: dict[str, Any], payload: bytes | memoryview = b""
    ) -> None:
        parts = self.wire.encode(kind, learner=self.learner, meta=meta, payload=payload)
        with contextlib.suppress(zmq.ZMQError):
            self.sock.send_multipart([ident, *parts], zmq.NOBLOCK, copy=False)


def fetch_snapshot(
    address: str, run: str, secret: bytes, learner: int, *, timeout: float = 20.0, window: int = 4
) -> bytes:
    """Pull a peer's snapshot in chunks (``window`` in flight); raise :class:`PeerError`."""
    wire = Wire(run, secret, f"R{learner}", new_session(), Limits(max_payload=2 * CHUNK_BYTES))
    ctx: zmq.Context[Socket] = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    configure(sock, wire.limits)
    present(sock, secret, run, f"L{learner}")
    sock.connect(f"tcp://{address}")
    deadline = time.monotonic() + timeout

    def receive(kind: str) -> tuple[dict[str, Any], memoryview]:
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not sock.poll(int(left * 1000)):
                raise PeerError("peer", address, f"no {kind} within {timeout:.0f}s")
            try:
                msg = wire.decode([f.buffer for f in sock.recv_multipart(copy=False)])
            except WireError:
                continue
            if msg.kind == "snap_gone":
                raise PeerError("peer", address, "the snapshot expired")
            if msg.kind == kind:
                return msg.header.meta, msg.payload

    try:
        sock.send_multipart(wire.encode("snap_begin", learner=learner))
        meta, _ = receive("snap_meta")
        sid, size, chunks = int(meta["id"]), int(meta["size"]), int(meta["chunks"])
        blob = bytearray(size)
        asked, got = 0, 0
        while got < chunks:
            while asked < chunks and asked - got < window:
                sock.send_multipart(
                    wire.encode("snap_chunk", learner=learner, meta={"id": sid, "index": asked})
                )
                asked += 1
            part_meta, data = receive("snap_data")
            index = int(part_meta["index"])
            blob[index * CHUNK_BYTES : index * CHUNK_BYTES + data.nbytes] = data
            got += 1
        if hashlib.sha256(blob).hexdigest() != meta["sha256"]:
            raise PeerError("sha256", address, "the snapshot does not match its digest")
        return bytes(blob)
    finally:
        sock.close(0)
