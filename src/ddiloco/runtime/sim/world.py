"""The simulated world's physics: how long a step takes and how long bytes take to move.

Randomness comes from the ``random.Random`` handed in, so a seed replays the same times.
"""

from __future__ import annotations

import random

from ddiloco.config import HardwareConfig, NetworkConfig


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


class Network:
    """Links between each learner and the syncer (one per direction) and between learners.

    A link carries one transfer at a time: a transfer queued behind another starts when the
    link frees up, which is how a large fragment delays the next one on a slow link.
    """

    def __init__(self, config: NetworkConfig) -> None:
        self.config = config
        self._free_at: dict[tuple[str, int], float] = {}
        self._factor: dict[int, float] = {}  # learner -> bandwidth divisor (link_slow)
        self._cut_until: dict[int, float] = {}  # learner -> its links carry nothing until

    def seconds(self, nbytes: int, gbps: float) -> float:
        return nbytes * 8.0 / (gbps * 1e9)

    def send(self, link: tuple[str, int], now: float, nbytes: int, gbps: float) -> float:
        """Queue ``nbytes`` on ``link`` at ``now``; return the arrival time."""
        learner = link[1]
        start = max(now, self._free_at.get(link, 0.0), self._cut_until.get(learner, 0.0))
        done = start + self.seconds(nbytes, gbps) * self._factor.get(learner, 1.0)
        self._free_at[link] = done
        return done + self.config.latency_seconds

    def up(self, learner: int, now: float, nbytes: int) -> float:
        """Learner -> syncer."""
        return self.send(("up", learner), now, nbytes, self.config.learner_syncer_gbps)

    def down(self, learner: int, now: float, nbytes: int) -> float:
        """Syncer -> learner."""
        return self.send(("down", learner), now, nbytes, self.config.learner_syncer_gbps)

    def peer(self, learner: int, now: float, nbytes: int) -> float:
        """Peer -> (re)starting learner, for recovery."""
        return self.send(("peer", learner), now, nbytes, self.config.learner_learner_gbps)

    def slow(self, learner: int, factor: float) -> None:
        """Divide the learner's bandwidth by ``factor`` (1.0 restores it)."""
        self._factor[learner] = factor

    def factor_of(self, learner: int) -> float:
        return self._factor.get(learner, 1.0)

    def cut(self, learner: int, until: float) -> None:
        """The learner's links carry nothing until ``until``; transfers resume after."""
        self._cut_until[learner] = max(until, self._cut_until.get(learner, 0.0))

    def reset(self, learner: int, now: float) -> None:
        """A dead learner's queued transfers die with it."""
        for kind in ("up", "down", "peer"):
            self._free_at[(kind, learner)] = now
