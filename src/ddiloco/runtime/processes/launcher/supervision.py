"""The launcher's restart policy, and the error that ends a run it cannot keep up.

A process that dies is restarted after a delay that doubles with every failure in a row
(``restart_delay_seconds``, 2x, 4x ... up to ``restart_backoff_cap_seconds``), so a crash
loop neither spins the CPU nor hides: after ``max_restarts`` restarts in a row the next
failure gives up, and an exit with :data:`FATAL_EXIT` (78, EX_CONFIG: the process printed
``ddiloco <role>: error: ...`` about a fault a restart cannot fix: a damaged store, a wrong
secret, bad config) gives up at once. A life that got going (it printed its ``*_up`` event,
then made progress or stayed up :data:`HEALTHY_SECONDS`) clears its process's count, so a
long run may lose a process any number of times.

Call order (the launcher's): :meth:`RestartPolicy.started` when it spawns a life,
:meth:`~RestartPolicy.heard` with every event the life prints, :meth:`~RestartPolicy.exited`
once when it exits on its own; the :class:`Verdict` says whether (and when) to restart it
or to stop the run with :meth:`Verdict.error`.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ddiloco.errors import FATAL_EXIT, DDiLoCoError

HEALTHY_SECONDS = 10.0  # a life up this long was not a failed start
TAIL_LINES = 20
LOG_TIME = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} ")  # logging's asctime
UP_KINDS = ("syncer_up", "learner_up", "proxy_up")
PROGRESS_KINDS = ("step", "round")  # a learner trained, a syncer merged


def describe(code: int) -> str:
    """An exit status in words: 'code 1', 'code 78 (fatal)', 'signal SIGKILL'."""
    if code < 0:
        known = -code in signal.valid_signals()
        return f"signal {signal.Signals(-code).name}" if known else f"signal {-code}"
    return f"code {code} (fatal)" if code == FATAL_EXIT else f"code {code}"


def tail(path: Path, lines: int = TAIL_LINES) -> list[str]:
    """The last ``lines`` lines of a log (its last 64 KiB read), [] if there is none."""
    try:
        with path.open("rb") as f:
            f.seek(0, 2)
            f.seek(max(0, f.tell() - 65536))
            text = f.read().decode("utf-8", errors="replace")
    except OSError:
        return []
    return text.splitlines()[-lines:]


def reason(lines: list[str]) -> str:
    """What a log says went wrong: the process's own ``ddiloco <role>: error:`` line, else
    torchrun's root cause (its failure report), else its last line with a word in it (a
    traceback's exception, not a ruler of ``=``), else ''."""
    for line in reversed(lines):
        if line.startswith("ddiloco ") and ": error: " in line:
            return line.strip()
    cause = torchrun_cause(lines)
    if cause:
        return cause
    words = (line.strip() for line in reversed(lines) if any(c.isalnum() for c in line))
    return LOG_TIME.sub("", next(words, ""), count=1)[:500]  # (the log's own time: noise here)


def torchrun_cause(lines: list[str]) -> str:
    """The first failure torchrun reports ("Root Cause (first observed failure)": rank,
    exit code, traceback), in one line; '' if the lines hold no such report."""
    starts = [i for i, line in enumerate(lines) if line.startswith("Root Cause")]
    if not starts:
        return ""
    fields: dict[str, str] = {}
    for line in lines[starts[-1] + 1 :]:
        key, sep, value = line.partition(":")
        if sep and value.strip():
            fields.setdefault(key.strip(), value.strip())
    rank, code = fields.get("rank", "?"), fields.get("exitcode", "?")
    said = f"torchrun: rank {rank} failed, exitcode {' '.join(code.split())}"
    why = fields.get("traceback", "")
    return f"{said}: {why}"[:500] if why and why != "<N/A>" else said[:500]


class LaunchError(DDiLoCoError):
    """A process of a real-processes run kept failing, or failed fatally: the run stopped.

    ``str()`` is one line (for ``ddiloco train: error: ...``); :meth:`details` adds the
    tail of the process's log, for the terminal."""

    def __init__(self, process: str, code: int, why: str, log: Path, lines: list[str]) -> None:
        super().__init__(process, code, why)
        self.process, self.code, self.log, self.tail = process, code, log, lines
        self.args = (f"{process} exited with {describe(code)}: {why} (log: {log})",)

    def __str__(self) -> str:
        return str(self.args[0])

    def details(self) -> str:
        head = f"{self.process} exited with {describe(self.code)}; last lines of {self.log}:"
        return "\n".join([head, *(f"  | {line}" for line in self.tail or ["(empty)"])])


@dataclass(frozen=True)
class Verdict:
    """What to do about one exit: restart after ``delay`` seconds, or give up."""

    process: str
    code: int
    failures: int  # in a row, this one included
    delay: float
    give_up: bool
    why: str = ""

    def error(self, log: Path) -> LaunchError:
        lines = tail(log)
        said = reason(lines)
        return LaunchError(
            self.process, self.code, self.why + (f": {said}" if said else ""), log, lines
        )


