"""The wire format of the process runtime: authenticated, checksummed, replay-proof frames.

Owns how one message between the syncer and learners (or between two learners, for peer
recovery) becomes bytes and back. Never pickle: a frame is three parts, sent as one zmq
multipart message so the payload is never copied into a larger buffer::

    head     magic 4s b"DDWF" | version u8 | flags u8 | reserved u16 (0)
             | header_len u32 | payload_len u64 | msgpack header (header_len bytes)
    payload  raw bytes (tensor bundles in the codec's format, or snapshot chunks), or with
             flag SHM a reference to a same-host shared-memory slot holding them (shm.py)
    trailer  digest (32 bytes) = BLAKE3(head | BLAKE3(payload))
             | tag (32 bytes) = HMAC-SHA256(run secret, digest)

The digest is the checksum over header and payload; the HMAC-SHA256 tag over it
authenticates both (hash-then-MAC, as TLS signs a handshake hash): BLAKE3 runs at more than
twice SHA-256's speed per core and in parallel over large payloads, so the per-byte cost of
authentication halves (docs/decisions.md, "wire digest"). A payload sent to several
receivers (a broadcast) is hashed once. The header binds the run id, the sender and its
session (a fresh number per process life), the kind, learner, fragment, round and a
per-session sequence number, so the tag authenticates all of them together with the payload.
:meth:`Wire.decode` checks the sizes against :class:`Limits` before anything is allocated,
then the digest (a mismatch: corrupted on the way), the tag (a mismatch: not signed with this
run's secret), the header's types, the run id, and the sender's replay window (a duplicated
or replayed frame). Every refusal raises :class:`WireError`, which names the field and
carries a short ``reason`` for the counters.
It knows nothing of sockets, rounds or training.
"""

from __future__ import annotations

import hmac
import logging
import os
import struct
import threading
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
import torch
from blake3 import blake3

from ddiloco.core.codec import decode_tensors
from ddiloco.errors import CodecError, DDiLoCoError
from ddiloco.runtime.processes.transport.ratelog import RateLimitedLog
from ddiloco.runtime.processes.transport.shm import ShmExpired, ShmMissing, ShmReader, ShmWriter

log = logging.getLogger(__name__)

MAGIC = b"DDWF"
VERSION = 3  # 3: the header names the receiver's session ("to")
FLAG_SHM = 1  # the payload part is a reference to a shared-memory slot (shm.py)
PREFIX = struct.Struct("<4sBBHIQ")  # magic, version, flags, reserved, header_len, payload_len
TRAILER = struct.Struct("<32s32s")  # BLAKE3 digest of head + payload, HMAC-SHA256 of it
MAX_REF = 256  # bytes of a shared-memory reference
PARALLEL_HASH_BYTES = 4 << 20  # payloads this large are hashed on several threads, where
PARALLEL_HASH_CPUS = 8  # there are this many cores (on fewer, the other end needs them)
SECRET_MIN_BYTES = 32  # 256 bits, as the launcher generates
REPLAY_WINDOW = 4096  # sequence numbers remembered per sender session
RETIRED_SESSIONS = 256  # earlier sessions remembered per sender (their frames are replays)
MAX_COUNTER = (1 << 63) - 1  # sessions and sequence numbers are non-negative int64

Part = bytes | bytearray | memoryview


class WireError(DDiLoCoError):
    """A frame was refused. ``reason`` is the counter it is filed under (e.g. "checksum")."""

    def __init__(self, field: str, value: Any, why: str, reason: str) -> None:
        super().__init__(field, value, why)
        self.reason = reason


@dataclass(frozen=True)
class Limits:
    """Largest header and payload a receiver accepts; checked before allocating."""

    max_header: int = 64 * 1024
    max_payload: int = 256 * 1024 * 1024

    @property
    def max_frame(self) -> int:
        return PREFIX.size + self.max_header + self.max_payload + TRAILER.size


@dataclass(frozen=True)
class Header:
    """What a frame says about itself; every field is covered by the HMAC."""

    run: str
    sender: str
    session: int
    kind: str
    learner: int
    fragment: int
    round: int
    seq: int
    meta: dict[str, Any] = field(default_factory=dict)
    to: int = 0  # the receiver's session this frame is for (0: not known yet, a first hello)


@dataclass(frozen=True)
class Message:
    """A frame that passed every check."""

    header: Header
    payload: memoryview

    @property
    def kind(self) -> str:
        return self.header.kind


def _as_view(part: Part) -> memoryview:
    mv = memoryview(part)
    return mv if mv.format == "B" and mv.ndim == 1 else mv.cast("B")


