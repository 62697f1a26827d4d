"""Which connections may speak for a learner: a connection proves it holds the run secret
*now*, and a new life of a learner proves the old one is gone before it replaces it.

The PLAIN handshake's credential crosses the wire in clear (transport/auth.py), and a frame,
though signed, can be captured and sent again. Neither may cost an honest learner anything:

- **Proof** (per connection): the first frame of a connection is answered with a
  ``challenge`` carrying a fresh random nonce; only a signed ``proof`` echoing it makes the
  connection :attr:`Door.PROVEN`. Until then its frames are dropped (counted ``unproven``)
  before they can move a route or retire a session, so a captured handshake and captured
  frames, replayed in any syncer life, are worth nothing: they cannot echo a nonce that did
  not exist when they were made.
- **Replacement** (per learner): a proven connection whose frames carry a session other
  than the learner's current one is a new life (a restart), or a second process started
  with the same id by mistake. It replaces the current life when that one is gone: its
  connection closed, or silent for ``silent_seconds`` (learners beat at least once a second).
  While the current life is alive the newcomer is held (its frames dropped, counted
  ``held_newcomer``); one still held after ``refuse_seconds`` is refused, by name.

A pure state machine: the caller passes ``now`` and what it observed (is a route open, when
was a learner last heard); :mod:`.connections` does the I/O. Memory is bounded: at most
``max_connections`` connections are remembered (the oldest forgotten: a forgotten proven
connection is simply challenged again).
"""

from __future__ import annotations

import hmac
import secrets
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

CHALLENGE_SECONDS = 0.25  # a connection is challenged again at most this often
SILENT_SECONDS = 2.5  # a life not heard this long may be replaced (learners beat every <= 1 s)
REFUSE_SECONDS = 5.0  # a newcomer held this long while the current life speaks is refused
MAX_CONNECTIONS = 4096


Who = int | tuple[int, int]  # a learner's own link, or a sharded learner's rank link (m, r)


class Door(Enum):
    CHALLENGED = "challenged"  # a nonce was sent; no proof yet
    PROVEN = "proven"


class Verdict(Enum):
    ADMIT = "admit"  # the current life, or a new one that replaces a gone one
    HOLD = "hold"  # a new life while the current one is alive: dropped for now
    REFUSE = "refuse"  # held too long: a second process with this id


@dataclass
class _Connection:
    learner: Who
    door: Door
    nonce: str
    challenged_at: float
    unproven: int = 0  # frames dropped before its proof


class Admission:
    """What the syncer knows of each connection (by routing id) and of each new life."""

    def __init__(
        self,
        *,
        silent_seconds: float = SILENT_SECONDS,
        refuse_seconds: float = REFUSE_SECONDS,
        max_connections: int = MAX_CONNECTIONS,
        nonce: Callable[[], str] = lambda: secrets.token_hex(16),
    ) -> None:
        self.silent_seconds = silent_seconds
        self.refuse_seconds = refuse_seconds
        self.max_connections = max_connections
        self.nonce = nonce
        self._connections: OrderedDict[bytes, _Connection] = OrderedDict()
        self._newcomers: dict[tuple[int, int], float] = {}  # (learner, session) -> first seen

    def proven(self, ident: bytes, m: Who) -> bool:
        """Whether connection ``ident`` proved it speaks for learner ``m``."""
        conn = self._connections.get(ident)
        return conn is not None and conn.learner == m and conn.door is Door.PROVEN

    def challenge(self, ident: bytes, m: Who, now: float) -> tuple[str | None, int]:
        """An unproven frame came on ``ident``: (the nonce to send it, or None when it was
        challenged less than ``CHALLENGE_SECONDS`` ago; the frames it sent unproven)."""
        conn = self._connections.get(ident)
        if conn is None or conn.learner != m:
            conn = _Connection(m, Door.CHALLENGED, self.nonce(), now)
            self._remember(ident, conn)
        elif now - conn.challenged_at < CHALLENGE_SECONDS:
            conn.unproven += 1
            return None, conn.unproven
        else:
            conn.challenged_at = now
        conn.unproven += 1
        return conn.nonce, conn.unproven

    def prove(self, ident: bytes, m: Who, nonce: object) -> bool:
        """A signed ``proof`` came on ``ident``: True (now proven) if it echoes the nonce
        this connection was sent."""
        conn = self._connections.get(ident)
        if conn is None or conn.learner != m or not isinstance(nonce, str):
            return False
        if not hmac.compare_digest(conn.nonce.encode(), nonce.encode()[:64]):
            return False
        conn.door = Door.PROVEN
        self._connections.move_to_end(ident)
        return True

    def newcomer(
        self, m: int, session: int, *, route_open: bool, heard_at: float | None, now: float
    ) -> Verdict:
        """A proven frame of learner ``m`` with ``session``, not its current life's, on a
        connection other than the current one's (``route_open``: that one is still
        connected; ``heard_at``: when the current life last spoke)."""
        alive = route_open and heard_at is not None and now - heard_at < self.silent_seconds
        if not alive:
            self._newcomers.pop((m, session), None)
            return Verdict.ADMIT
        first = self._newcomers.setdefault((m, session), now)
        if len(self._newcomers) > self.max_connections:
            del self._newcomers[next(iter(self._newcomers))]
        return Verdict.REFUSE if now - first >= self.refuse_seconds else Verdict.HOLD

    def forget(self, ident: bytes) -> None:
        """``ident`` is closed (or was refused): it must prove itself again to speak."""
        self._connections.pop(ident, None)

    def _remember(self, ident: bytes, conn: _Connection) -> None:
        self._connections[ident] = conn
        self._connections.move_to_end(ident)
        while len(self._connections) > self.max_connections:
            self._connections.popitem(last=False)
