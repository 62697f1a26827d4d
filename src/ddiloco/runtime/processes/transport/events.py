"""Events as JSON lines on stdout (``@event {...}``): how every child process tells its
supervisor what happened (the launcher relays them into the run's metrics.jsonl)."""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

EVENT_PREFIX = "@event "


class RunClock:
    """Seconds since the run's start ``t0`` (a wall-clock time, shared by every process of a
    run), read from this process's monotonic clock: the wall clock is consulted once, here,
    so a clock stepped back (or forward) later moves no timeout, beat or detection."""

    def __init__(self, t0: float) -> None:
        self.t0 = t0
        self._at = time.time() - t0
        self._mono = time.monotonic()

    def now(self) -> float:
        return self._at + time.monotonic() - self._mono


class Events:
    """Events as JSON lines on stdout (``@event {...}``), stamped with seconds since t0;
    with ``sink``, handed to it instead (a hand-started syncer's own run directory)."""

    def __init__(
        self, t0: float, stream: Any = None, sink: Callable[[dict[str, Any]], None] | None = None
    ) -> None:
        self.t0 = t0
        self.clock = RunClock(t0)
        self.stream = stream or sys.stdout
        self.sink = sink
        self._lock = threading.Lock()

    def now(self) -> float:
        return self.clock.now()

    def __call__(self, kind: str, **fields: Any) -> None:
        record = {"kind": kind, "t": round(self.now(), 4), **fields}
        if self.sink is not None:
            with self._lock:  # (events come from several threads; the sink is not shared)
                self.sink(json.loads(json.dumps(record, default=_jsonable)))
            return
        line = EVENT_PREFIX + json.dumps(record, sort_keys=True, default=_jsonable) + "\n"
        with self._lock:
            self.stream.write(line)
            self.stream.flush()


def _jsonable(value: Any) -> Any:
    if isinstance(value, set | frozenset | tuple):
        return sorted(value) if isinstance(value, set | frozenset) else list(value)
    return str(value)