class ReplayWindow:
    """Per sender: its current session, the sequence numbers seen in it, and the sessions
    it had before.

    Sessions are random numbers, not clock readings (a host whose clock is behind must not
    be locked out), so they have no order: a session never seen from this sender starts its
    new life, and the one before is retired; a frame of a retired session, a sequence number
    already seen, or one that fell behind the window is refused. Frames may arrive out of
    order inside the window. A restarted receiver remembers nothing: the services bind every
    frame to the receiver's own session (``Header.to``), so frames captured before a restart
    are refused by the next life anyway.
    """

    def __init__(self, size: int = REPLAY_WINDOW) -> None:
        self.size = size
        self._senders: dict[str, tuple[int, int, set[int]]] = {}  # session, highest, seen
        self._retired: dict[str, dict[int, None]] = {}  # sender -> earlier sessions, in order

    def check(self, sender: str, session: int, seq: int) -> None:
        """Raise :class:`WireError` for a replay, else record ``seq``."""
        known = self._senders.get(sender)
        retired = self._retired.setdefault(sender, {})
        if session in retired:
            raise WireError("session", session, f"an earlier session of {sender}", "replay")
        if known is None or session != known[0]:
            if known is not None:
                retired[known[0]] = None
                while len(retired) > RETIRED_SESSIONS:
                    del retired[next(iter(retired))]
            self._senders[sender] = (session, seq, {seq})
            return
        current, highest, seen = known
        if seq in seen or seq <= highest - self.size:
            raise WireError("seq", seq, f"already seen from {sender} (duplicate)", "replay")
        seen.add(seq)
        if seq > highest:
            highest = seq
            if len(seen) > 2 * self.size:
                seen = {s for s in seen if s > highest - self.size}
        self._senders[sender] = (current, highest, seen)


