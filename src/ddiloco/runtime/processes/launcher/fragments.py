"""``ddiloco train --runtime processes``: a syncer and M learners as OS processes on this host.

Owns supervision: it starts ``ddiloco syncer`` and one ``ddiloco learner`` per slot (spawned
with ``subprocess``, never forked from a process holding torch), hands them the run secret
in their environment (never on a command line), relays their ``@event`` lines to the run's
metrics (so the run directory, summary and plots are the simulated clock's), restarts a
learner that dies (it recovers from a peer) and a syncer that dies (it resumes from its
durable store), and plays the chaos plan for real: crash (and node_loss: on one host the
node is the learner's process) = SIGKILL then restart after ``duration``, freeze = SIGSTOP
then SIGCONT, join = start a scavenged slot, leave = SIGTERM (a clean leave), slow = a duty
cycle of SIGSTOP/SIGCONT so the slot runs 1/factor of the time, link_cut / link_slow = a
command to the fault-injecting proxy (on its stdin, a pipe from here), which holds the
learner's frames to and from the syncer for ``duration`` or caps its
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

Any fragment method runs so (``decoupled``, ``decoupled_sync``, ``streaming``, ``diloco``);
the data-parallel baselines are :mod:`.data_parallel`'s. Spawning, event relaying, timers, signals
and shutdown are :class:`~.supervisor.Supervisor`'s, shared with that job. ``decoupled``
keeps its files under ``<run>/processes/``, every other method under
``<run>/processes/<method>/``.
"""

from __future__ import annotations

import contextlib
import functools
import os
import secrets
import signal
import socket
import sys
import threading
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any

from ddiloco.chaos.plan import LINK_KINDS, ChaosEvent, chaos_record
from ddiloco.config import RunConfig, to_toml
from ddiloco.errors import FATAL_EXIT as FATAL_EXIT  # re-exported: what a process exits with
from ddiloco.errors import ConfigError
from ddiloco.methods import method_for
from ddiloco.report.run_writer import note_status_url
from ddiloco.report.summary import syncer_summary
from ddiloco.runtime.layout import SECRET, STORE
from ddiloco.runtime.processes.launcher.devices import (
    GPU_ENV,
    assign_gpus,
    learner_device,
    visible_gpus,
)
from ddiloco.runtime.processes.launcher.link_faults import (
    NO_PROXY,
    PROXY,
    LinkFaults,
    faults_of,
)
from ddiloco.runtime.processes.launcher.spares import Spares
from ddiloco.runtime.processes.launcher.status_port import StatusPort
from ddiloco.runtime.processes.launcher.supervision import Verdict, own_summary, tail
from ddiloco.runtime.processes.launcher.supervisor import Supervisor
from ddiloco.runtime.processes.learner.local_checkpoint import learner_directory
from ddiloco.runtime.processes.transport.shm import remove_run_directory
from ddiloco.runtime.processes.transport.sockets import SECRET_ENV, load_secret, parse_address

RELAYED = (
    "step",
    "eval",
    "round",
    "final_rounds",
    "drop",
    "recovered",
    "caught_up",
    "detected",
    "joined",
    "left",
    "restored",
    "leave",
    "syncer_up",
    "learner_up",
    "operator",  # a kill or leave from the status page
)
SYNCER = "syncer"
STOP_WAIT_SECONDS = 30.0  # after a stop, for the syncer's summary (a restarted one's too)


def free_port(host: str, held: list[socket.socket] | None = None) -> int:
    """A port free on ``host`` now. With ``held`` (Linux), the port stays reserved: the
    socket that found it stays bound (SO_REUSEADDR, never listening) and goes into ``held``
    until the caller closes it. The kernel hands a bound port to no other ``bind(port 0)``
    nor outgoing connection, while a server that sets SO_REUSEADDR itself (zmq does) binds
    it: a torchrun rendezvous or a learner's snapshot server started a moment before the
    syncer once took the syncer's port, and every restart of the syncer failed with
    "Address already in use"."""
    s = socket.socket()
    keep = held is not None and sys.platform.startswith("linux")
    try:
        if keep:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((host, 0))
        port = int(s.getsockname()[1])
    except BaseException:
        s.close()
        raise
    if keep and held is not None:
        held.append(s)
    else:
        s.close()
    return port


