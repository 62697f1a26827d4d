"""The status endpoint's HTTP server, bounded so that its clients cannot hurt the syncer.

``ThreadingHTTPServer`` alone gave every connection a thread and a file descriptor for as
long as the client liked: 914 half-open connections took every descriptor under a 1024
limit and the syncer died writing its ledger. :class:`GuardedHTTPServer` refuses what is
over its bounds in the accepting thread, before a thread exists (docs/security.md, "The
status endpoint"):

- at most ``connections`` open at once, ``per_client`` of them from one address;
- at most ``rate`` new connections a second from one address (a burst of ``burst``);
- each connection lives ``seconds`` at most, reading and writing included (a slowloris is
  dropped by the server's own loop, however slowly it trickles).

Every refusal is counted by reason (:class:`Refusals`, published in ``status.json`` and
``/metrics``) and logged at most once per reason every 5 s; nothing prints a traceback.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import re
import socket
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from ddiloco.runtime.processes.transport.ratelog import RateLimitedLog

log = logging.getLogger(__name__)

MAX_BUCKETS = 4096  # client addresses whose rate is remembered (full buckets are forgotten)
_HOST = re.compile(r"(\[[0-9A-Fa-f:.]{2,45}\]|[A-Za-z0-9._-]{1,253})(:[0-9]{1,5})?")
_REASONS = {"busy": 503, "busy_client": 503, "rate": 429}


@dataclass(frozen=True)
class Limits:
    """The server's bounds (see the module); descriptors held <= ``connections`` + 2."""

    connections: int = 64
    per_client: int = 8
    seconds: float = 10.0
    rate: float = 20.0
    burst: float = 40.0


class Refusals:
    """What the endpoint refused, by reason; one log line per reason every 5 s."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._say = RateLimitedLog(log)

    def __call__(self, why: str, client: str, detail: str = "") -> None:
        with self._lock:
            self.counts[why] += 1
        self._say(why, "syncer: status page refused %s from %s%s", why, client, detail)

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(sorted(self.counts.items()))


def allowed_host(value: str, names: Iterable[str]) -> bool | None:
    """Whether a request's ``Host`` is one the endpoint answers for (None: malformed). An IP
    literal always is (a DNS-rebinding page can only send a name it controls), as are
    ``localhost`` and ``*.localhost``; another name only when it is in ``names``."""
    match = _HOST.fullmatch(value.strip())
    if match is None or (match.group(2) and int(match.group(2)[1:]) > 65535):
        return None
    host = match.group(1).lower()
    if host.startswith("["):
        try:
            return ipaddress.IPv6Address(host[1:-1]) is not None
        except ValueError:
            return None
    try:
        ipaddress.IPv4Address(host)
        return True
    except ValueError:
        pass
    host = host[:-1] if host.endswith(".") else host
    return host == "localhost" or host.endswith(".localhost") or host in set(names)


def refusal(code: int) -> bytes:
    """A whole HTTP response for a connection refused before it is read."""
    reason = {429: "Too Many Requests", 503: "Service Unavailable"}[code]
    return (
        f"HTTP/1.0 {code} {reason}\r\nContent-Length: 0\r\nRetry-After: 1\r\n"
        "Connection: close\r\n\r\n"
    ).encode()


class GuardedHTTPServer(ThreadingHTTPServer):
    """A threading HTTP server with the bounds of :class:`Limits` (see the module)."""

    daemon_threads = True
    request_queue_size = 64  # (the kernel's backlog: no descriptor of ours)

    def __init__(
        self,
        address: tuple[str, int],
        handler: type[BaseHTTPRequestHandler],
        limits: Limits,
        refused: Refusals,
    ) -> None:
        self.limits = limits
        self.refused = refused
        self._lock = threading.Lock()
        self._open: dict[socket.socket, tuple[float, str]] = {}  # -> (deadline, client)
        self._per_client: Counter[str] = Counter()
        self._buckets: dict[str, tuple[float, float]] = {}  # client -> (tokens, when)
        super().__init__(address, handler)

    def open_connections(self) -> int:
        with self._lock:
            return len(self._open)

    def verify_request(self, request: Any, client_address: Any) -> bool:
        """Admit the connection, or answer 503 / 429 at once and close it (no thread)."""
        client = str(client_address[0])
        with self._lock:
            why = self._admit(client, time.monotonic())
            if why is None:
                self._open[request] = (time.monotonic() + self.limits.seconds, client)
                self._per_client[client] += 1
                return True
        self.refused(why, client)
        try:
            request.setblocking(False)
            request.send(refusal(_REASONS[why]))
        except OSError:
            pass  # (a client that cannot take 100 bytes gets the close alone)
        return False

    def _admit(self, client: str, now: float) -> str | None:
        if len(self._open) >= self.limits.connections:
            return "busy"
        if self._per_client[client] >= self.limits.per_client:
            return "busy_client"
        tokens, when = self._buckets.get(client, (self.limits.burst, now))
        tokens = min(self.limits.burst, tokens + (now - when) * self.limits.rate)
        if tokens < 1.0:
            self._buckets[client] = (tokens, now)
            return "rate"
        if client not in self._buckets and len(self._buckets) >= MAX_BUCKETS:
            self._forget_full(now)
        self._buckets[client] = (tokens - 1.0, now)
        return None

    def _forget_full(self, now: float) -> None:
        """Drop the buckets that have refilled (they say nothing); if none has, the oldest."""
        rate, burst = self.limits.rate, self.limits.burst
        full = [c for c, (t, w) in self._buckets.items() if t + (now - w) * rate >= burst]
        for c in full or [min(self._buckets, key=lambda c: self._buckets[c][1])]:
            del self._buckets[c]

    def shutdown_request(self, request: Any) -> None:
        with self._lock:  # (before the close: the reaper only touches open sockets)
            entry = self._open.pop(request, None)
            if entry is not None:
                self._per_client[entry[1]] -= 1
                if self._per_client[entry[1]] <= 0:
                    del self._per_client[entry[1]]
        super().shutdown_request(request)

    def service_actions(self) -> None:
        """The reaper (the serving loop calls it every 0.5 s): a connection past its
        deadline is shut down, which ends its thread's read or write at once."""
        now = time.monotonic()
        with self._lock:
            for sock, (deadline, client) in list(self._open.items()):
                if deadline <= now:
                    self._open[sock] = (float("inf"), client)  # (dropped once)
                    with contextlib.suppress(OSError):
                        sock.shutdown(socket.SHUT_RDWR)
                    self.refused("slow", client, f" (open over {self.limits.seconds:g} s)")

    def handle_error(self, request: Any, client_address: Any) -> None:
        """One rate-limited line, never a traceback. A connection that broke (the client
        hung up, the reaper dropped it) is no error: it is counted where it was dropped."""
        exc = sys.exc_info()[1]
        if not isinstance(exc, OSError):
            self.refused("error", str(client_address[0]), f": {type(exc).__name__}: {exc}"[:200])