class Wire:
    """Encodes this process's frames and decodes its peers', under one run id and secret.

    With ``shm`` (a :class:`ShmWriter`, for receivers on this host) large payloads travel
    through shared memory; any Wire reads such frames from this host's run directory.
    """

    def __init__(
        self,
        run: str,
        secret: bytes,
        sender: str,
        session: int,
        limits: Limits | None = None,
        shm: ShmWriter | None = None,
    ) -> None:
        if len(secret) < SECRET_MIN_BYTES:
            raise WireError("secret", f"{len(secret)} bytes", f"need >= {SECRET_MIN_BYTES}", "key")
        self.run = run
        self._secret = bytes(secret)
        self.sender = sender
        self.session = session
        self.limits = limits or Limits()
        self.window = ReplayWindow()
        self.refused: Counter[str] = Counter()
        self.shm = shm
        self.shm_reader = ShmReader(run)
        self._seq = 0
        self._lock = threading.Lock()
        self._last: tuple[bytes, bytes] | None = None  # (payload, digest): one broadcast
        self._say = RateLimitedLog(log)

    @property
    def secret(self) -> bytes:
        """The run secret (the connection credentials derive from it: auth.py)."""
        return self._secret

    # -- sending ----------------------------------------------------------------------------
    def encode(
        self,
        kind: str,
        *,
        learner: int = -1,
        fragment: int = -1,
        round: int = -1,
        meta: dict[str, Any] | None = None,
        payload: Part = b"",
        inline: bool = False,
        busy: frozenset[bytes] = frozenset(),
        to: int = 0,
    ) -> list[Part]:
        """One frame as its three parts (head, payload, trailer), with the next sequence;
        ``inline`` keeps the payload in the frame (a receiver that cannot see our slots);
        ``busy``: shared-memory references not to overwrite (see :meth:`ShmWriter.put`);
        ``to``: the receiver's session (its frames say theirs), 0 when not known yet."""
        body = _as_view(payload)
        with self._lock:
            seq = self._seq
            self._seq += 1
            last = self._last
            if isinstance(payload, bytes) and last is not None and last[0] is payload:
                digest = last[1]  # the same immutable payload again: hashed once
            else:
                digest = _digest(body)
                if isinstance(payload, bytes):
                    self._last = (payload, digest)
            shm = None if inline else self.shm
            ref = shm.put(f"{kind}-{fragment}", body, digest, seq, busy) if shm else None
        header = msgpack.packb(
            {
                "run": self.run,
                "src": self.sender,
                "ses": self.session,
                "k": kind,
                "l": learner,
                "f": fragment,
                "r": round,
                "q": seq,
                "m": meta or {},
                "to": to,
            },
            use_bin_type=True,
        )
        flags = 0 if ref is None else FLAG_SHM
        head = PREFIX.pack(MAGIC, VERSION, flags, 0, len(header), body.nbytes) + header
        check = blake3(head + digest).digest()
        tag = hmac.digest(self._secret, check, "sha256")
        return [head, body if ref is None else ref, TRAILER.pack(check, tag)]

    def close(self) -> None:
        """Release shared-memory slots (this sender's) and maps (of others)."""
        if self.shm is not None:
            self.shm.close()
        self.shm_reader.close()

    # -- receiving --------------------------------------------------------------------------
    def decode(self, parts: Sequence[Part], *, admit: bool = True) -> Message:
        """Check one received frame (its parts, or one joined blob) and return it.

        Raises :class:`WireError` naming what is wrong; the refusal is logged and counted
        in :attr:`refused` under its reason. ``admit=False`` checks everything but the
        replay window, which the caller consults with :meth:`admit` once it trusts the
        connection (a frame must not retire a sender's session before that).
        """
        try:
            msg = self._decode(parts)
            if admit:
                self.window.check(msg.header.sender, msg.header.session, msg.header.seq)
            return msg
        except WireError as exc:
            self._refused(exc)
            raise

    def admit(self, header: Header) -> None:
        """The replay window's check of a frame decoded with ``admit=False``."""
        try:
            self.window.check(header.sender, header.session, header.seq)
        except WireError as exc:
            self._refused(exc)
            raise

    def _refused(self, exc: WireError) -> None:
        self.refused[exc.reason] += 1
        level = logging.INFO if exc.reason == "expired" else logging.WARNING  # (a race)
        self._say(exc.reason, "wire: refused frame: %s (%s)", exc, exc.reason, level=level)

    def _decode(self, parts: Sequence[Part]) -> Message:
        views = [_as_view(p) for p in parts]
        if len(views) == 1:
            views = _split(views[0], self.limits)
        if len(views) != 3:
            raise WireError("parts", len(views), "a frame has 3 parts", "truncated")
        head, body, trailer = views
        flags, header_len, payload_len = _prefix(head, self.limits)
        if len(head) != PREFIX.size + header_len:
            raise WireError("header_len", header_len, f"head is {len(head)} bytes", "truncated")
        if len(trailer) != TRAILER.size:
            raise WireError("trailer", len(trailer), f"need {TRAILER.size} bytes", "truncated")
        if flags & FLAG_SHM:
            if body.nbytes > MAX_REF:
                raise WireError("shm", body.nbytes, f"a reference is <= {MAX_REF} bytes", "shm")
            try:
                body = memoryview(self.shm_reader.get(body, payload_len))
            except ShmMissing as exc:  # the sender is told to send inline (see the services)
                raise WireError("shm", "slot", str(exc), "shm_missing") from None
            except ShmExpired as exc:
                raise WireError("shm", "slot", str(exc), "expired") from None
        if body.nbytes != payload_len:
            raise WireError("payload_len", payload_len, f"got {body.nbytes} bytes", "truncated")
        check, tag = TRAILER.unpack(trailer)
        expected = blake3(bytes(head) + _digest(body)).digest()
        if not hmac.compare_digest(expected, check):
            raise WireError(
                "digest",
                check.hex()[:16],
                "BLAKE3 digest over header and payload differs: damaged on the way",
                "checksum",
            )
        if not hmac.compare_digest(hmac.digest(self._secret, check, "sha256"), tag):
            raise WireError("hmac", tag.hex()[:16], "not signed with this run's secret", "auth")
        header = _header(head[PREFIX.size :], self.limits)
        if header.run != self.run:
            raise WireError("run", header.run, f"this is run {self.run!r}", "run")
        return Message(header, body)


def payload_size(parts: Sequence[Part]) -> int:
    """The payload bytes a frame from :meth:`Wire.encode` carries (inline or by reference)."""
    return int(PREFIX.unpack_from(parts[0], 0)[5])


def _digest(body: memoryview) -> bytes:
    parallel = body.nbytes >= PARALLEL_HASH_BYTES and (os.cpu_count() or 1) >= PARALLEL_HASH_CPUS
    threads = blake3.AUTO if parallel else 1
    return blake3(body, max_threads=threads).digest()


def _split(blob: memoryview, limits: Limits) -> list[memoryview]:
    """Cut one joined frame (as a fault-injecting proxy or a test sees it) into its parts."""
    _, header_len, _ = _prefix(blob, limits)
    head_end = PREFIX.size + header_len
    if len(blob) < head_end + TRAILER.size:
        raise WireError("length", len(blob), f"shorter than head + {TRAILER.size}", "truncated")
    return [
        blob[:head_end],
        blob[head_end : len(blob) - TRAILER.size],
        blob[len(blob) - TRAILER.size :],
    ]


