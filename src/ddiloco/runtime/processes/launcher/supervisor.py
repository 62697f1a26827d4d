"""What every supervisor of real processes does, whatever it runs: the base of the launcher
(a syncer and learners, :mod:`.fragments`) and of the data-parallel job (torchrun DDP,
:mod:`.data_parallel`).

Owns: spawning children with ``subprocess`` (never forked from a process holding torch), each
in its own process group, stderr into ``<home>/logs/<name>.log``; a reader thread per child
relaying its ``@event`` lines into one queue; timers run on the supervisor's thread; signals
to a child's group and, for a torchrun child, its ranks' groups (torchrun starts every rank in
a session of its own); the straggler duty cycle (SIGSTOP/SIGCONT); the stop and interrupt
flags a signal handler sets; shutdown (SIGTERM, then SIGKILL).

Call order (a subclass's ``run``): spawn children, then loop on :meth:`Supervisor.pump`
(timers due, then one event: the policy hears it, :meth:`Supervisor.handle` acts on it,
then the hooks), :meth:`Supervisor.check_signals` between pumps, and :meth:`shutdown` in a
``finally``. Everything but :meth:`interrupt` runs on the supervisor's thread.
"""

from __future__ import annotations

import contextlib
import functools
import heapq
import itertools
import json
import math
import os
import queue
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from enum import Enum
from pathlib import Path
from typing import IO, Any

from ddiloco.chaos.plan import ChaosEvent
from ddiloco.config import RunConfig
from ddiloco.errors import ConfigError
from ddiloco.runtime.layout import processes_home
from ddiloco.runtime.processes.launcher.supervision import (
    RestartPolicy,
    Verdict,
    descendant_groups,
    exited_record,
)
from ddiloco.runtime.processes.transport.events import EVENT_PREFIX, RunClock

DUTY_PERIOD = 0.2  # seconds: one SIGSTOP/SIGCONT cycle of a straggler
Hook = Callable[[Any, dict[str, Any]], None]


class Phase(Enum):
    """Where a supervised run is: RUNNING; STOPPING (a clean stop was asked: the run's summary
    is awaited until ``stop_deadline``); ABORTING (a second signal: everything is killed)."""

    RUNNING = "running"
    STOPPING = "stopping"
    ABORTING = "aborting"


