"""The wire format of the process runtime: authenticated, checksummed, replay-proof frames.

Owns how one message between the syncer and learners (or between two learners, for peer
recovery) becomes bytes and back. Never pickle: a frame is three parts, sent as one zmq
multipart message so the payload is never copied into a larger buffer::

    head     magic 4s b"DDWF" | version u8 | flags u8 (0) | reserved u16 (0)
             | header_len u32 | payload_len u64 | msgpack header (header_len bytes)
    payload  raw bytes (tensor bundles in the codec's format, or snapshot chunks)
    trailer  crc32 u32 over head + payload | HMAC-SHA256 (32 bytes) over head + payload + crc

The header binds the run id, the sender and its session (a fresh number per process life),
the kind, learner, fragment, round and a per-session sequence number, so the HMAC under the
run secret authenticates all of them together with the payload. :meth:`Wire.decode` checks
the sizes against :class:`Limits` before anything is allocated, then the HMAC (and, only when
it fails, the checksum, to tell a corrupted frame from a forged one: one hash pass on the
hot path instead of two), the header's types, the run id, and
the sender's replay window (a duplicated or replayed frame). Every refusal raises
:class:`WireError`, which names the field and carries a short ``reason`` for the counters.
It knows nothing of sockets, rounds or training.
"""

from __future__ import annotations

import hmac
import logging
import struct
import threading
import zlib
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
import torch

from ddiloco.core.codec import decode_tensors
from ddiloco.errors import CodecError, DDiLoCoError

log = logging.getLogger(__name__)

MAGIC = b"DDWF"
VERSION = 1
PREFIX = struct.Struct("<4sBBHIQ")  # magic, version, flags, reserved, header_len, payload_len
TRAILER = struct.Struct("<I32s")  # crc32, hmac-sha256
SECRET_MIN_BYTES = 16
REPLAY_WINDOW = 4096  # sequence numbers remembered per sender session

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
    """Per sender: its latest session and the sequence numbers seen in it.

    A frame from an older session, a sequence number already seen, or one that fell behind
    the window is refused. Frames may arrive out of order inside the window.
    """

    def __init__(self, size: int = REPLAY_WINDOW) -> None:
        self.size = size
        self._senders: dict[str, tuple[int, int, set[int]]] = {}  # session, highest, seen

    def check(self, sender: str, session: int, seq: int) -> None:
        """Raise :class:`WireError` for a replay, else record ``seq``."""
        known = self._senders.get(sender)
        if known is None or session > known[0]:
            self._senders[sender] = (session, seq, {seq})
            return
        current, highest, seen = known
        if session < current:
            raise WireError("session", session, f"{sender} is in session {current}", "replay")
        if seq in seen or seq <= highest - self.size:
            raise WireError("seq", seq, f"already seen from {sender} (duplicate)", "replay")
        seen.add(seq)
        if seq > highest:
            highest = seq
            if len(seen) > 2 * self.size:
                seen = {s for s in seen if s > highest - self.size}
        self._senders[sender] = (current, highest, seen)

    def forget(self, sender: str) -> None:
        self._senders.pop(sender, None)