class Launcher(Supervisor):
    """Starts, watches and restarts the processes of one fragment method's run."""

    RUNTIME = "processes"  # the summary's runtime

    @staticmethod
    def refuse(config: RunConfig, method: str) -> None:
        if not method_for(config, method).fragments:
            why = "not a fragment method: a data-parallel baseline runs as a torchrun job (dp_job)"
            raise ConfigError("methods", method, why)

    def prepare(self) -> None:
        config = self.config
        self.connect()
        self.config_path = self.home / "config.toml"
        # behind a proxy, payloads must cross it (to be delayed, held or damaged): no shm
        shm = config.processes.shared_memory and self.links is None
        self.gpus = self.learner_gpus()
        child = replace(
            config,
            processes=replace(config.processes, shared_memory=shm),
            train=replace(config.train, device=learner_device(config.train.device)),
        )
        self.config_path.write_text(to_toml(child), encoding="utf-8")
        self.store = self.home / STORE
        self.env[SECRET_ENV] = self.run_secret(self.home / SECRET).hex()
        self.summary: dict[str, Any] | None = None
        self.learner_done: dict[int, dict[str, Any]] = {}
        self.seen: dict[str, Any] = {"rounds": 0, "eval": None}  # for a summary of our own
        self.spares = Spares(self, config.processes.spares if config.processes.ranks == 1 else 0)
        self.status_port = StatusPort(config.processes.http, self.out)  # the page's, kept

    def run_secret(self, path: Path) -> bytes:
        """A fresh secret for a fresh run; a resumed run keeps its own (its learners' saves
        are digested under a key derived from it: state_file.py). Written 0600 to ``path``
        (the status page's kill / leave need it). A launch of another run id is refused by
        the handshakes whatever the secret, so a leftover process cannot join."""
        if self.resume and path.exists():
            return load_secret(str(path))
        secret = secrets.token_bytes(32)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.fchmod(fd, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(secret.hex() + "\n")
        return secret

    def connect(self) -> None:
        """Where the syncer listens (``address``), what the learners dial
        (``learner_address``: the fault-injecting proxy when there is one, else the syncer)
        and the proxy's driver (``links``, or None)."""
        config = self.config
        host, port = parse_address(config.processes.bind, "processes.bind")
        self.reserved: list[socket.socket] = []  # the ports below, until shutdown
        self.address = f"{host}:{port or free_port(host, self.reserved)}"
        proxied = faults_of(config) is not None
        self.learner_address = (
            f"{host}:{free_port(host, self.reserved)}" if proxied else self.address
        )
        self.links = self.link_faults(self.learner_address, self.address) if proxied else None

    def link_faults(self, listen: str, target: str) -> LinkFaults:
        """The driver of a fault proxy listening on ``listen`` in front of the syncer at
        ``target``, started, restarted and stopped as our child ``proxy``."""
        return LinkFaults(
            self.config,
            listen,
            target,
            self.run_id,
            lambda args: self._spawn(PROXY, args, control=True),
            lambda: self.procs.get(PROXY),
        )

    def learner_gpus(self) -> dict[int, str]:
        """Each learner slot's own GPUs (``CUDA_VISIBLE_DEVICES``), refused before anything
        starts when this host has too few."""
        slots = self.config.train.learners + self.config.train.scavenged
        return assign_gpus(self.config, slots, visible_gpus(os.environ))

    # -- processes --------------------------------------------------------------------------
    def _common(self) -> list[str]:
        return [
            "--config",
            str(self.config_path),
            "--run-id",
            self.run_id,
            "--t0",
            repr(self.t0),
            "--method",
            self.method,
        ]

    def start_syncer(self) -> None:
        """Start a syncer life (it resumes from the store), its status page on the port the
        last life's had (:mod:`.status_port`), so the URL a user opened keeps working."""
        cmd = ["syncer", "--bind", self.address, "--store", str(self.store), *self._common()]
        if self.config.processes.journal:
            cmd.append("--journal")
        self._spawn(SYNCER, cmd + self.status_port.args())

    def start_learner(self, m: int, join: bool = False, resume: bool = False) -> None:
        """Start slot ``m``: fresh, ``join`` (copy a peer) or ``resume`` (its own newest local
        checkpoint, else as a join)."""
        state = learner_directory(self.home, m)
        fixed = self.config.processes.peer_port  # one port per slot: learners share this host
        port = fixed + m if fixed else 0
        if join and not resume:  # a restart: a warm spare takes the slot, if one is ready
            order = {"state_dir": str(state), "peer_port": port, "gpus": self.gpus.get(m)}
            old = self.procs.get(f"learner-{m}")
            if (old is None or old.poll() is not None) and self.spares.take(m, order):
                return
        cmd = ["learner", "--syncer", self.learner_address, "--id", str(m), *self._common()]
        cmd += ["--state-dir", str(state), *(["--resume"] if resume else [])]
        cmd += ["--peer-port", str(port), *(["--join"] if join else [])]
        gpus = {GPU_ENV: self.gpus[m]} if m in self.gpus else None
        self._spawn(f"learner-{m}", self.ranked(cmd), env=gpus)

    def ranked(self, cmd: list[str]) -> list[str]:
        """A learner's command as its child runs it: with ``processes.ranks`` > 1, under
        torchrun, which starts its ranks."""
        ranks = self.config.processes.ranks
        if ranks == 1:
            return cmd
        run = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks)]
        return [*run, "-m", "ddiloco.cli", *cmd]

    def start_spare(self, name: str) -> None:
        """Start a warm spare (:mod:`.spares`): it waits on its stdin for a slot."""
        cmd = ["learner", "--spare", "--syncer", self.learner_address, *self._common()]
        self._spawn(name, cmd, control=True)

    def rejoin(self, m: int) -> None:
        """Start learner ``m`` again (copying a peer) once its last life has exited: a clean
        leave may still be saying goodbye when its slot is due back."""
        proc = self.procs.get(f"learner-{m}")
        if proc is not None and proc.poll() is None and not self.stop_requested:
            self.after(0.2, lambda: self.rejoin(m))
        else:
            self.start_learner(m, join=True)

    def torchrun(self, name: str) -> bool:
        return name.startswith("learner-") and self.config.processes.ranks > 1

    # -- chaos ------------------------------------------------------------------------------
    def play(self, event: ChaosEvent) -> None:
        name, m = f"learner-{event.learner}", event.learner
        record = chaos_record(event, self.now())
        reached = True  # a signal reached a live process
        if event.kind in ("crash", "node_loss"):  # (on one host, the node is its process)
            if reached := self.signal(name, signal.SIGKILL):
                self.after(event.duration, lambda: self.start_learner(m, join=True))
        elif event.kind == "freeze":
            if reached := self.signal(name, signal.SIGSTOP):
                self.after(event.duration, lambda: self.thaw(name))
        elif event.kind == "join":
            self.start_learner(m, join=True)
        elif event.kind == "leave":
            reached = self.signal(name, signal.SIGTERM)
        elif event.kind == "preempt":  # a clean leave (it says bye), back after duration
            if reached := self.signal(name, signal.SIGTERM):
                self.after(event.duration, lambda: self.rejoin(m))
        elif event.kind == "slow" and event.factor > 1.0:
            threading.Thread(
                target=self.throttle, args=(name, event.factor, event.duration), daemon=True
            ).start()
        elif event.kind in LINK_KINDS:
            if self.links is None:
                record["skipped"] = NO_PROXY
            else:
                self.links.play(event)
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
        """A straggler: the slot's process (whichever holds it, as the simulated clock slows
        the slot) runs 1/factor of the time for ``duration`` seconds (0: to the end)."""
        self.duty_cycle(lambda sig: self.signal(name, sig), factor, duration)

    def crash_syncer(self, down_seconds: float) -> None:
        """SIGKILL the syncer and start it again (from its durable store) later."""
        if self.signal(SYNCER, signal.SIGKILL):
            self.emit(
                {
                    "kind": "chaos",
                    "t": self.now(),
                    "event": "syncer_crash",
                    "learner": -1,
                    "duration": down_seconds,
                    "factor": 1.0,
                }
            )
            self.after(down_seconds, self.start_syncer)

    def request_stop(self) -> None:
        """End the run now: the syncer evaluates, writes its summary and stops the learners.
        A syncer that is down (killed, or waiting out a restart delay) is started now; one
        still starting is asked once it is up (its ``syncer_up``). Call it from the
        launcher's thread (a hook, a timer); a signal handler calls :meth:`interrupt`."""
        self.begin_stop(STOP_WAIT_SECONDS)
        proc = self.procs.get(SYNCER)
        if proc is None:
            return
        if proc.poll() is None:
            if self.policy.is_up(SYNCER):  # else its syncer_up asks it
                self.ask_to_stop(SYNCER)
        elif SYNCER in self.expected_exit:  # its exit is handled: a restart is pending
            self.start_syncer()

    def ask_to_stop(self, name: str) -> None:
        """A SIGTERM to ``name``'s process group: its clean stop, not an exit we caused (a
        syncer stopping ends the run its own way)."""
        proc = self.procs.get(name)
        if proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)

    # -- supervision ------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        """Run to the end (the syncer's summary); return it, with the launcher's totals."""
        self.start_syncer()
        if self.links is not None:
            self.links.start()
        for m in range(self.config.train.learners):
            self.start_learner(m, resume=self.resume)
        self.spares.fill()
        self.schedule_chaos(self.config.chaos)
        try:
            if not self.watch(lambda: self.summary is not None, self._supervise):
                self.summary = own_summary(self.seen, self.now())  # no syncer came
            assert self.summary is not None
            self.spares.stop()
            if self.summary.get("summary_source") != "launcher":  # else nobody stops them
                self._wait_learners(10.0)
        finally:
            self.shutdown()
            if self.links is not None:
                self.links.close()
        time.sleep(0.2)  # the proxy's last words: its counts
        self.drain()
        return self._totals(self.summary)

    def handle(self, name: str, record: dict[str, Any]) -> None:
        kind = record.get("kind")
        if kind == "round":
            self.seen["rounds"] += 1
        elif kind == "eval":
            self.seen["eval"] = record
        note_status_url(self.out, record)
        if name == SYNCER:
            self.status_port.heard(record)
        if kind == "summary" and name == SYNCER:
            self.summary = record
        elif kind == "syncer_up" and self.stop_requested:
            self.request_stop()
        elif kind == "proxy" and self.links is not None:
            self.links.counts = record["counts"]
        elif kind == "proxy_up" and self.links is not None:
            self.links.up()  # what is left of each link fault, to a restarted proxy
        elif kind == "learner_done":
            self.learner_done[int(record["learner"])] = record
        self.spares.heard(name, record)
        if kind in RELAYED:
            self.emit(record)

    def _supervise(self) -> bool:
        """Judge every process that exited on its own (once per life): restart it after its
        backoff delay, or raise :class:`LaunchError`. Its last events are relayed first, so
        a syncer that ended with a summary is not taken for a crash. True once the summary
        is in."""
        for name, proc in list(self.procs.items()):
            code = proc.poll()
            if code is None or name in self.expected_exit or self.summary is not None:
                continue
            self.settle(name)
            while not self.events.empty() and self.summary is None:
                self.pump(0.0)
            if self.summary is not None:
                return True
            if self.procs.get(name) is not proc:  # an event's hook started a new life
                continue
            self.expected_exit.add(name)  # handled once
            if (
                name == SYNCER
                and code == FATAL_EXIT
                and self.status_port.lost(tail(self.log_of(name)))
            ):
                why = "its status page's port was taken since the last life: on a free one now"
                self.exited(name, code, Verdict(name, code, 0, 0.0, False, why))
                self.restarts[name] = self.restarts.get(name, 0) + 1
                self.start_syncer()
                continue
            if self.spares.is_spare(name):  # replaced, unless spares keep failing (loud)
                verdict = self.policy.exited(name, code)
                self.exited(name, code, verdict)
                if verdict.give_up:
                    raise verdict.error(self.log_of(name))
                self.after(verdict.delay, self.spares.fill)
                continue
            # a learner that is done or left (0), or that is not restarted (processes.restart
            # off) unless it failed fatally: the run goes on without it
            unrestarted = code == 0 or (not self.config.processes.restart and code != FATAL_EXIT)
            if name.startswith("learner-") and unrestarted:
                self.exited(name, code, None)
                continue
            verdict = self.policy.exited(name, code)
            self.exited(name, code, verdict)
            if verdict.give_up:
                raise verdict.error(self.log_of(name))
            self.restarts[name] = self.restarts.get(name, 0) + 1
            if name == SYNCER:
                self.after(verdict.delay, self.start_syncer)
            elif name == PROXY and self.links is not None:
                self.after(verdict.delay, self.links.start)
            else:
                m = int(name.split("-")[1])
                self.after(verdict.delay, functools.partial(self.start_learner, m, True))
        return self.summary is not None

    def _wait_learners(self, seconds: float, grace: float = 2.0) -> None:
        """After the summary: the learners the syncer stopped exit on their own; one it never
        let in (started or restarted as the run ended) waits for a welcome that cannot come,
        so what still runs after ``grace`` seconds is asked to leave (SIGTERM)."""
        start = time.monotonic()
        asked = False
        while time.monotonic() < start + seconds and not self.abort:
            running = [n for n, p in self.procs.items() if n != PROXY and p.poll() is None]
            if not running:
                break
            if not asked and time.monotonic() >= start + grace:
                asked = True
                for name in running:
                    if name != SYNCER:
                        self.ask_to_stop(name)
            self.pump(0.05)
        time.sleep(0.2)  # the readers' last lines
        self.drain()

    def shutdown(self) -> None:
        """Stop every child (:meth:`Supervisor.shutdown`), then remove the run's
        shared-memory directory (slots of killed processes)."""
        super().shutdown()
        remove_run_directory(self.run_id)
        for held in getattr(self, "reserved", []):
            held.close()

    def _totals(self, summary: dict[str, Any] | None) -> dict[str, Any]:
        """The syncer's (or our own) summary in the schema every runtime writes
        (:func:`ddiloco.report.summary.summary`), with the launcher's own counts."""
        assert summary is not None
        done = self.learner_done.values()
        extra: dict[str, Any] = dict(
            stopped=self.stop_requested,
            stop_signal=signal.Signals(self.stop_signal).name if self.stop_signal else None,
            bytes_peer_recovery=sum(r.get("bytes_peer", 0) for r in done),
            restarts=dict(self.restarts),
            refused_by_learners=dict(sum((Counter(r.get("refused", {})) for r in done), Counter())),
            # each learner's bytes to and from the syncer in its last life, rank by rank (a
            # DDP learner's other ranks send and receive none)
            learner_bytes_sent={
                str(m): r.get("rank_bytes_sent") or [r.get("bytes_sent", 0)]
                for m, r in sorted(self.learner_done.items())
            },
            learner_bytes_received={
                str(m): r.get("rank_bytes_received") or [r.get("bytes_received", 0)]
                for m, r in sorted(self.learner_done.items())
            },
        )
        if self.links is not None:
            extra["proxy"] = self.links.counts
        return syncer_summary(
            summary,
            method=self.method,
            runtime=self.RUNTIME,
            seconds=float(summary["t"]),  # wall seconds on this clock
            # lock-step waiting, summed over learners (0 for decoupled: they never wait)
            idle_seconds=float(sum(r.get("idle_seconds", 0.0) for r in done)),
            **extra,
        )