@dataclass
class _Life:
    started: float  # monotonic seconds
    up: float | None = None  # when it said it was up
    progressed: bool = False


class RestartPolicy:
    """Failures in a row and the next delay, per process name (see the module docstring)."""

    def __init__(
        self,
        max_restarts: int,
        first_delay: float,
        cap: float,
        healthy_seconds: float = HEALTHY_SECONDS,
    ) -> None:
        self.max_restarts = max_restarts
        self.first_delay = first_delay
        self.cap = max(cap, first_delay)
        self.healthy_seconds = healthy_seconds
        self.failures: dict[str, int] = {}
        self._lives: dict[str, _Life] = {}

    def started(self, name: str) -> None:
        self._lives[name] = _Life(time.monotonic())

    def heard(self, name: str, kind: str) -> None:
        life = self._lives.get(name)
        if life is None:
            return
        if kind in UP_KINDS and life.up is None:
            life.up = time.monotonic()
        elif kind in PROGRESS_KINDS and life.up is not None:
            life.progressed = True

    def is_up(self, name: str) -> bool:
        """Has the current life of ``name`` said it is up?"""
        life = self._lives.get(name)
        return life is not None and life.up is not None

    def healthy(self, name: str) -> bool:
        """Did the current life get going: up and progressing, or up a while?"""
        life = self._lives.get(name)
        if life is None or life.up is None:
            return False
        return life.progressed or time.monotonic() - life.up >= self.healthy_seconds

    def exited(self, name: str, code: int) -> Verdict:
        """Count one unplanned exit of ``name``'s current life and judge it."""
        failures = 1 if self.healthy(name) else self.failures.get(name, 0) + 1
        self.failures[name] = failures
        if code == FATAL_EXIT:
            return Verdict(
                name, code, failures, 0.0, True, "not restarted (a restart cannot fix it)"
            )
        if failures > self.max_restarts:
            why = f"failed {failures} times in a row (restarted {self.max_restarts}, with backoff)"
            return Verdict(name, code, failures, 0.0, True, why)
        delay = min(self.cap, self.first_delay * 2.0 ** (failures - 1))
        return Verdict(name, code, failures, delay, False)


def exited_record(
    name: str, code: int, verdict: Verdict | None, log: Path, t: float
) -> dict[str, Any]:
    """The ``exited`` event: the code, why (its log's last word), what happens next (no
    verdict: not restarted, e.g. a learner that finished, or ``processes.restart`` off)."""
    restart = verdict is not None and not verdict.give_up
    return {
        "kind": "exited",
        "t": t,
        "process": name,
        "code": code,
        "reason": reason(tail(log)),
        "restart": restart,
        "delay": verdict.delay if restart and verdict else None,
        "failures": verdict.failures if verdict else 0,
        "gave_up": bool(verdict and verdict.give_up),
    }


def own_summary(seen: dict[str, Any], t: float) -> dict[str, Any]:
    """The launcher's summary when a stop got none from the syncer, from what it ``seen``
    (the last ``eval`` record, the ``rounds`` relayed): what only the syncer knows (tokens
    merged, bytes, goodput) is 0 or NaN, and ``summary_source`` says so."""
    last = seen.get("eval") or {}
    nan = math.nan
    return {
        "kind": "summary",
        "t": t,
        "summary_source": "launcher",
        "eval_loss": last.get("loss", nan),
        "tokens": int(last.get("tokens", 0)),
        "tokens_merged": 0.0,
        "tokens_wasted": {},
        "goodput": nan,
        "uptime": nan,
        "bytes_sent": 0,
        "bytes_received": 0,
        "rounds": int(seen.get("rounds", 0)),
        "refused": {},
        "ledger_balanced": False,
    }


def descendant_groups(pid: int) -> list[int]:
    """The process groups of ``pid``'s descendants other than its own and ours: torchrun
    starts every rank in a session of its own, so a signal to the torchrun group alone
    reaches no rank. Found through /proc (Linux), before any of them is signalled."""
    children: dict[int, list[int]] = {}
    with contextlib.suppress(OSError):
        for entry in os.scandir("/proc"):
            with contextlib.suppress(OSError, ValueError, IndexError):
                child = int(entry.name)
                stat = Path(entry.path, "stat").read_text()  # pid (comm) state ppid
                children.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(child)
    todo, skip = list(children.get(pid, [])), (pid, os.getpgrp())
    groups: list[int] = []
    while todo:
        child = todo.pop()
        todo.extend(children.get(child, []))
        with contextlib.suppress(ProcessLookupError):
            group = os.getpgid(child)
            if group not in (*skip, *groups):
                groups.append(group)
    return groups
