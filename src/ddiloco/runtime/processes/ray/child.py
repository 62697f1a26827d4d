"""One life of a service actor, as the supervisor sees a child process.

The supervisor judges children by ``poll()`` (None while running, else an exit code),
``wait()`` and ``pid``, as :class:`subprocess.Popen` has them; :class:`ActorChild` gives
the same for one ``run`` call on a :class:`~.actor.ServiceActor`. A life starts once its
actor is placed: the reader (:func:`relay`) first waits for the actor to answer (Ray may be
restarting it after a death, or waiting for a node with room), then submits the ``run``
call, then drains the actor's lines into the supervisor's event queue and log file, as a
reader thread does a pipe. A life that ends with the actor's death (killed by chaos, its
node lost, out of memory) exits with :data:`DIED`, as a SIGKILLed process does.
"""

from __future__ import annotations

import contextlib
import json
import queue
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import ray
from ray.exceptions import ActorDiedError, GetTimeoutError, RayActorError, RayError

from ddiloco.runtime.processes.ray.actor import ERR, OUT
from ddiloco.runtime.processes.transport.events import EVENT_PREFIX

DIED = -int(signal.SIGKILL)  # the exit code of a life that ended with its actor's death
DRAIN_SECONDS = 0.2  # how long one drain call waits for a line
RETRY_SECONDS = 0.2  # between two asks of an actor Ray is restarting
ORDER_SECONDS = 10.0  # for the actor to take a spare's order


class ActorStdin:
    """A life's stdin, as a pipe's writing end: what is written reaches the hosted service's
    stdin (:meth:`~.actor.ServiceHost.order`) when it is flushed or closed (a spare's one
    order, the fault proxy's link commands). Raises :class:`OSError` if the actor cannot
    take it (dead), as a pipe whose reader died."""

    def __init__(self, actor: Any) -> None:
        self.actor = actor
        self._text: list[str] = []

    def write(self, text: str) -> int:
        self._text.append(text)
        return len(text)

    def flush(self) -> None:
        text, self._text = "".join(self._text), []
        if not text:
            return
        try:
            ray.get(self.actor.order.remote(text), timeout=ORDER_SECONDS)
        except RayError as exc:
            raise OSError(f"the actor took no input: {type(exc).__name__}") from exc

    def close(self) -> None:
        self.flush()


