"""``ddiloco train --runtime processes``: a syncer and M learners as OS processes on this host.

Owns supervision: it starts ``ddiloco syncer`` and one ``ddiloco learner`` per slot (spawned
with ``subprocess``, never forked from a process holding torch), hands them the run secret
in their environment (never on a command line), relays their ``@event`` lines to the run's
metrics (so the run directory, summary and plots are the simulated clock's), restarts a
learner that dies (it recovers from a peer) and a syncer that dies (it resumes from its
durable store), and plays the chaos plan for real: crash = SIGKILL then restart after
``duration``, freeze = SIGSTOP then SIGCONT, join = start a scavenged slot, leave = SIGTERM
(a clean leave), slow = a duty cycle of SIGSTOP/SIGCONT so the slot runs 1/factor of the
time, link_cut / link_slow = a command to the fault-injecting proxy (on its stdin, a pipe from
here), which holds the learner's frames to and from the syncer for ``duration`` or caps its
links at ``network.learner_syncer_gbps`` / factor. A plan with link faults gets a proxy (with
no wire faults) even when ``processes.proxy`` is unset. Event times are wall seconds since
the launch.

A process that exits on its own is restarted with capped exponential backoff, and the run
is stopped with a :class:`LaunchError` (naming the process, its exit code and the tail of
its log) when it keeps failing or exits with :data:`FATAL_EXIT` (:mod:`.supervision`).
:meth:`Launcher.request_stop` (a hook's, or the first SIGINT/SIGTERM through
:meth:`Launcher.interrupt`) ends the run with the syncer's summary: a syncer that is down
then is started at once and waited for :data:`STOP_WAIT_SECONDS`, after which the launcher
writes the summary from what it heard (``summary_source: launcher``); a second signal kills
every process group at once.
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
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import IO, Any

from ddiloco.chaos.plan import ChaosEvent
from ddiloco.config import RunConfig, to_toml
from ddiloco.errors import FATAL_EXIT as FATAL_EXIT  # re-exported: what a process exits with
from ddiloco.errors import ConfigError
from ddiloco.runtime.processes.common import EVENT_PREFIX, SECRET_ENV, parse_address
from ddiloco.runtime.processes.proxy import Faults
from ddiloco.runtime.processes.setup import PROCESS_METHODS
from ddiloco.runtime.processes.shm import remove_run_directory
from ddiloco.runtime.processes.supervision import (
    RestartPolicy,
    Verdict,
    descendant_groups,
    exited_record,
    own_summary,
)

RELAYED = ("step", "eval", "round", "drop", "recovered", "detected", "joined", "left",
           "restored", "leave", "syncer_up", "learner_up")  # fmt: skip
SYNCER = "syncer"
PROXY = "proxy"
LINK_KINDS = ("link_slow", "link_cut")
STOP_WAIT_SECONDS = 30.0  # after a stop, for the syncer's summary (a restarted one's too)


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class Launcher:
    """Starts, watches and restarts the processes of one method's run."""

    def __init__(
        self,
        config: RunConfig,
        method: str,
        out: Path,
        emit: Callable[[dict[str, Any]], None],
        hooks: Sequence[Callable[[Launcher, dict[str, Any]], None]] = (),
    ) -> None:
        if method not in PROCESS_METHODS:
            raise ConfigError("methods", method, f"the processes runtime runs {PROCESS_METHODS}")
        self.config = config
        self.method = method
        self.out = out
        self.emit = emit
        host, port = parse_address(config.processes.bind, "processes.bind")
        self.address = f"{host}:{port or free_port(host)}"
        self.faults = Faults.parse(config.processes.proxy) if config.processes.proxy else None
        if self.faults is None and any(e.kind in LINK_KINDS for e in config.chaos):
            self.faults = Faults()  # a proxy that only plays the link faults
        self.link_commands: list[tuple[float, dict[str, Any]]] = []  # (monotonic end, command)
        # learners talk to the fault-injecting proxy when there is one, else to the syncer
        self.learner_address = f"{host}:{free_port(host)}" if self.faults else self.address
        self.proxy_counts: dict[str, int] = {}
        self.config_path = out / "processes" / "config.toml"
        self.logs = out / "processes" / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        # behind a proxy, payloads must cross it (to be delayed, held or damaged): no shm
        shm = config.processes.shared_memory and self.faults is None
        child = replace(config, processes=replace(config.processes, shared_memory=shm))
        self.config_path.write_text(to_toml(child), encoding="utf-8")
        self.store = out / "processes" / "syncer_state"
        self.run_id = f"{config.name}-{secrets.token_hex(4)}"
        self.env = {**os.environ, SECRET_ENV: secrets.token_bytes(32).hex()}
        self.env["PYTHONUNBUFFERED"] = "1"
        self.t0 = time.time()
        self.procs: dict[str, subprocess.Popen[str]] = {}
        self.expected_exit: set[str] = set()  # killed or stopped on purpose
        self.events: queue.SimpleQueue[tuple[str, dict[str, Any]]] = queue.SimpleQueue()
        self._timers: list[tuple[float, int, Callable[[], None]]] = []
        self._tie = itertools.count()
        self.summary: dict[str, Any] | None = None
        self.learner_done: dict[int, dict[str, Any]] = {}
        self.restarts: dict[str, int] = {}
        p = config.processes
        self.policy = RestartPolicy(p.max_restarts, p.restart_delay_seconds,
                                    p.restart_backoff_cap_seconds)  # fmt: skip
        self.readers: dict[str, threading.Thread] = {}
        self.hooks = list(hooks)  # called with every event, in the launcher's thread
        self.stop_requested = False
        self.stop_deadline = math.inf  # monotonic: when a stop stops waiting for the syncer
        self.stop_signal: int | None = None  # the first SIGINT/SIGTERM (see interrupt)
        self.abort = False  # a second signal: kill everything now
        self.seen: dict[str, Any] = {"rounds": 0, "eval": None}  # for a summary of our own
        self.finished = threading.Event()  # the run is over: background chaos stops

    # -- processes --------------------------------------------------------------------------
    def _common(self) -> list[str]:
        return ["--config", str(self.config_path), "--run-id", self.run_id, "--t0",
                repr(self.t0), "--method", self.method]  # fmt: skip

    def start_syncer(self) -> None:
        cmd = ["syncer", "--bind", self.address, "--store", str(self.store), *self._common()]
        if self.config.processes.journal:
            cmd.append("--journal")
        self._spawn(SYNCER, cmd)

    def start_proxy(self) -> None:
        assert self.faults is not None
        cmd = ["-m", "ddiloco.runtime.processes.proxy", "--listen", self.learner_address,
               "--target", self.address, "--run-id", self.run_id,
               "--faults", self.config.processes.proxy,
               "--seed", str(self.config.seed), "--control",
               "--gbps", repr(self.config.network.learner_syncer_gbps)]  # fmt: skip
        old = self.procs.get(PROXY)
        if old is not None and old.poll() is not None and old.stdin is not None:
            old.stdin.close()
        self._spawn(PROXY, cmd, control=True)
        now = time.monotonic()  # a restarted proxy: the link faults still on, for what is left
        for end, command in self.link_commands:
            if end > now:
                left = {"cut_seconds": end - now} if "cut_seconds" in command else {
                    "seconds": 0.0 if math.isinf(end) else end - now}  # fmt: skip
                self.send_link({**command, **left})

    def send_link(self, command: dict[str, Any]) -> bool:
        """One JSON line on the proxy's control pipe; False if there is no proxy to hear it."""
        proc = self.procs.get(PROXY)
        if proc is None or proc.poll() is not None or proc.stdin is None:
            return False
        try:
            proc.stdin.write(json.dumps(command) + "\n")
            proc.stdin.flush()
        except (OSError, ValueError):  # a broken or closed pipe: it died
            return False
        return True

    def play_link(self, event: ChaosEvent) -> str | None:
        """link_cut / link_slow through the proxy; returns why it was not played, if not."""
        if self.faults is None:
            return "no proxy: set processes.proxy, or put the link fault in the chaos plan"
        now, m = time.monotonic(), event.learner
        if event.kind == "link_cut":
            command: dict[str, Any] = {"link": m, "cut_seconds": event.duration}
            end = now + event.duration
        else:
            command = {"link": m, "factor": event.factor, "seconds": event.duration}
            end = now + event.duration if event.duration > 0 else math.inf
        self.link_commands.append((end, command))
        self.send_link(command)  # if the proxy is down, its restart replays what is left
        return None

    def start_learner(self, m: int, join: bool = False) -> None:
        cmd = ["learner", "--syncer", self.learner_address, "--id", str(m), *self._common()]
        ranks = self.config.processes.ranks
        if ranks > 1:  # a data-parallel learner: torchrun starts its ranks
            cmd = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                   str(ranks), "-m", "ddiloco.cli", *cmd]  # fmt: skip
        self._spawn(f"learner-{m}", [*cmd, "--join"] if join else cmd)

    def _spawn(self, name: str, args: list[str], control: bool = False) -> None:
        old = self.procs.get(name)
        if old is not None and old.poll() is None:
            return
        self.expected_exit.discard(name)
        log = (self.logs / f"{name}.log").open("a", encoding="utf-8")
        raw = args[0] in ("-m", "-c")  # a module or a program, else a ddiloco command
        argv = [sys.executable, *(args if raw else ["-m", "ddiloco.cli", *args])]
        proc = subprocess.Popen(argv, env=self.env, stdout=subprocess.PIPE, stderr=log, text=True,
                                stdin=subprocess.PIPE if control else None,
                                start_new_session=True)  # fmt: skip  # its own process group
        log.close()
        self.procs[name] = proc
        self.policy.started(name)
        reader = threading.Thread(target=self._read, args=(name, proc.stdout), daemon=True)
        self.readers[name] = reader
        reader.start()
        self.emit({"kind": "started", "t": self.now(), "process": name, "pid": proc.pid,
                   "run": self.run_id})  # fmt: skip

    def _read(self, name: str, stream: IO[str] | None) -> None:
        assert stream is not None
        for line in stream:
            if line.startswith(EVENT_PREFIX):
                with contextlib.suppress(json.JSONDecodeError):
                    self.events.put((name, json.loads(line[len(EVENT_PREFIX) :])))

    def signal(self, name: str, sig: int) -> bool:
        """Send ``sig`` to one of our own children: its process group (which it leads) and,
        for a torchrun learner, its ranks' groups. torchrun starts every rank in a session of
        its own, so a signal to the torchrun group alone reaches no rank: a crash would leave
        the ranks training as orphans, a freeze or slowdown would stop only torchrun. The
        ranks are found through /proc (Linux), before any of them is signalled."""
        proc = self.procs.get(name)
        if proc is None or proc.poll() is not None:
            return False
        if sig in (signal.SIGKILL, signal.SIGTERM):
            self.expected_exit.add(name)
        ranks = name.startswith("learner-") and self.config.processes.ranks > 1
        groups = descendant_groups(proc.pid) if ranks else []
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return False
        for group in groups:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(group, sig)
        return True

    def thaw(self, name: str) -> None:
        self.signal(name, signal.SIGCONT)

    def after(self, seconds: float, action: Callable[[], None]) -> None:
        heapq.heappush(self._timers, (time.monotonic() + seconds, next(self._tie), action))

    def now(self) -> float:
        return time.time() - self.t0

    # -- chaos ------------------------------------------------------------------------------
    def schedule_chaos(self, events: tuple[ChaosEvent, ...]) -> None:
        for event in events:
            self.after(max(0.0, event.at - self.now()), functools.partial(self.play, event))

    def play(self, event: ChaosEvent) -> None:
        name, m = f"learner-{event.learner}", event.learner
        record = {"kind": "chaos", "t": self.now(), "event": event.kind, "learner": m,
                  "duration": event.duration, "factor": event.factor}  # fmt: skip
        reached = True  # a signal reached a live process
        if event.kind == "crash":
            if reached := self.signal(name, signal.SIGKILL):
                self.after(event.duration, lambda: self.start_learner(m, join=True))
        elif event.kind == "freeze":
            if reached := self.signal(name, signal.SIGSTOP):
                self.after(event.duration, lambda: self.thaw(name))
        elif event.kind == "join":
            self.start_learner(m, join=True)
        elif event.kind == "leave":
            reached = self.signal(name, signal.SIGTERM)
        elif event.kind == "slow" and event.factor > 1.0:
            threading.Thread(target=self.throttle, args=(name, event.factor, event.duration),
                             daemon=True).start()  # fmt: skip
        elif event.kind in LINK_KINDS:
            skipped = self.play_link(event)
            if skipped:
                record["skipped"] = skipped
        else:
            record["skipped"] = "not played by the processes runtime yet"
        if not reached:
            record["skipped"] = f"{name} is not running"
        self.emit(record)

    def play_crash(self, m: int, down_seconds: float) -> float:
        """SIGKILL learner ``m`` now and restart it (recovering from a peer) later; returns
        the time of the kill."""
        self.play(ChaosEvent(at=self.now(), kind="crash", learner=m, duration=down_seconds))
        return self.now()

    def throttle(self, name: str, factor: float, duration: float) -> None:
        """A straggler: stop and continue the slot's process so it runs 1/factor of the time
        (whichever process holds the slot, as the simulated clock slows the slot), for
        ``duration`` seconds (0: to the end)."""
        period = 0.2
        stopped = period * (1.0 - 1.0 / factor)
        end = time.monotonic() + duration if duration > 0 else float("inf")
        while time.monotonic() < end and not self.finished.is_set():
            if self.signal(name, signal.SIGSTOP):
                time.sleep(stopped)
                self.signal(name, signal.SIGCONT)
            time.sleep(period - stopped)

    def crash_syncer(self, down_seconds: float) -> None:
        """SIGKILL the syncer and start it again (from its durable store) later."""
        if self.signal(SYNCER, signal.SIGKILL):
            self.emit({"kind": "chaos", "t": self.now(), "event": "syncer_crash", "learner": -1,
                       "duration": down_seconds, "factor": 1.0})  # fmt: skip
            self.after(down_seconds, self.start_syncer)

    def request_stop(self) -> None:
        """End the run now: the syncer evaluates, writes its summary and stops the learners.
        A syncer that is down (killed, or waiting out a restart delay) is started now; one
        still starting is asked once it is up (its ``syncer_up``). Call it from the
        launcher's thread (a hook, a timer); a signal handler calls :meth:`interrupt`."""
        if not self.stop_requested:
            self.stop_requested = True
            self.stop_deadline = time.monotonic() + STOP_WAIT_SECONDS
        proc = self.procs.get(SYNCER)
        if proc is None:
            return
        if proc.poll() is None:
            if self.policy.is_up(SYNCER):  # else its syncer_up asks it
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
        elif SYNCER in self.expected_exit:  # its exit is handled: a restart is pending
            self.start_syncer()

    def interrupt(self, signum: int) -> None:
        """For a SIGINT/SIGTERM handler (it only sets flags; the launcher's loop acts): the
        first asks for a clean stop, the second for everything killed at once."""
        if self.stop_signal is None:
            self.stop_signal = signum
        else:
            self.abort = True

    # -- supervision ------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        """Run to the end (the syncer's summary); return it, with the launcher's totals."""
        self.start_syncer()
        if self.faults is not None:
            self.start_proxy()
        for m in range(self.config.train.learners):
            self.start_learner(m)
        self.schedule_chaos(self.config.chaos)
        limit = self.config.processes.max_wall_seconds
        try:
            while self.summary is None:
                if self.now() > limit:
                    raise ConfigError("processes.max_wall_seconds", limit, "the run did not end")
                self._check_signals()
                if self.stop_requested and time.monotonic() > self.stop_deadline:
                    self.summary = own_summary(self.seen, self.now())  # no syncer came
                    break
                self._pump(0.05)
                self._supervise()
            if self.summary.get("summary_source") != "launcher":  # else nobody stops them
                self._wait_learners(10.0)
        finally:
            self.shutdown()
            proxy = self.procs.get(PROXY)
            if proxy is not None and proxy.stdin is not None:
                proxy.stdin.close()  # its control pipe
        time.sleep(0.2)  # the proxy's last words: its counts
        while not self.events.empty():
            self._pump(0.0)
        return self._totals(self.summary)

    def _check_signals(self) -> None:
        if self.abort:
            raise KeyboardInterrupt  # run()'s cleanup kills every process group
        if self.stop_signal is not None and not self.stop_requested:
            self.request_stop()

    def _pump(self, timeout: float) -> None:
        while self._timers and self._timers[0][0] <= time.monotonic():
            heapq.heappop(self._timers)[2]()
        try:
            name, record = self.events.get(timeout=timeout)
        except queue.Empty:
            return
        kind = record.get("kind")
        self.policy.heard(name, str(kind))
        if kind == "round":
            self.seen["rounds"] += 1
        elif kind == "eval":
            self.seen["eval"] = record
        if kind == "summary" and name == SYNCER:
            self.summary = record
        elif kind == "syncer_up" and self.stop_requested:
            self.request_stop()
        elif kind == "proxy":
            self.proxy_counts = record["counts"]
        elif kind == "learner_done":
            self.learner_done[int(record["learner"])] = record
        if kind in RELAYED:
            self.emit(record)
        for hook in self.hooks:
            hook(self, record)

    def _supervise(self) -> None:
        """Judge every process that exited on its own (once per life): restart it after its
        backoff delay, or raise :class:`LaunchError`. Its last events are relayed first, so
        a syncer that ended with a summary is not taken for a crash."""
        for name, proc in list(self.procs.items()):
            code = proc.poll()
            if code is None or name in self.expected_exit or self.summary is not None:
                continue
            reader = self.readers.get(name)
            if reader is not None:
                reader.join(timeout=2.0)
            while not self.events.empty() and self.summary is None:
                self._pump(0.0)
            if self.summary is not None:
                return
            if self.procs.get(name) is not proc:  # an event's hook started a new life
                continue
            self.expected_exit.add(name)  # handled once
            # a learner that is done or left (0), or that is not restarted (processes.restart
            # off) unless it failed fatally: the run goes on without it
            unrestarted = code == 0 or (not self.config.processes.restart and code != FATAL_EXIT)
            if name.startswith("learner-") and unrestarted:
                self._exited(name, code, None)
                continue
            verdict = self.policy.exited(name, code)
            self._exited(name, code, verdict)
            if verdict.give_up:
                raise verdict.error(self.logs / f"{name}.log")
            self.restarts[name] = self.restarts.get(name, 0) + 1
            if name == SYNCER:
                self.after(verdict.delay, self.start_syncer)
            elif name == PROXY:
                self.after(verdict.delay, self.start_proxy)
            else:
                m = int(name.split("-")[1])
                self.after(verdict.delay, functools.partial(self.start_learner, m, True))

    def _exited(self, name: str, code: int, verdict: Verdict | None) -> None:
        """The ``exited`` record: the code, why (its log's last word), what happens next."""
        self.emit(exited_record(name, code, verdict, self.logs / f"{name}.log", self.now()))

    def _wait_learners(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and not self.abort:
            if all(p.poll() is not None for n, p in self.procs.items() if n != PROXY):
                break
            self._pump(0.05)
        time.sleep(0.2)  # the readers' last lines
        while not self.events.empty():
            self._pump(0.0)

    def shutdown(self) -> None:
        """Stop every child's process group (torchrun ranks included, see :meth:`signal`):
        SIGTERM, then SIGKILL after 5 s or at once after a second signal (``abort``); then
        remove the run's shared-memory directory."""
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
        remove_run_directory(self.run_id)  # shared-memory slots of killed processes

    def _totals(self, summary: dict[str, Any] | None) -> dict[str, Any]:
        assert summary is not None
        out = {k: v for k, v in summary.items() if k not in ("kind", "t")}
        tokens = max(int(out["tokens"]), 1)
        out.setdefault("summary_source", "syncer")
        out.update(
            stopped=self.stop_requested,
            stop_signal=signal.Signals(self.stop_signal).name if self.stop_signal else None,
            method=self.method,
            runtime="processes",
            virtual_seconds=float(summary["t"]),  # wall seconds on this clock
            idle_seconds=0.0,  # learners never wait
            token_efficiency=float(out["tokens_merged"]) / tokens,
            bytes_peer_recovery=sum(r.get("bytes_peer", 0) for r in self.learner_done.values()),
            bytes_per_token=(out["bytes_sent"] + out["bytes_received"]) / tokens,
            restarts=dict(self.restarts),
            refused_by_learners=dict(
                sum((Counter(r.get("refused", {})) for r in self.learner_done.values()), Counter())
            ),
        )
        if self.faults is not None:
            out["proxy"] = self.proxy_counts
        return out
