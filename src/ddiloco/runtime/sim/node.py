"""One simulated learner slot and its named states.

A slot is in exactly one :class:`NodeState`; ``frozen`` (SIGSTOP) is orthogonal: it suspends
whatever the slot was doing, and thawing resumes it. The transitions, and who makes them:

- ABSENT -> COPYING: a scavenged slot joins (chaos ``join``);
- STEPPING <-> WAITING: a lock-step learner waits for a merged fragment, and is woken when it
  arrives (the engine);
- STEPPING / WAITING -> DOWN: a crash; -> ABSENT: a clean leave (the faults);
- DOWN -> COPYING: the restart begins copying a peer (or the syncer's fragments);
- COPYING -> COPYING: the peer being copied died, start over (a new ``attempt``);
- COPYING -> STEPPING: the copy arrived (the faults' ``recovered``).

``incarnation`` counts process lives: an event scheduled for an earlier incarnation is ignored.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

import torch

from ddiloco.core.boundary import StepBoundary
from ddiloco.core.learner_state import LearnerSync
from ddiloco.trainer import Trainer


class NodeState(Enum):
    ABSENT = "absent"  # not allocated: a scavenged slot not yet joined, or one that left
    DOWN = "down"  # crashed: waiting to restart
    COPYING = "copying"  # restarted: copying a peer's state (or the syncer's fragments)
    STEPPING = "stepping"  # training
    WAITING = "waiting"  # lock-step: waiting for a merged fragment before its next step


UP = (NodeState.STEPPING, NodeState.WAITING)


@dataclass
class Node:
    """One learner slot: its trainer, its sync state and step boundary, and its state."""

    id: int
    trainer: Trainer
    boundary: StepBoundary
    state: NodeState = NodeState.STEPPING
    frozen: bool = False  # SIGSTOP: nothing runs, state kept
    step_pending: bool = False  # a step ended while frozen
    incarnation: int = 0
    asks: dict[int, int] = field(default_factory=dict)  # fragment -> round id
    inbox: dict[int, tuple[int, list[torch.Tensor]]] = field(default_factory=dict)
    waiting_since: float | None = None  # WAITING: since when
    next_step: float = 1.0  # duration of the step in progress (sampled when it starts)
    down_since: float | None = None  # DOWN or COPYING (or a joining slot): since when
    down_seconds: float = 0.0
    copying_from: int | None = None  # COPYING: the peer whose state is being copied
    attempt: int = 0  # recovery attempts, so an aborted copy's arrival is ignored

    @property
    def sync(self) -> LearnerSync:
        return self.boundary.sync

    @property
    def up(self) -> bool:
        return self.state in UP

    @property
    def running(self) -> bool:
        """Up and not frozen: it can be copied from, and it steps."""
        return self.up and not self.frozen
