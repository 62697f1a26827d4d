"""A learner of several ranks on Ray (``processes.ranks`` > 1): one placement group of rank
actors running ``torch.distributed`` inside, as torchrun runs them on one host.

The slot keeps one placement group (``STRICT_PACK``: its ranks on one node, as torchrun's
``--standalone``; Ray places the whole group again elsewhere when that node is lost) with a
bundle per rank, and a :class:`~.actor.ServiceActor` per bundle. A life of the slot is
:class:`RankLives`: every rank's actor answers first, then rank 0's actor picks a free
port on its node for the group's rendezvous, then each rank runs the same ``ddiloco
learner`` command with torchrun's variables (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``MASTER_ADDR``/``MASTER_PORT``). Only rank 0 talks to the syncer and writes events
(learner/ranks.py); every rank's log goes to the slot's. Torchrun's rule holds: the life
ends when its first rank fails, with that rank's exit code, and the other ranks are killed
(Ray restarts their actors: the slot's next life starts on fresh processes); it ends
cleanly once every rank has.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import ray
from ray.exceptions import RayError

from ddiloco.runtime.processes.ray.child import DIED, ActorChild

RENDEZVOUS_SECONDS = 30.0  # for rank 0's actor to name a port


class RankLives:
    """One life of a learner of several ranks, as one child (see the module): ``submit(r,
    env)`` starts rank ``r``'s run with torchrun's variables; ``ranks[0]`` speaks for it."""

    def __init__(
        self,
        name: str,
        actors: list[Any],
        submit: Callable[[int, dict[str, str]], Any],
        avoid_pids: list[int],
    ) -> None:
        self.name = name
        self.submit = submit
        self.ranks = [
            ActorChild(f"{name}.rank{r}", actor, lambda: None, avoid_pid=avoid_pids[r])
            for r, actor in enumerate(actors)
        ]
        self.returncode: int | None = None
        self.error = ""
        self.stdin = None

    @property
    def actor(self) -> Any:
        return self.ranks[0].actor

    @property
    def where(self) -> dict[str, Any] | None:
        where = self.ranks[0].where
        return None if where is None else {**where, "ranks": len(self.ranks)}

    @property
    def pid(self) -> int:
        return self.ranks[0].pid

    @property
    def pids(self) -> list[int]:
        return [rank.pid for rank in self.ranks]

    def place(self, place_seconds: float, quiet_wait: bool) -> bool:
        """Wait for every rank's actor, name the rendezvous, start every rank; False if
        the life ended first."""
        for rank in self.ranks:
            if not rank.locate(place_seconds, quiet_wait):
                self.end(DIED, rank.error or f"{rank.name} is gone")
                return False
        try:
            port = int(ray.get(self.actor.free_port.remote(), timeout=RENDEZVOUS_SECONDS))
        except RayError as exc:
            self.end(DIED, f"no rendezvous port from rank 0: {type(exc).__name__}")
            return False
        world = str(len(self.ranks))
        for r, rank in enumerate(self.ranks):
            env = {
                "RANK": str(r),
                "LOCAL_RANK": str(r),
                "WORLD_SIZE": world,
                "LOCAL_WORLD_SIZE": world,
                "MASTER_ADDR": "127.0.0.1",  # one node (STRICT_PACK)
                "MASTER_PORT": str(port),
            }
            rank.ref = self.submit(r, env)
        return True

    def poll(self) -> int | None:
        if self.returncode is not None:
            return self.returncode
        codes = [rank.poll() for rank in self.ranks]
        for rank, code in zip(self.ranks, codes, strict=True):
            if code:  # torchrun's rule: the first rank to fail ends the life
                self.error = f"{rank.name} ended ({code}){': ' + rank.error if rank.error else ''}"
                self.returncode = code
                self.kill(restart=True)
                return code
        if all(code == 0 for code in codes):  # a clean end: every rank's
            self.returncode = 0
        return self.returncode

    def wait(self, timeout: float | None = None) -> int | None:
        for rank in self.ranks:
            rank.wait(timeout)
            if self.poll() is not None:
                break
        return self.returncode

    def kill(self, restart: bool) -> None:
        """Kill every rank's actor (Ray restarts them when ``restart``)."""
        for rank in self.ranks:
            if rank.poll() is None:
                ray.kill(rank.actor, no_restart=not restart)
                rank.end(DIED, "killed with its learner")

    def end(self, code: int, why: str) -> None:
        if self.returncode is None:
            self.returncode, self.error = code, why
        for rank in self.ranks:
            rank.end(code, why)

    def drain(self) -> list[tuple[str, str]] | None:
        """Rank 0's lines, and the other ranks' log lines tagged with their rank; None if
        rank 0 did not answer."""
        lines = self.ranks[0].drain()
        for r, rank in enumerate(self.ranks[1:], start=1):
            more = rank.drain() or []
            lines = (lines or []) + [(s, f"[rank {r}] {line}") for s, line in more if s != "out"]
        return lines

    def lives(self) -> list[ActorChild]:
        return list(self.ranks)


def rank_group(ranks: int, bundle: dict[str, float]) -> Any:
    """A slot's placement group: a bundle per rank, all on one node."""
    from ray.util.placement_group import placement_group

    return placement_group([dict(bundle) for _ in range(ranks)], strategy="STRICT_PACK")
