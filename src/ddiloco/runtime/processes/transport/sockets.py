"""Plumbing every process shares on the network side: the run secret, session numbers,
``HOST:PORT`` parsing, the options every zmq socket gets, and capped exponential backoff with
jitter. No algorithm logic lives here."""

from __future__ import annotations

import os
import random
import secrets
from pathlib import Path

import zmq

from ddiloco.errors import ConfigError
from ddiloco.runtime.processes.transport.wire import SECRET_MIN_BYTES, Limits

Socket = zmq.Socket[bytes]
SECRET_ENV = "DDILOCO_SECRET"


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