class Supervisor:
    """Children, their events, timers and signals for one method's run (see the module).

    Construction order: :meth:`refuse` (a method this supervisor cannot run, before anything
    is written), the base's state and ``home`` (``runtime/layout.py``), then the subclass's
    :meth:`prepare`. Subclasses do not override ``__init__``."""

    def __init__(
        self,
        config: RunConfig,
        method: str,
        out: Path,
        emit: Callable[[dict[str, Any]], None],
        hooks: Sequence[Hook] = (),
        resume: bool = False,
        t0: float | None = None,
    ) -> None:
        self.refuse(config, method)
        self.resume = resume  # continue a stopped run from its saved states
        self.config = config
        self.method = method
        self.out = out
        self.emit = emit
        self.home = processes_home(out, method)  # config, logs and state of this method's run
        self.logs = self.home / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.run_id = f"{config.name}-{secrets.token_hex(4)}"
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.t0 = time.time() if t0 is None else t0  # event times count from it
        self.clock = RunClock(self.t0)  # (monotonic: a stepped wall clock moves no timer)
        self.procs: dict[str, subprocess.Popen[str]] = {}
        self.expected_exit: set[str] = set()  # killed or stopped on purpose
        self.events: queue.SimpleQueue[tuple[str, dict[str, Any]]] = queue.SimpleQueue()
        self._timers: list[tuple[float, int, Callable[[], None]]] = []
        self._tie = itertools.count()
        self.restarts: dict[str, int] = {}
        p = config.processes
        self.policy = RestartPolicy(
            p.max_restarts, p.restart_delay_seconds, p.restart_backoff_cap_seconds
        )
        self.readers: dict[str, threading.Thread] = {}
        self.alias: dict[str, str] = {}  # a child's first name -> the one it took (a spare's)
        self.log_files: dict[str, Path] = {}  # where each child's stderr goes
        self.hooks = list(hooks)  # called with every event, on the supervisor's thread
        self.phase = Phase.RUNNING
        self.stop_deadline = math.inf  # monotonic: when a stop stops waiting for a summary
        self.stop_signal: int | None = None  # the first SIGINT/SIGTERM (see interrupt)
        self.finished = threading.Event()  # the run is over: background chaos stops
        self.prepare()

    @staticmethod
    def refuse(config: RunConfig, method: str) -> None:
        """Raise a ConfigError if this supervisor cannot run ``method`` with ``config``."""

    def prepare(self) -> None:
        """The subclass's own state (called last by ``__init__``)."""

    # -- processes --------------------------------------------------------------------------
    def claim(self, name: str) -> bool:
        """Make way for a new life of ``name`` (its log named, an exit of it unexpected
        again); False while its current life still runs (then nothing starts)."""
        old = self.procs.get(name)
        if old is not None and old.poll() is None:
            return False
        self.expected_exit.discard(name)
        self.log_files[name] = self.logs / f"{name}.log"
        return True

    def _spawn(
        self,
        name: str,
        args: list[str],
        control: bool = False,
        env: dict[str, str] | None = None,
    ) -> None:
        """Start ``name`` (unless its current life still runs): ``args`` is a ddiloco command
        or, starting with ``-m``/``-c``, arguments to Python itself; ``env``: variables of
        this child's own on top of the run's (a learner's GPUs)."""
        old = self.procs.get(name)
        if self.claim(name):
            self._launch(name, args, control, env, old)

    def _launch(
        self,
        name: str,
        args: list[str],
        control: bool,
        env: dict[str, str] | None,
        old: Any,
    ) -> None:
        """Start the new life of ``name`` (claimed: its last life, ``old``, has ended) as a
        child process in a process group of its own; a subclass starts it its own way."""
        log = self.log_files[name].open("a", encoding="utf-8")
        raw = args[0] in ("-m", "-c")  # a module or a program, else a ddiloco command
        argv = [sys.executable, *(args if raw else ["-m", "ddiloco.cli", *args])]
        proc = subprocess.Popen(
            argv,
            env={**self.env, **(env or {})},
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            stdin=subprocess.PIPE if control else None,
            start_new_session=True,
        )  # its own process group
        log.close()
        self.procs[name] = proc
        self.policy.started(name)
        reader = threading.Thread(target=self._read, args=(name, proc.stdout), daemon=True)
        self.readers[name] = reader
        reader.start()
        self.emit(
            {
                "kind": "started",
                "t": self.now(),
                "process": name,
                "pid": proc.pid,
                "run": self.run_id,
            }
        )

    def _read(self, name: str, stream: IO[str] | None) -> None:
        assert stream is not None
        for line in stream:
            if line.startswith(EVENT_PREFIX):
                with contextlib.suppress(json.JSONDecodeError):
                    self.events.put((name, json.loads(line[len(EVENT_PREFIX) :])))

    def torchrun(self, name: str) -> bool:
        """Is ``name`` a torchrun agent (whose ranks a signal must reach too)?"""
        return False

    def signal(self, name: str, sig: int) -> bool:
        """Send ``sig`` to one of our own children: its process group (which it leads) and,
        for a torchrun child, its ranks' groups. torchrun starts every rank in a session of
        its own, so a signal to the torchrun group alone reaches no rank: a kill would leave
        the ranks training as orphans, a freeze or slowdown would stop only torchrun. The
        ranks are found through /proc (Linux), before any of them is signalled."""
        proc = self.procs.get(name)
        if proc is None or proc.poll() is not None:
            return False
        if sig in (signal.SIGKILL, signal.SIGTERM):
            self.expected_exit.add(name)
        groups = descendant_groups(proc.pid) if self.torchrun(name) else []
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return False
        for group in groups:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(group, sig)
        if sig == signal.SIGKILL:  # dead when this returns: a restart right after must not
            with contextlib.suppress(subprocess.TimeoutExpired):  # find it still running
                proc.wait(timeout=2.0)
        return True

    def thaw(self, name: str) -> None:
        self.signal(name, signal.SIGCONT)

    def after(self, seconds: float, action: Callable[[], None]) -> None:
        heapq.heappush(self._timers, (time.monotonic() + seconds, next(self._tie), action))

    def now(self) -> float:
        return self.clock.now()

    def duty_cycle(self, send: Callable[[int], bool], factor: float, duration: float) -> None:
        """A straggler (run it on a thread): ``send`` SIGSTOP then SIGCONT so its target runs
        1/factor of the time, for ``duration`` seconds (0: to the end of the run). ``send``
        finds the target anew each cycle (whichever process holds the slot now)."""
        stopped = DUTY_PERIOD * (1.0 - 1.0 / factor)
        end = time.monotonic() + duration if duration > 0 else float("inf")
        while time.monotonic() < end and not self.finished.is_set():
            if send(signal.SIGSTOP):
                time.sleep(stopped)
                send(signal.SIGCONT)
            time.sleep(DUTY_PERIOD - stopped)

    # -- chaos ------------------------------------------------------------------------------
    def schedule_chaos(self, events: Sequence[ChaosEvent]) -> None:
        """Play each event (:meth:`play`) at its ``at``, wall seconds since the launch."""
        for event in events:
            self.after(max(0.0, event.at - self.now()), functools.partial(self.play, event))

    def play(self, event: ChaosEvent) -> None:
        """Play one chaos event now, and emit its ``chaos`` record (the subclass's way)."""
        raise NotImplementedError

    # -- stopping ---------------------------------------------------------------------------
    def request_stop(self) -> None:
        """End the run now, with a summary (the subclass's way); on the supervisor's thread."""
        raise NotImplementedError

    @property
    def stop_requested(self) -> bool:
        return self.phase is not Phase.RUNNING

    @property
    def abort(self) -> bool:
        """A second signal: kill everything now."""
        return self.phase is Phase.ABORTING

    def begin_stop(self, wait_seconds: float) -> None:
        """RUNNING -> STOPPING (once): wait at most ``wait_seconds`` for the summary."""
        if self.phase is Phase.RUNNING:
            self.phase = Phase.STOPPING
            self.stop_deadline = time.monotonic() + wait_seconds

    def interrupt(self, signum: int) -> None:
        """For a SIGINT/SIGTERM handler (it only sets flags; the supervisor's loop acts): the
        first asks for a clean stop, the second for everything killed at once."""
        if self.stop_signal is None:
            self.stop_signal = signum
        else:
            self.phase = Phase.ABORTING

    def check_signals(self) -> None:
        if self.abort:
            raise KeyboardInterrupt  # run()'s cleanup kills every process group
        if self.stop_signal is not None and not self.stop_requested:
            self.request_stop()

    # -- events -----------------------------------------------------------------------------
    def pump(self, timeout: float) -> None:
        """Run the timers that are due, then handle one event (waiting up to ``timeout``)."""
        while self._timers and self._timers[0][0] <= time.monotonic():
            heapq.heappop(self._timers)[2]()
        try:
            name, record = self.events.get(timeout=timeout)
        except queue.Empty:
            return
        name = self.alias.get(name, name)
        self.policy.heard(name, str(record.get("kind")))
        self.handle(name, record)
        for hook in self.hooks:
            hook(self, record)

    def drain(self) -> None:
        """Handle every event already queued."""
        while not self.events.empty():
            self.pump(0.0)

    def watch(self, done: Callable[[], bool], supervise: Callable[[], bool]) -> bool:
        """The supervisor's loop: pump events until ``done()`` or ``supervise()`` (judging
        the children after each event) says the job ended; return whether it is done. A
        stop whose deadline passes with no result returns False (the caller writes a summary
        of its own); past ``processes.max_wall_seconds`` it raises."""
        limit = self.config.processes.max_wall_seconds
        while not done():
            if self.now() > limit:
                raise ConfigError("processes.max_wall_seconds", limit, "the run did not end")
            self.check_signals()
            if self.stop_requested and time.monotonic() > self.stop_deadline:
                return False
            self.pump(0.05)
            if supervise():
                break
        return done()

    def handle(self, name: str, record: dict[str, Any]) -> None:
        """Act on one event of child ``name`` (relay it, count it)."""

    def settle(self, name: str) -> None:
        """After ``name`` exited: wait (2 s at most) until its reader has queued its last
        lines, so its last words are handled before its exit is judged."""
        reader = self.readers.get(name)
        if reader is not None:
            reader.join(timeout=2.0)

    def exited(self, name: str, code: int, verdict: Verdict | None) -> None:
        """The ``exited`` record: the code, why (its log's last word), what happens next."""
        self.emit(exited_record(name, code, verdict, self.log_of(name), self.now()))

    def log_of(self, name: str) -> Path:
        """The log file of ``name``'s current life (a spare's life keeps its own file)."""
        return self.log_files.get(name, self.logs / f"{name}.log")

    def rename(self, old: str, new: str) -> None:
        """Child ``old`` lives on as ``new`` (a spare taking a slot): its process, reader,
        log and the events its reader still tags ``old``."""
        self.procs[new] = self.procs.pop(old)
        self.readers[new] = self.readers.pop(old)
        self.log_files[new] = self.log_files.pop(old)
        self.alias[old] = new
        self.expected_exit.discard(new)
        self.policy.started(new)

    def shutdown(self) -> None:
        """Stop every child's process group (torchrun ranks included, see :meth:`signal`):
        SIGTERM, then SIGKILL after 5 s, or at once after a second signal (``abort``)."""
        self.finished.set()
        for name in self.procs:
            self.signal(name, signal.SIGCONT)  # a frozen child cannot die of SIGTERM
            self.signal(name, signal.SIGKILL if self.abort else signal.SIGTERM)
        deadline = time.monotonic() + 5.0
        for name, proc in self.procs.items():
            while proc.poll() is None and time.monotonic() < deadline and not self.abort:
                time.sleep(0.05)
            if proc.poll() is None:
                self.signal(name, signal.SIGKILL)
                proc.wait()
