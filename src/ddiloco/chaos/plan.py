"""Chaos plans: explicit fault events, seeded generators, and their expansion.

A plan is a list of :class:`ChaosEvent`. Generators (failures from a per-chip MTBI, compute
scavenging) expand into explicit events with the random generator handed in, so the expanded
plan is data: it is written to the run directory and a later run replays it exactly
(``chaos_plan = "run/chaos_plan.json"``). Both clocks read the same plans.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ddiloco.errors import ConfigError, require

CHAOS_KINDS = (
    "crash",
    "node_loss",
    "freeze",
    "slow",
    "link_slow",
    "link_cut",
    "join",
    "leave",
    "preempt",
)
LINK_KINDS = ("link_slow", "link_cut")  # played on a learner's link, not its process
SECONDS_PER_HOUR = 3600.0


@dataclass(frozen=True)
class ChaosEvent:
    """One scheduled fault for ``learner`` at virtual time ``at``.

    crash: dies, restarts after ``duration`` and copies a peer; node_loss: the machine under
    it is lost with everything on it (on Ray its node goes, and Ray places the learner again
    where there is room; on the simulated clock and on one host it is a crash); freeze:
    stopped for ``duration``; slow: steps ``factor`` x longer; link_slow: bandwidth / ``factor``;
    link_cut: its links carry nothing for ``duration``; join: a scavenged slot arrives;
    leave: goes away cleanly; preempt: reclaimed with notice (a spot machine): leaves
    cleanly, so no one waits to detect it, and is back after ``duration``, copying a peer.
    A ``duration`` of 0 on slow/link_slow lasts to the end.
    """

    at: float
    kind: str
    learner: int
    duration: float = 0.0
    factor: float = 1.0

    def __post_init__(self) -> None:
        require(self.kind in CHAOS_KINDS, "chaos.kind", self.kind, f"known: {CHAOS_KINDS}")
        require(self.at >= 0, "chaos.at", self.at, "must be >= 0")
        require(self.learner >= 0, "chaos.learner", self.learner, "must be >= 0")
        require(self.duration >= 0, "chaos.duration", self.duration, "must be >= 0")
        require(self.factor > 0, "chaos.factor", self.factor, "must be > 0")


def chaos_record(event: ChaosEvent, t: float) -> dict[str, Any]:
    """The ``chaos`` metrics record of ``event`` struck at time ``t`` (every runtime's)."""
    return {
        "kind": "chaos",
        "t": t,
        "event": event.kind,
        "learner": event.learner,
        "duration": event.duration,
        "factor": event.factor,
    }


@dataclass(frozen=True)
class ChaosGenerators:
    """Seeded fault processes, expanded into events before a run.

    Failures: each learner stands for ``chips_per_learner`` chips, each failing on average
    once every ``mtbi_hours`` (so a learner crashes at rate chips / MTBI); a crash lasts a
    log-normal recovery time (median ``recovery_seconds``, log-sigma ``recovery_sigma``).
    ``time_scale`` maps cluster seconds to the run's virtual seconds (a demo step of 1 s may
    stand for a real step of, say, 10 s). Scavenging: each scavenged slot joins at
    ``scavenge_join_at`` + i x ``scavenge_stagger`` and leaves ``scavenge_stay`` later (0:
    stays to the end).
    """

    mtbi_hours: float = 0.0  # 0: no generated failures
    chips_per_learner: int = 1
    recovery_seconds: float = 30.0
    recovery_sigma: float = 0.5
    time_scale: float = 1.0
    horizon_seconds: float = 0.0  # 0: estimated from the token budget
    scavenge_join_at: float = 0.0
    scavenge_stagger: float = 0.0
    scavenge_stay: float = 0.0

    def __post_init__(self) -> None:
        for name in (
            "mtbi_hours",
            "recovery_seconds",
            "recovery_sigma",
            "horizon_seconds",
            "scavenge_join_at",
            "scavenge_stagger",
            "scavenge_stay",
        ):
            value = getattr(self, name)
            require(value >= 0, f"chaos_gen.{name}", value, "must be >= 0")
        require(
            self.chips_per_learner >= 1,
            "chaos_gen.chips_per_learner",
            self.chips_per_learner,
            "must be >= 1",
        )
        require(self.time_scale > 0, "chaos_gen.time_scale", self.time_scale, "must be > 0")

    def crash_rate(self) -> float:
        """Crashes per virtual second per learner."""
        if self.mtbi_hours == 0:
            return 0.0
        return self.chips_per_learner / (self.mtbi_hours * SECONDS_PER_HOUR) * self.time_scale


def expand(
    explicit: Sequence[ChaosEvent],
    gen: ChaosGenerators,
    learners: int,
    scavenged: int,
    horizon: float,
    rng: random.Random,
) -> tuple[ChaosEvent, ...]:
    """Explicit events plus generated ones, sorted by (time, learner, kind)."""
    events = list(explicit)
    rate = gen.crash_rate()
    if rate > 0:
        mu = math.log(gen.recovery_seconds) if gen.recovery_seconds > 0 else 0.0
        for m in range(learners):
            t = rng.expovariate(rate)
            while t < horizon:
                down = rng.lognormvariate(mu, gen.recovery_sigma) if gen.recovery_seconds else 0
                events.append(ChaosEvent(round(t, 6), "crash", m, round(down, 6)))
                t += down + rng.expovariate(rate)  # the next failure after it is back
    for i in range(scavenged):
        slot = learners + i
        join = gen.scavenge_join_at + i * gen.scavenge_stagger
        events.append(ChaosEvent(join, "join", slot))
        if gen.scavenge_stay > 0:
            events.append(ChaosEvent(join + gen.scavenge_stay, "leave", slot))
    return tuple(sorted(events, key=lambda e: (e.at, e.learner, e.kind)))


def to_json(events: Sequence[ChaosEvent]) -> list[dict[str, Any]]:
    return [dataclasses.asdict(e) for e in events]


def load_plan(path: str | Path) -> tuple[ChaosEvent, ...]:
    """Read an expanded plan (a chaos_plan.json) for exact replay."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError("chaos_plan", str(path), "no such file") from None
    except json.JSONDecodeError as exc:
        raise ConfigError("chaos_plan", str(path), f"invalid JSON: {exc}") from None
    if not isinstance(data, list):
        raise ConfigError("chaos_plan", str(path), "expected a JSON list of events")
    out = []
    for i, item in enumerate(data):
        if not isinstance(item, dict):
            raise ConfigError(f"chaos_plan[{i}]", item, "expected an object")
        try:
            out.append(ChaosEvent(**item))
        except TypeError as exc:
            raise ConfigError(f"chaos_plan[{i}]", item, str(exc)) from None
    return tuple(out)
