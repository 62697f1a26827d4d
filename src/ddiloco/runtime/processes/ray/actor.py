"""One ddiloco service (``ddiloco syncer`` or ``ddiloco learner``) hosted in a Ray actor.

The actor runs the same command line the local launcher would spawn, in its own worker
process, so the syncer and learner code is the processes runtime's, unchanged. What a Ray
host changes is rewritten in the command before it runs (:func:`placed_argv`): the config
travels as text (the driver's file is not on this node), ``NODE`` in an address is this
node's IP, ``ray:NAME`` (a learner's ``--syncer``, the proxy's ``--target``) is the address
the named service actor bound (the syncer's, or the fault proxy's in front of it), and a learner
whose actor Ray restarted after a death (``was_current_actor_reconstructed``) takes the join
path, copying a peer, even if the call that restarts it did not say so.

Its stdout (the ``@event`` lines) and stderr (the log) are kept in memory until the driver
drains them (:meth:`ServiceActor.drain`): a killed actor loses what was not drained yet, at
most one poll interval. Fragments never travel through Ray: the services talk over
ddiloco's authenticated wire, as on any host. The run secret reaches the actor in the call's
environment, through Ray's own channels: a Ray cluster is one trust domain (docs/deploy.md).
"""

from __future__ import annotations

import importlib
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import ray

NODE = "NODE"  # in an address: this node's IP, filled in on the node
RAY_ACTOR = "ray:"  # ray:NAME: the address the named service actor bound
LISTEN_FLAGS = ("--bind", "--listen")  # a syncer's, a proxy's own address
OUT, ERR = "out", "err"
MAX_LINES = 100_000  # kept while nobody drains (a driver gone): the oldest are dropped


class Lines:
    """Lines written by the hosted service, until the driver takes them."""

    def __init__(self) -> None:
        self._lines: list[tuple[str, str]] = []
        self._cond = threading.Condition()

    def add(self, stream: str, line: str) -> None:
        with self._cond:
            self._lines.append((stream, line))
            if len(self._lines) > MAX_LINES:
                del self._lines[: len(self._lines) - MAX_LINES]
            self._cond.notify_all()

    def take(self, timeout: float) -> list[tuple[str, str]]:
        with self._cond:
            if not self._lines:
                self._cond.wait(timeout)
            taken, self._lines = self._lines, []
            return taken


