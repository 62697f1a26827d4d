"""Warm spare learners (``processes.spares``): processes that have imported torch, built the
model and read the corpus, waiting to take the slot of a learner that died.

A restarted learner otherwise pays for a fresh interpreter before its peer copy: importing
torch and splitting the corpus take seconds on a small machine. A spare is ``ddiloco learner
--spare``: it does all of that at once, says ``spare_ready``, and blocks on its stdin. When
a slot is restarted (a crash, a death, a rejoin), the launcher hands the slot to a ready
spare instead (one JSON line: the slot's id, state directory, peer port and GPUs); the spare
becomes that slot's life (:meth:`~.supervisor.Supervisor.rename`: its process, reader, log)
and joins, copying a peer, and a new spare is started a little later (not while the slot
recovers: on a small machine it would compete for the cores). Spares never train, so they
are stopped at the end of the run. Torchrun learners (``processes.ranks`` > 1) have none.
"""

from __future__ import annotations

import json
import signal
import subprocess
from collections.abc import Callable
from typing import Any, Protocol

SPARE = "spare-"  # a spare's process name: spare-<k>
REFILL_SECONDS = 10.0  # after a take-over, before the next spare starts


class Host(Protocol):
    """What the pool needs of its launcher (a launcher is one; nothing else is read)."""

    run_id: str
    procs: dict[str, subprocess.Popen[str]]

    @property
    def stop_requested(self) -> bool: ...
    def start_spare(self, name: str) -> None: ...
    def rename(self, old: str, new: str) -> None: ...
    def emit(self, record: dict[str, Any]) -> None: ...
    def now(self) -> float: ...
    def after(self, seconds: float, action: Callable[[], None]) -> None: ...
    def signal(self, name: str, sig: int) -> bool: ...


class Spares:
    """The launcher's pool of warm spares (see the module)."""

    def __init__(self, launcher: Host, count: int) -> None:
        self.launcher = launcher
        self.count = count
        self.ready: list[str] = []  # spares that said spare_ready, oldest first
        self.started = 0

    @staticmethod
    def is_spare(name: str) -> bool:
        return name.startswith(SPARE)

    def live(self) -> list[str]:
        procs = self.launcher.procs
        return [n for n, p in procs.items() if self.is_spare(n) and p.poll() is None]

    def fill(self) -> None:
        """Start spares until ``count`` are alive (none once the run is stopping)."""
        if self.launcher.stop_requested:
            return
        for _ in range(self.count - len(self.live())):
            name = f"{SPARE}{self.started}"
            self.started += 1
            self.launcher.start_spare(name)

    def heard(self, name: str, record: dict[str, Any]) -> None:
        if record.get("kind") == "spare_ready" and self.is_spare(name):
            self.ready.append(name)

    def take(self, m: int, order: dict[str, Any]) -> str | None:
        """Hand slot ``m`` to the oldest ready spare; its name, or None (then the slot starts
        a fresh process)."""
        launcher = self.launcher
        while self.ready:
            name = self.ready.pop(0)
            proc = launcher.procs.get(name)
            if proc is None or proc.poll() is not None or proc.stdin is None:
                continue
            try:
                proc.stdin.write(json.dumps({"id": m, **order}) + "\n")
                proc.stdin.close()
            except OSError:  # it died meanwhile
                continue
            launcher.rename(name, f"learner-{m}")
            launcher.emit(
                {
                    "kind": "started",
                    "t": launcher.now(),
                    "process": f"learner-{m}",
                    "pid": proc.pid,
                    "run": launcher.run_id,
                    "spare": name,
                }
            )
            launcher.after(REFILL_SECONDS, self.fill)
            return name
        return None

    def stop(self) -> None:
        """The run is over: spares have nothing to take."""
        for name in self.live():
            self.launcher.signal(name, signal.SIGTERM)