class Wire:
    """Encodes this process's frames and decodes its peers', under one run id and secret."""

    def __init__(
        self,
        run: str,
        secret: bytes,
        sender: str,
        session: int,
        limits: Limits | None = None,
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
        self._seq = 0
        self._lock = threading.Lock()

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
    ) -> list[Part]:
        """One frame as its three parts (head, payload, trailer), with the next sequence."""
        body = _as_view(payload)
        with self._lock:
            seq = self._seq
            self._seq += 1
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
            },
            use_bin_type=True,
        )
        head = PREFIX.pack(MAGIC, VERSION, 0, 0, len(header), body.nbytes) + header
        crc = zlib.crc32(body, zlib.crc32(head))
        mac = hmac.new(self._secret, head, "sha256")
        mac.update(body)
        mac.update(struct.pack("<I", crc))
        return [head, body, TRAILER.pack(crc, mac.digest())]

    # -- receiving --------------------------------------------------------------------------
    def decode(self, parts: Sequence[Part], *, replay: bool = True) -> Message:
        """Check one received frame (its parts, or one joined blob) and return it.

        Raises :class:`WireError` naming what is wrong; the refusal is logged and counted
        in :attr:`refused` under its reason.
        """
        try:
            return self._decode(parts, replay)
        except WireError as exc:
            self.refused[exc.reason] += 1
            log.warning("wire: refused frame: %s (%s)", exc, exc.reason)
            raise

    def _decode(self, parts: Sequence[Part], replay: bool) -> Message:
        views = [_as_view(p) for p in parts]
        if len(views) == 1:
            views = _split(views[0], self.limits)
        if len(views) != 3:
            raise WireError("parts", len(views), "a frame has 3 parts", "truncated")
        head, body, trailer = views
        header_len, payload_len = _prefix(head, self.limits)
        if len(head) != PREFIX.size + header_len:
            raise WireError("header_len", header_len, f"head is {len(head)} bytes", "truncated")
        if body.nbytes != payload_len:
            raise WireError("payload_len", payload_len, f"got {body.nbytes} bytes", "truncated")
        if len(trailer) != TRAILER.size:
            raise WireError("trailer", len(trailer), f"need {TRAILER.size} bytes", "truncated")
        crc, tag = TRAILER.unpack(trailer)
        mac = hmac.new(self._secret, head, "sha256")
        mac.update(body)
        mac.update(struct.pack("<I", crc))
        if not hmac.compare_digest(mac.digest(), tag):
            # the HMAC covers the checksum too, so the crc is only needed to tell a frame
            # damaged on the way (corrupted) from one never signed with this secret (forged)
            if zlib.crc32(body, zlib.crc32(head)) != crc:
                raise WireError("checksum", crc, "crc32 over header and payload differs",
                                "checksum")  # fmt: skip
            raise WireError("hmac", tag.hex()[:16], "not signed with this run's secret", "auth")
        header = _header(head[PREFIX.size :], self.limits)
        if header.run != self.run:
            raise WireError("run", header.run, f"this is run {self.run!r}", "run")
        if replay:
            self.window.check(header.sender, header.session, header.seq)
        return Message(header, body)


def _split(blob: memoryview, limits: Limits) -> list[memoryview]:
    """Cut one joined frame (as a fault-injecting proxy or a test sees it) into its parts."""
    header_len, payload_len = _prefix(blob, limits)
    head_end = PREFIX.size + header_len
    body_end = head_end + payload_len
    if len(blob) != body_end + TRAILER.size:
        raise WireError("length", len(blob), f"frame is {body_end + TRAILER.size}", "truncated")
    return [blob[:head_end], blob[head_end:body_end], blob[body_end:]]


def _prefix(head: memoryview, limits: Limits) -> tuple[int, int]:
    if len(head) < PREFIX.size:
        raise WireError("length", len(head), f"shorter than the {PREFIX.size}-byte prefix",
                        "truncated")  # fmt: skip
    magic, version, flags, reserved, header_len, payload_len = PREFIX.unpack_from(head, 0)
    if magic != MAGIC:
        raise WireError("magic", bytes(magic), f"expected {MAGIC!r}", "magic")
    if version != VERSION:
        raise WireError("version", version, f"only version {VERSION} is known", "version")
    if flags or reserved:
        raise WireError("flags", (flags, reserved), "must be zero", "header")
    if header_len > limits.max_header:
        raise WireError("header_len", header_len, f"limit {limits.max_header}", "oversized")
    if payload_len > limits.max_payload:
        raise WireError("payload_len", payload_len, f"limit {limits.max_payload}", "oversized")
    return header_len, payload_len


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
}


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
    if values["seq"] < 0 or values["session"] < 0:
        raise WireError("header.seq", values["seq"], "must be >= 0", "header")
    return Header(**values)


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