class Inbox:
    """The hosted service's stdin: a warm spare (``ddiloco learner --spare``) blocks on
    :meth:`readline` until the driver hands it a slot (:meth:`ServiceHost.order`); closed
    (end of input, ``""``) when the run stops it."""

    def __init__(self) -> None:
        self._text: list[str] = []
        self._closed = False
        self._waiting = 0
        self._cond = threading.Condition()

    def put(self, text: str) -> None:
        with self._cond:
            self._text.append(text)
            self._cond.notify_all()

    def close(self) -> bool:
        """End of input; True if a reader was waiting (it heard it)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            return self._waiting > 0

    def readline(self, size: int = -1) -> str:
        """The next line (``size`` is not honoured: the driver writes whole lines)."""
        with self._cond:
            self._waiting += 1
            while not self._closed and "\n" not in "".join(self._text):
                self._cond.wait()
            self._waiting -= 1
            text = "".join(self._text)
            line, newline, rest = text.partition("\n")
            self._text = [rest] if rest else []
            return line + newline  # "" at the end of input

    def isatty(self) -> bool:
        return False

    @property
    def buffer(self) -> InboxBytes:
        return InboxBytes(self)  # (the fault proxy reads its commands as bytes)


class InboxBytes:
    """``sys.stdin.buffer`` of an :class:`Inbox`: its lines as bytes."""

    def __init__(self, inbox: Inbox) -> None:
        self.inbox = inbox

    def readline(self, size: int = -1) -> bytes:
        return self.inbox.readline(size).encode()


class Relay:
    """A text stream that hands every complete line to :class:`Lines` (and, for stderr, to
    the worker's own log too, where Ray keeps it)."""

    def __init__(self, lines: Lines, stream: str, tee: Any = None) -> None:
        self.lines, self.stream, self.tee = lines, stream, tee
        self._partial = ""
        self._lock = threading.Lock()

    def write(self, text: str) -> int:
        with self._lock:
            self._partial += text
            *complete, self._partial = self._partial.split("\n")
        for line in complete:
            self.lines.add(self.stream, line)
        if self.tee is not None:
            self.tee.write(text)
        return len(text)

    def flush(self) -> None:
        if self.tee is not None:
            self.tee.flush()

    def isatty(self) -> bool:
        return False


def placed_argv(
    argv: Sequence[str], ip: str, config_file: Path, syncer: str | None, rejoin: bool
) -> list[str]:
    """The driver's command line as this node runs it (see the module docstring)."""
    out = list(argv)
    for i, arg in enumerate(out[:-1]):
        value = out[i + 1]
        if arg == "--config":
            out[i + 1] = str(config_file)
        elif arg in (*LISTEN_FLAGS, "--peer-host") and value.startswith(NODE):
            out[i + 1] = ip + value[len(NODE) :]
        elif arg in ("--syncer", "--target") and value.startswith(RAY_ACTOR):
            if syncer is None:
                raise RuntimeError(f"no address for {value}")
            out[i + 1] = syncer
    learner = bool(out) and out[0] == "learner"
    if learner and "--peer-host" not in out:
        out += ["--peer-host", ip]  # where peers reach this learner's snapshots
    if learner and rejoin and "--join" not in out and "--resume" not in out:
        out.append("--join")  # restarted by Ray after a death: copy a peer, never step 0
    return out


class ServiceHost:
    """Hosts one service's life at a time (:meth:`run`); the other methods answer while it
    runs (the actor is threaded: drain, where, terminate). As an actor: :data:`ServiceActor`."""

    def __init__(self, name: str, warm: bool = True) -> None:
        self.name = name
        self.reconstructed = bool(ray.get_runtime_context().was_current_actor_reconstructed)
        self.lines = Lines()
        sys.stdout = Relay(self.lines, OUT)
        sys.stderr = Relay(self.lines, ERR, tee=sys.__stderr__)
        self.inbox = Inbox()
        sys.stdin = self.inbox  # a spare's order comes here
        self.address: str | None = None  # a syncer's or proxy's, once its command is placed
        self.runs = 0
        if warm:  # (not the fault proxy's: it trains nothing, and comes back sooner without)
            self._warm()

    @staticmethod
    def _warm() -> None:
        """Ray starts a restarted actor's process at once, so the imports (torch: seconds)
        are done by the time the launcher's restart call comes."""
        import torch

        import ddiloco.cli
        import ddiloco.runtime.processes.learner.process
        import ddiloco.runtime.processes.syncer.service  # noqa: F401

        torch.optim.AdamW([torch.zeros(1, requires_grad=True)])  # its first imports dynamo: 2 s

    def where(self) -> dict[str, Any]:
        """This actor's process and node (for signals), and whether Ray restarted it."""
        context = ray.get_runtime_context()
        return {
            "pid": os.getpid(),
            "node": context.get_node_id(),
            "ip": ray.util.get_node_ip_address(),
            "reconstructed": self.reconstructed,
        }

    def bound(self, timeout: float) -> str | None:
        """A syncer's (or proxy's) address once its command is placed (learners dial it)."""
        deadline = time.monotonic() + timeout
        while self.address is None and time.monotonic() < deadline:
            time.sleep(0.05)
        return self.address

    def run(self, argv: list[str], config_text: str, env: dict[str, str], namespace: str) -> int:
        """Run one ddiloco command (or ``-m MODULE ...``: that module's ``main``, as the
        fault proxy is run) to its end; its exit code (a crash kills the actor)."""
        from ddiloco.cli import main
        from ddiloco.runtime.processes import terminate

        os.environ.update(env)
        home = Path(tempfile.mkdtemp(prefix=f"ddiloco-{self.name}-"))
        config_file = home / "config.toml"
        config_file.write_text(config_text, encoding="utf-8")
        syncer = None
        target = next((a for a in argv if a.startswith(RAY_ACTOR)), None)
        if target is not None:
            syncer = bound_address(target[len(RAY_ACTOR) :], namespace)
        rejoin = self.reconstructed and self.runs == 0
        placed = placed_argv(argv, ray.util.get_node_ip_address(), config_file, syncer, rejoin)
        if placed[0] == "-m":
            main, placed = importlib.import_module(placed[1]).main, placed[2:]
        listen = [placed[i + 1] for i, a in enumerate(placed[:-1]) if a in LISTEN_FLAGS]
        if listen:
            self.address = listen[0]
        self.runs += 1
        try:
            return int(main(placed))
        except SystemExit as exc:  # argparse
            return int(exc.code) if isinstance(exc.code, int) else 2
        except Exception:  # a crash: its traceback is the log's last word, as a process's
            traceback.print_exc()
            return 1
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            terminate.forget()
            shutil.rmtree(home, ignore_errors=True)  # its config file: read at start

    def free_port(self) -> int:
        """A port free on this node now (a rank group's rendezvous, on rank 0's node)."""
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return int(s.getsockname()[1])

    def drain(self, timeout: float) -> list[tuple[str, str]]:
        """The lines written since the last drain (waiting up to ``timeout`` for one)."""
        return self.lines.take(timeout)

    def order(self, text: str) -> bool:
        """Text for the hosted service's stdin (a warm spare's slot: one JSON line)."""
        self.inbox.put(text)
        return True

    def terminate(self) -> int:
        """A clean stop of the hosted service (its SIGTERM handler; a spare's end of input);
        how many heard it."""
        from ddiloco.runtime.processes import terminate

        return int(self.inbox.close()) + terminate.terminate()


def bound_address(name: str, namespace: str, timeout: float = 60.0) -> str:
    """The address the named service actor bound (learners find the syncer, or the fault
    proxy in front of it, by name)."""
    actor = ray.get_actor(name, namespace=namespace)
    address: str | None = ray.get(actor.bound.remote(timeout), timeout=timeout + 10.0)
    if address is None:
        raise RuntimeError(f"the actor {name!r} bound no address in {timeout:.0f} s")
    return str(address)


def signal_pid(pid: int, sig: int) -> bool:
    """Send ``sig`` to ``pid`` (as a task pinned to its node: :data:`send_signal`)."""
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        return False
    return True


def raylet_of(pid: int) -> int | None:
    """The nearest ancestor of ``pid`` named ``raylet`` (a worker's node manager), from
    /proc; None where there is none to be found (not Linux, not a Ray worker)."""
    while pid > 1:
        try:
            comm = Path(f"/proc/{pid}/comm").read_text(encoding="utf-8").strip()
            stat = Path(f"/proc/{pid}/stat").read_text(encoding="utf-8")
        except OSError:
            return None
        if comm == "raylet":
            return pid
        pid = int(stat.rsplit(")", 1)[1].split()[1])  # (field 4, after the command's parens)
    return None


def lose_this_node(after: float = 2.0) -> int | None:
    """A node loss (chaos ``node_loss``), as a task pinned to the node: SIGKILL its raylet
    ``after`` seconds from now, so this answer (the raylet's pid) gets out first. The node's
    workers and ``ray start`` go with their raylet, and Ray's GCS declares the node dead.
    None, killing nothing, when the raylet is not found."""
    raylet = raylet_of(os.getpid())
    if raylet is not None:
        threading.Timer(after, os.kill, (raylet, signal.SIGKILL)).start()
    return raylet


# the actor and the tasks (restarted forever: a learner's death costs only that learner)
ServiceActor: Any = ray.remote(max_restarts=-1, max_task_retries=0, max_concurrency=4)(ServiceHost)
send_signal: Any = ray.remote(num_cpus=0, max_retries=0)(signal_pid)
lose_node: Any = ray.remote(num_cpus=0, max_retries=0)(lose_this_node)


SIGNALS = {signal.SIGSTOP, signal.SIGCONT}  # sent as signals; KILL and TERM go through Ray
