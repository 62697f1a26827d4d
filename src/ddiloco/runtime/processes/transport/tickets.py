"""One-time connection credentials: a captured handshake is worth nothing to anyone else.

A PLAIN handshake crosses the wire in clear. If its credential were the same on every
connection, an eavesdropper could replay it and complete a handshake as that learner: its
frames would still be refused (they need the secret: wire.py, admission.py), but libzmq
buffers an unterminated multipart message of a connected peer before any code of ours sees
it (no socket option bounds that), so one replayed handshake could grow a syncer by GiBs.

So a credential is a *ticket*, good for one connection: the username is
``NAME.SECONDS.NONCE`` (the wall-clock second it was made, 128 random bits) and the password
an HMAC of all of it under the run secret (auth.py). A server admits a ticket once: it
remembers every nonce it admitted until the ticket's time is more than :data:`SKEW_SECONDS`
old, and refuses tickets whose time is further than that from its own clock (a capture older
than that, or a machine whose clock is off: docs/deploy.md asks for NTP). The syncer keeps the
nonces in a journal in its store, so a restarted syncer refuses a ticket its earlier life
admitted; a learner's snapshot server keeps them in memory (a capture replayed at a
*restarted* learner within the skew is admitted there, and still cannot act: see
docs/security.md).

The client's side of the contract (auth.py's ``present`` and ``HandshakeWatch``): libzmq
reconnects a socket with the credential it was given, so a socket whose connection closed is
replaced, with a fresh ticket, by its owner.
"""

from __future__ import annotations

import os
import secrets
import struct
import time
from collections.abc import Callable
from pathlib import Path

from ddiloco.errors import DDiLoCoError

SKEW_SECONDS = 300.0  # a ticket's time and the server's clock may differ by this much
NONCE_BYTES = 16
MAX_LIVE = 1 << 16  # tickets remembered at once: a honest run admits a few a minute
RECORD = struct.Struct(f">q{NONCE_BYTES}s")  # (ticket time, nonce) in the journal


class TicketError(DDiLoCoError):
    """The journal of admitted tickets is damaged: refused, naming it."""


def make_ticket(name: str, now: float | None = None) -> str:
    """A fresh one-time username for ``name`` (the password is its HMAC: auth.py)."""
    stamp = int(time.time() if now is None else now)
    return f"{name}.{stamp}.{secrets.token_hex(NONCE_BYTES)}"


def parse_ticket(user: str) -> tuple[str, int, bytes] | None:
    """(name, time, nonce) of a ticket, or None for anything else."""
    name, dot, rest = user.partition(".")
    stamp, dot2, nonce = rest.partition(".")
    if not (dot and dot2 and name and stamp.isascii() and stamp.isdigit() and len(stamp) < 13):
        return None
    if len(nonce) != 2 * NONCE_BYTES or not all(c in "0123456789abcdef" for c in nonce):
        return None
    return name, int(stamp), bytes.fromhex(nonce)


class TicketBook:
    """The tickets a server has admitted and not yet seen expire: one door, :meth:`admit`.

    ``path``: a journal (the syncer's store) that outlives the process; None keeps them in
    memory. ``wall``: the clock tickets are compared with (the wall clock: tickets come from
    other machines). Not thread-safe: the gatekeeper's thread is its only user.
    """

    def __init__(
        self,
        path: Path | None = None,
        wall: Callable[[], float] = time.time,
        skew: float = SKEW_SECONDS,
        max_live: int = MAX_LIVE,
    ) -> None:
        self.path = path
        self.wall = wall
        self.skew = skew
        self.max_live = max_live
        self.live: dict[bytes, int] = {}  # nonce -> ticket time
        self.journal_error: str | None = None  # why the journal could not be written, once
        self._pruned = wall()
        self._appended = 0
        if path is not None:
            self._load(path)

    def admit(self, stamp: int, nonce: bytes) -> str | None:
        """None if the ticket is admitted now (and remembered), else why it is refused:
        ``clock`` (its time is too far from ours), ``replayed`` (admitted before) or
        ``tickets_full`` (more live tickets than a run uses: an insider's flood)."""
        now = self.wall()
        if abs(stamp - now) > self.skew:
            return "clock"
        if now - self._pruned > self.skew / 4 or len(self.live) >= self.max_live:
            self._prune(now)
        if nonce in self.live:
            return "replayed"
        if len(self.live) >= self.max_live:
            return "tickets_full"
        self.live[nonce] = stamp
        self._append(stamp, nonce)
        return None

    def _prune(self, now: float) -> None:
        self._pruned = now
        self.live = {n: s for n, s in self.live.items() if s >= now - self.skew}
        if self.path is not None and self._appended > 4 * len(self.live) + 1024:
            try:
                self._rewrite(self.path)
            except OSError as exc:
                self.journal_error = f"{self.path}: {exc.strerror}"

    # -- the journal --------------------------------------------------------------------------
    def _load(self, path: Path) -> None:
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            data = b""
        except OSError as exc:
            raise TicketError(str(path), None, f"cannot read: {exc.strerror}") from None
        if len(data) % RECORD.size:
            raise TicketError(
                str(path),
                f"{len(data)} bytes",
                f"damaged: not a whole number of {RECORD.size}-byte records (the admitted "
                "connection tickets; delete it to start anyway: a handshake captured in the "
                f"last {self.skew:.0f}s could then be replayed once)",
            )
        oldest = self.wall() - self.skew
        for stamp, nonce in RECORD.iter_unpack(data):
            if stamp >= oldest:
                self.live[nonce] = stamp
        try:
            self._rewrite(path)
        except OSError as exc:
            raise TicketError(str(path), None, f"cannot write: {exc.strerror}") from None

    def _rewrite(self, path: Path) -> None:
        """The journal, compacted to the live tickets (written aside, then renamed)."""
        aside = path.with_name(path.name + ".tmp")
        body = b"".join(RECORD.pack(s, n) for n, s in self.live.items())
        fd = os.open(aside, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, body)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(aside, path)
        self._appended = len(self.live)

    def _append(self, stamp: int, nonce: bytes) -> None:
        if self.path is None:
            return
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            try:
                os.write(fd, RECORD.pack(stamp, nonce))  # one write: whole or not at all
            finally:
                os.close(fd)
            self._appended += 1
        except OSError as exc:  # remembered in memory still: this life refuses it anyway
            self.journal_error = f"{self.path}: {exc.strerror}"
