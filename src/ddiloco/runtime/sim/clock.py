"""A virtual clock: a priority queue of timed events, popped in (time, insertion) order.

Ties are broken by insertion order, never by object identity or hashing, so the same inputs
replay the same run bit for bit.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from typing import Any


class EventQueue:
    """Timed callbacks on a virtual clock."""

    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[..., None], tuple[Any, ...]]] = []
        self._seq = 0

    def at(self, time: float, fn: Callable[..., None], *args: Any) -> None:
        """Run ``fn(*args)`` at virtual ``time`` (never in the past)."""
        heapq.heappush(self._heap, (max(time, self.now), self._seq, fn, args))
        self._seq += 1

    def after(self, delay: float, fn: Callable[..., None], *args: Any) -> None:
        self.at(self.now + delay, fn, *args)

    def step(self) -> bool:
        """Run the next event; False when none is left."""
        if not self._heap:
            return False
        time, _, fn, args = heapq.heappop(self._heap)
        self.now = time
        fn(*args)
        return True

    def __len__(self) -> int:
        return len(self._heap)