class ActorChild:
    """A ``run`` call on a service actor, as a child process (see the module).

    ``submit`` makes the call; ``avoid_pid``: the worker of the life killed before this
    one, which may still answer for a moment (this life starts on the process Ray put in
    its place); ``stdin``: the life reads its stdin (a warm spare: :class:`ActorStdin`)."""

    def __init__(
        self,
        name: str,
        actor: Any,
        submit: Callable[[], Any],
        avoid_pid: int = -1,
        stdin: bool = False,
    ) -> None:
        self.name = name
        self.actor = actor
        self.stdin = ActorStdin(actor) if stdin else None
        self.submit = submit
        self.avoid_pid = avoid_pid
        self.ref: Any = None  # the run call, once placed
        self.returncode: int | None = None
        self.where: dict[str, Any] | None = None  # pid, node, ip, once placed
        self.error = ""  # why the life ended, when Ray says
        self.gone = False  # its actor is dead for good (Ray will not restart it)
        self._done = threading.Event()

    @property
    def pid(self) -> int:
        return int(self.where["pid"]) if self.where else -1

    def poll(self) -> int | None:
        if self.returncode is None and self.ref is not None:
            ready, _ = ray.wait([self.ref], timeout=0)
            if ready:
                self.returncode = self._code()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int | None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None and (deadline is None or time.monotonic() < deadline):
            if self.ref is not None:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                ray.wait([self.ref], timeout=left)
            else:
                self._done.wait(RETRY_SECONDS)
        return self.returncode

    def end(self, code: int, why: str) -> None:
        """The life is over before its call ran (its actor is gone for good)."""
        if self.returncode is None:
            self.returncode, self.error = code, why
        self._done.set()

    def _code(self) -> int:
        try:
            return int(ray.get(self.ref))
        except RayActorError as exc:  # the actor died with this life
            self.error = f"its actor died: {type(exc).__name__}"
            return DIED
        except RayError as exc:
            self.error = f"{type(exc).__name__}: {exc}"
            return 1

    def place(self, place_seconds: float, quiet_wait: bool) -> bool:
        """Wait until the actor answers from a new worker (:meth:`locate`), then start the
        life; False if the actor is gone for good."""
        if not self.locate(place_seconds, quiet_wait):
            return False
        self.ref = self.submit()
        return True

    def locate(self, place_seconds: float, quiet_wait: bool) -> bool:
        """Wait until the actor answers from a new worker (``where``); False if the actor is
        gone for good. Reported on stderr each ``place_seconds`` it waits (once for a
        scavenged slot, ``quiet_wait``: it waits for capacity by design)."""
        waited = 0.0
        while self.returncode is None:
            try:
                where = ray.get(self.actor.where.remote(), timeout=place_seconds)
            except GetTimeoutError:
                waited += place_seconds
                if not quiet_wait or waited == place_seconds:
                    print(
                        f"ddiloco: {self.name} is not placed after {waited:.0f} s: no node "
                        "of the cluster has the resources it asks for (`ray status`)",
                        file=sys.stderr,
                        flush=True,
                    )
                continue
            except ActorDiedError as exc:
                self.gone = True
                self.end(DIED, f"its actor is gone: {type(exc).__name__}")
                return False
            except RayActorError:  # restarting: ask the new worker
                time.sleep(RETRY_SECONDS)
                continue
            if where["pid"] == self.avoid_pid:  # the killed worker, still answering
                time.sleep(RETRY_SECONDS)
                continue
            self.where = where
            return True
        return False

    def lives(self) -> list[ActorChild]:
        """The actor lives this child is (one; a learner's ranks are several)."""
        return [self]

    def drain(self) -> list[tuple[str, str]] | None:
        """The lines the life wrote since the last drain; None if its actor did not answer
        (dead, its undrained lines with it, or frozen)."""
        if self.returncode == DIED:  # (a restarting actor would answer seconds later)
            return None
        try:
            lines: list[tuple[str, str]] = ray.get(
                self.actor.drain.remote(DRAIN_SECONDS), timeout=10.0
            )
        except (RayActorError, GetTimeoutError):
            return None
        return lines


class Life(Protocol):
    """What :func:`relay` reads: an :class:`ActorChild`, or a learner's ranks
    (:class:`~.ranks.RankLives`)."""

    name: str
    error: str

    @property
    def where(self) -> dict[str, Any] | None: ...
    def place(self, place_seconds: float, quiet_wait: bool) -> bool: ...
    def poll(self) -> int | None: ...
    def drain(self) -> list[tuple[str, str]] | None: ...


def relay(
    child: Life,
    events: queue.SimpleQueue[tuple[str, dict[str, Any]]],
    log: Path,
    place_seconds: float,
    quiet_wait: bool,
    retire: Callable[[Any], None],
) -> None:
    """The reader of one life (run it on a thread): place it (a ``started`` event), then move
    its lines into ``events`` (``@event`` lines) and ``log`` (its stderr) until the life
    ended (then once more: its last lines); then ``retire(child)`` (its actors' processes)."""
    with log.open("a", encoding="utf-8") as out:
        if child.place(place_seconds, quiet_wait):
            where = child.where or {}
            events.put((child.name, {"kind": "started", "process": child.name, **where}))
            while True:
                ended = child.poll() is not None
                lines = child.drain() or []  # (None: dead, or frozen: ask again)
                for stream, line in lines:
                    if stream == OUT and line.startswith(EVENT_PREFIX):
                        with contextlib.suppress(json.JSONDecodeError):
                            events.put((child.name, json.loads(line[len(EVENT_PREFIX) :])))
                    elif stream == ERR:
                        out.write(line + "\n")
                out.flush()
                if ended:  # its last lines are in: what its threads write after is noise
                    break
        if child.error:
            out.write(f"ddiloco: {child.name}: {child.error}\n")
    retire(child)
