"""The simulated world's physics: how long a step takes and how long bytes take to move.

Randomness comes from the ``random.Random`` handed in, so a seed replays the same times.
"""

from __future__ import annotations

import random

from ddiloco.config import HardwareConfig, NetworkConfig
from ddiloco.core.links import Links


class StepTimes:
    """Step time of learner m: base x speed[m] x slowdown[m] x (1 + jitter * U[0, 1))."""

    def __init__(self, config: HardwareConfig, learners: int, rng: random.Random) -> None:
        self.config = config
        self.speed = list(config.speed) if config.speed else [1.0] * learners
        self.slowdown = [1.0] * learners
        self.rng = rng

    def sample(self, learner: int) -> float:
        c = self.config
        jitter = 1.0 + c.jitter * self.rng.random()
        return c.step_seconds * self.speed[learner] * self.slowdown[learner] * jitter


class Network(Links):
    """Links between each learner and the syncer (one per direction) and between learners,
    on the core's link model (:class:`~ddiloco.core.links.Links`), plus the latency."""

    def __init__(self, config: NetworkConfig) -> None:
        super().__init__()
        self.config = config

    def send(self, link: tuple[str, int], now: float, nbytes: int, gbps: float) -> float:
        """Queue ``nbytes`` on ``link`` at ``now``; return the arrival time."""
        return self.carry(link, self.start(link, now), nbytes, gbps) + self.config.latency_seconds

    def up(self, learner: int, now: float, nbytes: int) -> float:
        """Learner -> syncer."""
        return self.send(("up", learner), now, nbytes, self.config.learner_syncer_gbps)

    def down(self, learner: int, now: float, nbytes: int) -> float:
        """Syncer -> learner."""
        return self.send(("down", learner), now, nbytes, self.config.learner_syncer_gbps)

    def peer(self, learner: int, now: float, nbytes: int) -> float:
        """Peer -> (re)starting learner, for recovery."""
        return self.send(("peer", learner), now, nbytes, self.config.learner_learner_gbps)