def _prefix(head: memoryview, limits: Limits) -> tuple[int, int, int]:
    if len(head) < PREFIX.size:
        raise WireError(
            "length", len(head), f"shorter than the {PREFIX.size}-byte prefix", "truncated"
        )
    magic, version, flags, reserved, header_len, payload_len = PREFIX.unpack_from(head, 0)
    if magic != MAGIC:
        raise WireError("magic", bytes(magic), f"expected {MAGIC!r}", "magic")
    if version != VERSION:
        raise WireError("version", version, f"only version {VERSION} is known", "version")
    if flags & ~FLAG_SHM or reserved:
        raise WireError("flags", (flags, reserved), f"unknown flags (known: {FLAG_SHM})", "header")
    if header_len > limits.max_header:
        raise WireError("header_len", header_len, f"limit {limits.max_header}", "oversized")
    if payload_len > limits.max_payload:
        raise WireError("payload_len", payload_len, f"limit {limits.max_payload}", "oversized")
    return flags, header_len, payload_len


def peek_kind(head: bytes, limits: Limits = Limits()) -> str | None:
    """The kind a frame's head *claims*, unchecked (no digest, no tag): for the fault proxy
    to choose which frames to injure, never for trusting one. None when it does not parse."""
    try:
        _prefix(memoryview(head), limits)
        data = msgpack.unpackb(head[PREFIX.size :], raw=False, strict_map_key=True)
    except (WireError, ValueError, msgpack.UnpackException):
        return None
    kind = data.get("k") if isinstance(data, dict) else None
    return kind if isinstance(kind, str) else None


_FIELDS: dict[str, tuple[str, type]] = {
    "run": ("run", str),
    "src": ("sender", str),
    "ses": ("session", int),
    "k": ("kind", str),
    "l": ("learner", int),
    "f": ("fragment", int),
    "r": ("round", int),
    "q": ("seq", int),
    "m": ("meta", dict),
    "to": ("to", int),
}
META_DEPTH = 4  # meta values nest at most this deep (lists of lists of ints, at most)


def _header(raw: memoryview, limits: Limits) -> Header:
    try:
        data = msgpack.unpackb(raw, raw=False, strict_map_key=True)  # size checked before
    except (ValueError, msgpack.UnpackException) as exc:
        raise WireError("header", type(exc).__name__, f"not msgpack: {exc}", "header") from None
    if not isinstance(data, dict) or set(data) != set(_FIELDS):
        keys = sorted(data) if isinstance(data, dict) else type(data).__name__
        raise WireError("header", keys, f"expected keys {sorted(_FIELDS)}", "header")
    values: dict[str, Any] = {}
    for key, (name, kind) in _FIELDS.items():
        value = data[key]
        if not isinstance(value, kind) or isinstance(value, bool):
            raise WireError(f"header.{name}", value, f"expected {kind.__name__}", "header")
        values[name] = value
    for name in ("seq", "session", "to"):
        if not 0 <= values[name] <= MAX_COUNTER:
            raise WireError(
                f"header.{name}", values[name], f"must be in [0, {MAX_COUNTER}]", "header"
            )
    if _depth(values["meta"]) > META_DEPTH:
        raise WireError("header.meta", "...", f"nested deeper than {META_DEPTH}", "header")
    return Header(**values)


def _depth(value: Any, level: int = 0) -> int:
    """How deep ``value`` nests (stops counting past META_DEPTH: never recurses far)."""
    if level > META_DEPTH or not isinstance(value, dict | list):
        return level
    items = value.values() if isinstance(value, dict) else value
    return max((_depth(v, level + 1) for v in items), default=level + 1)


def decode_update(
    payload: Part, expected_shapes: Sequence[tuple[int, ...]] | None = None
) -> list[torch.Tensor]:
    """Decode a tensor bundle from an authenticated frame and refuse NaN/Inf values.

    The HMAC proves who sent a payload, not that it is sane: a diverged learner (or a bug)
    can sign a NaN update. Raises :class:`WireError` (reason "codec" or "nonfinite").
    """
    try:
        tensors = decode_tensors(payload, expected_shapes=expected_shapes)
    except CodecError as exc:
        reason = "nonfinite" if "NaN" in exc.why else "codec"  # the codec checks fp32/bf16
        raise WireError(f"payload.{exc.field}", exc.value, exc.why, reason) from None
    for i, t in enumerate(tensors):
        if not bool(torch.isfinite(t).all()):
            raise WireError(f"payload[{i}]", "non-finite", "NaN/Inf update refused", "nonfinite")
    return tensors
