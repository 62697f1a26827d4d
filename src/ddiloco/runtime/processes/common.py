"""Plumbing shared by the syncer service, learner processes and the launcher.

Owns: the run secret and session numbers, zmq socket settings, events printed as JSON lines
(the launcher relays them into metrics.jsonl), capped exponential backoff with jitter, and
the byte format of a learner's state snapshot (a nested structure of plain values and
tensors: msgpack plus raw tensor bytes, never pickle). No algorithm logic lives here.
"""

from __future__ import annotations

import json
import os
import random
import secrets
import sys
import threading
import time
from pathlib import Path
from typing import Any

import msgpack
import torch
import zmq

from ddiloco.errors import ConfigError
from ddiloco.runtime.processes.wire import SECRET_MIN_BYTES, Limits

Socket = zmq.Socket[bytes]
SECRET_ENV = "DDILOCO_SECRET"
EVENT_PREFIX = "@event "


def load_secret(secret_file: str | None) -> bytes:
    """The run secret: from ``secret_file`` (hex or raw bytes) or $DDILOCO_SECRET (hex)."""
    if secret_file:
        try:
            mode = os.stat(secret_file).st_mode
            raw = Path(secret_file).read_bytes().strip()
        except OSError as exc:
            raise ConfigError("--secret-file", secret_file, f"cannot read: {exc}") from None
        if mode & 0o077:  # as ssh refuses a private key others can read
            why = f"readable by others (mode {mode & 0o777:o}): chmod 600 it"
            raise ConfigError("--secret-file", secret_file, why)
        try:
            secret = bytes.fromhex(raw.decode("ascii"))
        except (UnicodeDecodeError, ValueError):
            secret = raw
    else:
        text = os.environ.get(SECRET_ENV, "")
        if not text:
            raise ConfigError("secret", None, f"set ${SECRET_ENV} (hex) or pass --secret-file")
        try:
            secret = bytes.fromhex(text)
        except ValueError:
            raise ConfigError(SECRET_ENV, "<hidden>", "must be hex") from None
    if len(secret) < SECRET_MIN_BYTES:
        raise ConfigError(
            "secret",
            f"{len(secret)} bytes",
            f"need >= {SECRET_MIN_BYTES} random bytes; make one with: python -c "
            "'import secrets; print(secrets.token_hex(32))'",
        )
    return secret


def new_session() -> int:
    """A fresh random number for every process life: not a clock reading, so a host whose
    clock is behind is never mistaken for an old life (the wire's replay window)."""
    return secrets.randbits(62) | 1


def parse_address(text: str, field: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ConfigError(field, text, "expected HOST:PORT, e.g. 127.0.0.1:5555")
    return host, int(port)


def configure(sock: Socket, limits: Limits) -> None:
    """Options every socket gets: drop unsent frames on close, refuse oversized messages in
    zmq itself (before the receiver allocates them), TCP keepalive."""
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, limits.max_frame)
    sock.setsockopt(zmq.TCP_KEEPALIVE, 1)


class Events:
    """Events as JSON lines on stdout (``@event {...}``), stamped with seconds since t0."""

    def __init__(self, t0: float, stream: Any = None) -> None:
        self.t0 = t0
        self.stream = stream or sys.stdout
        self._lock = threading.Lock()

    def now(self) -> float:
        return time.time() - self.t0

    def __call__(self, kind: str, **fields: Any) -> None:
        record = {"kind": kind, "t": round(self.now(), 4), **fields}
        line = EVENT_PREFIX + json.dumps(record, sort_keys=True, default=_jsonable) + "\n"
        with self._lock:
            self.stream.write(line)
            self.stream.flush()


def _jsonable(value: Any) -> Any:
    if isinstance(value, set | frozenset | tuple):
        return sorted(value) if isinstance(value, set | frozenset) else list(value)
    return str(value)


class Backoff:
    """Capped exponential backoff with full jitter: delay k is U(0.5, 1) x min(cap, base 2^k)."""

    def __init__(self, base: float = 0.1, cap: float = 5.0, rng: random.Random | None = None):
        self.base = base
        self.cap = cap
        self.attempt = 0
        self.rng = rng or random.Random()

    def next_delay(self) -> float:
        delay = min(self.cap, self.base * 2.0**self.attempt)
        self.attempt += 1
        return delay * (0.5 + 0.5 * self.rng.random())

    def reset(self) -> None:
        self.attempt = 0


# -- snapshots: nested plain values and tensors <-> bytes -------------------------------------
_TENSOR = "__tensor__"
_TUPLE = "__tuple__"


def pack_tree(tree: Any) -> bytes:
    """Serialize dicts/lists/tuples of scalars, strings and tensors (any dtype)."""
    blobs: list[bytes] = []
    specs: list[list[Any]] = []

    def walk(node: Any) -> Any:
        if isinstance(node, torch.Tensor):
            t = node.detach().to("cpu").contiguous()
            specs.append([str(t.dtype).removeprefix("torch."), list(t.shape)])
            blobs.append(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
            return {_TENSOR: len(specs) - 1}
        if isinstance(node, dict):
            return {k: walk(v) for k, v in node.items()}
        if isinstance(node, tuple):
            return {_TUPLE: [walk(v) for v in node]}
        if isinstance(node, list):
            return [walk(v) for v in node]
        return node

    structure = walk(tree)
    head = msgpack.packb(
        {"tree": structure, "tensors": specs, "sizes": [len(b) for b in blobs]},
        use_bin_type=True,
    )
    return bytes(len(head).to_bytes(8, "little") + head + b"".join(blobs))


def unpack_tree(data: bytes | memoryview) -> Any:
    """Inverse of :func:`pack_tree`; tensors come back as fresh, writable CPU tensors."""
    view = memoryview(data)
    n = int.from_bytes(view[:8], "little")
    head = msgpack.unpackb(view[8 : 8 + n], raw=False, strict_map_key=False)
    tensors: list[torch.Tensor] = []
    pos = 8 + n
    for (dtype_name, shape), size in zip(head["tensors"], head["sizes"], strict=True):
        dtype = getattr(torch, dtype_name, None)
        if not isinstance(dtype, torch.dtype):
            raise ConfigError("snapshot.dtype", dtype_name, "unknown tensor dtype")
        raw = bytearray(view[pos : pos + size])
        pos += size
        flat = (
            torch.frombuffer(raw, dtype=torch.uint8) if size else torch.empty(0, dtype=torch.uint8)
        )
        tensors.append(flat.view(dtype).reshape(shape) if size else torch.empty(shape, dtype=dtype))

    def walk(node: Any) -> Any:
        if isinstance(node, dict):
            if set(node) == {_TENSOR}:
                return tensors[node[_TENSOR]]
            if set(node) == {_TUPLE}:
                return tuple(walk(v) for v in node[_TUPLE])
            return {k: walk(v) for k, v in node.items()}
        if isinstance(node, list):
            return [walk(v) for v in node]
        return node

    return walk(head["tree"])
