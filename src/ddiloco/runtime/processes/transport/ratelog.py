"""Rate-limited logging: a flood of bad input must not become a flood of log lines.

Every refusal is still counted where it happens; the log shows one line per reason every
few seconds, and the next line says how many it did not show.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import Counter


class RateLimitedLog:
    """At most one line per reason every ``seconds``; the next one says how many it hid."""

    def __init__(self, logger: logging.Logger, seconds: float = 5.0) -> None:
        self.logger = logger
        self.seconds = seconds
        self._last: dict[str, float] = {}
        self._hidden: Counter[str] = Counter()
        self._lock = threading.Lock()

    def __call__(
        self, reason: str, message: str, *args: object, level: int = logging.WARNING
    ) -> None:
        now = time.monotonic()
        with self._lock:
            if now - self._last.get(reason, -1e18) < self.seconds:
                self._hidden[reason] += 1
                return
            self._last[reason] = now
            hidden = self._hidden.pop(reason, 0)
        suffix = f" ({hidden} more like it not shown)" if hidden else ""
        self.logger.log(level, message + suffix, *args)


class Throttle:
    """Lets an action through at most once every ``seconds`` per key (a rehello, a re-sent
    fragment): a peer that keeps provoking it gets one, not a flood. Single-threaded."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self._last: dict[object, float] = {}

    def ready(self, key: object) -> bool:
        """True (and the key's clock restarts) when ``key`` last passed ``seconds`` ago."""
        now = time.monotonic()
        if now - self._last.get(key, -math.inf) < self.seconds:
            return False
        self._last[key] = now
        return True
