"""The fault-injecting proxy between the learners and the syncer, as the launcher drives it.

A run gets a proxy when ``processes.proxy`` names wire faults or the chaos plan has link
faults (then one that plays only those). The learners dial the proxy's address, the proxy
dials the syncer. Link faults (``link_cut``, ``link_slow``) are JSON commands on the proxy's
stdin, a pipe from the launcher; a restarted proxy is sent again what is left of each one
once it is up (its ``proxy_up``: a restart can take seconds, on Ray an actor's), so a fault
outlives the proxy's own crash and ends when it would have; the proxy forwards nothing
until told ``open`` after them, so no frame of a cut learner slips through a restart. A
fault played while the proxy is starting is sent once it is up. Behind a proxy, payloads
must cross it: no shared memory (the launcher turns it off).
"""

from __future__ import annotations

import json
import math
import subprocess
import time
from collections.abc import Callable
from typing import Any

from ddiloco.chaos.plan import ChaosEvent
from ddiloco.config import RunConfig
from ddiloco.runtime.processes.transport.proxy import Faults

PROXY = "proxy"  # the proxy's process name (logs/proxy.log)
NO_PROXY = "no proxy: set processes.proxy, or put the link fault in the chaos plan"

Spawn = Callable[[list[str]], None]


def faults_of(config: RunConfig) -> Faults | None:
    """The proxy's wire faults: ``processes.proxy``'s, none for a plan with only link faults,
    or None when the run needs no proxy."""
    if not config.proxied:
        return None
    return Faults.parse(config.processes.proxy)  # ("" : no wire faults, only link faults)


class LinkFaults:
    """Starts the proxy, plays link faults through it, and replays them when it restarts.

    ``spawn(args)`` starts the proxy process with a control pipe, ``proc()`` returns its
    current life (or None); both are the supervisor's, so the proxy is supervised, restarted
    and shut down like every other child.
    """

    def __init__(
        self,
        config: RunConfig,
        listen: str,
        target: str,
        run_id: str,
        spawn: Spawn,
        proc: Callable[[], subprocess.Popen[str] | None],
    ) -> None:
        self.config = config
        self.listen = listen  # what the learners dial
        self.target = target  # the syncer
        self.run_id = run_id
        self.spawn = spawn
        self.proc = proc
        self.commands: list[tuple[float, dict[str, Any]]] = []  # (monotonic end, command)
        self.live = False  # the proxy's current life is up (said proxy_up): it hears commands
        self.counts: dict[str, int] = {}  # the proxy's last report

    def start(self) -> None:
        """Start (or restart) the proxy (:meth:`up` replays the link faults)."""
        cmd = [
            "-m",
            "ddiloco.runtime.processes.transport.proxy",
            *("--listen", self.listen, "--target", self.target, "--run-id", self.run_id),
            *("--faults", self.config.processes.proxy, "--seed", str(self.config.seed)),
            *("--control", "--gbps", repr(self.config.network.learner_syncer_gbps)),
        ]
        old = self.proc()
        if old is not None and old.poll() is not None and old.stdin is not None:
            old.stdin.close()
        self.live = False
        self.spawn(cmd)

    def up(self) -> None:
        """The proxy is up (its ``proxy_up``): send it what is left of every link fault, then
        open it (it forwards nothing before)."""
        self.live = True
        now = time.monotonic()
        for end, command in self.commands:
            if end > now:
                left = (
                    {"cut_seconds": end - now}
                    if "cut_seconds" in command
                    else {"seconds": 0.0 if math.isinf(end) else end - now}
                )
                self.send({**command, **left})
        self.send({"open": True})

    def send(self, command: dict[str, Any]) -> bool:
        """One JSON line on the proxy's control pipe; False if there is no proxy to hear it."""
        proc = self.proc()
        if proc is None or proc.poll() is not None or proc.stdin is None:
            return False
        try:
            proc.stdin.write(json.dumps(command) + "\n")
            proc.stdin.flush()
        except (OSError, ValueError):  # a broken or closed pipe: it died
            return False
        return True

    def play(self, event: ChaosEvent) -> None:
        """``link_cut`` / ``link_slow``: held or capped for ``duration`` (0: to the end)."""
        now, m = time.monotonic(), event.learner
        if event.kind == "link_cut":
            command: dict[str, Any] = {"link": m, "cut_seconds": event.duration}
            end = now + event.duration
        else:
            command = {"link": m, "factor": event.factor, "seconds": event.duration}
            end = now + event.duration if event.duration > 0 else math.inf
        self.commands.append((end, command))
        if self.live:  # else (starting, restarting) sent when it is up, what is left of it
            self.send(command)

    def close(self) -> None:
        """Close the control pipe (the proxy then reports its counts and exits)."""
        proc = self.proc()
        if proc is not None and proc.stdin is not None:
            proc.stdin.close()
