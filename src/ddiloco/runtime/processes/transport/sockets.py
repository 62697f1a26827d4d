"""Plumbing every process shares on the network side: the run secret, session numbers,
``HOST:PORT`` parsing, the options every zmq socket gets, and capped exponential backoff with
jitter. No algorithm logic lives here."""

from __future__ import annotations

import os
import random
import secrets
import stat
from collections.abc import Iterator

import zmq

from ddiloco.errors import ConfigError
from ddiloco.runtime.processes.transport.wire import SECRET_MIN_BYTES, Limits

Socket = zmq.Socket[bytes]
SECRET_ENV = "DDILOCO_SECRET"
SECRET_MIN_DISTINCT = 8  # byte values a secret holds at least (a random 32 bytes: ~30)
SECRET_FILE_MAX_BYTES = 4096  # a secret file larger than this is not a secret


def load_secret(secret_file: str | None) -> bytes:
    """The run secret: from ``secret_file`` (hex or raw bytes) or $DDILOCO_SECRET (hex)."""
    if secret_file:
        raw = _read_secret_file(secret_file)
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
    make = "make one with: python -c 'import secrets; print(secrets.token_hex(32))'"
    if len(secret) < SECRET_MIN_BYTES:
        raise ConfigError(
            "secret", f"{len(secret)} bytes", f"need >= {SECRET_MIN_BYTES} random bytes; {make}"
        )
    if len(set(secret)) < SECRET_MIN_DISTINCT:  # all zeros, "abab...": a guessable secret
        raise ConfigError(
            "secret",
            f"{len(set(secret))} distinct byte values",
            f"not random (a random one has ~{SECRET_MIN_BYTES - 2}); {make}",
        )
    return secret


def _read_secret_file(path: str) -> bytes:
    """The secret file's bytes: a private regular file, read without waiting (a FIFO or a
    device named by mistake would hang the start-up and swallow SIGTERM), of a secret's size."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY)
    except OSError as exc:
        raise ConfigError("--secret-file", path, f"cannot read: {exc.strerror}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ConfigError("--secret-file", path, "not a regular file (a FIFO, a device?)")
        if info.st_mode & 0o077:  # as ssh refuses a private key others can read
            why = f"readable by others (mode {info.st_mode & 0o777:o}): chmod 600 it"
            raise ConfigError("--secret-file", path, why)
        if info.st_size > SECRET_FILE_MAX_BYTES:
            why = f"{info.st_size} bytes: not a secret (at most {SECRET_FILE_MAX_BYTES})"
            raise ConfigError("--secret-file", path, why)
        return os.read(fd, SECRET_FILE_MAX_BYTES).strip()
    except OSError as exc:
        raise ConfigError("--secret-file", path, f"cannot read: {exc.strerror}") from None
    finally:
        os.close(fd)


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


def received(sock: zmq.Socket[bytes]) -> Iterator[list[zmq.Frame]]:
    """Every message waiting on ``sock`` (its frames, not copied), without blocking."""
    while True:
        try:
            yield sock.recv_multipart(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return
