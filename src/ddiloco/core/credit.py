"""How many steps (and tokens) the syncer credits each learner's progress reports.

A progress report claims a step and the tokens trained since the last one; the syncer's
ledger, its token budget and (through the ledger) the merge weights count what it credits.
:func:`~ddiloco.core.robust.credit_progress` bounds one report (tokens <= steps x the
config's tokens per step); :class:`StepBudget` bounds how fast steps may be credited over
time: a token bucket per learner, filled at ``factor`` x the median step rate of the learners
the syncer has heard enough from (so one liar among three or more cannot raise it), holding
at most ``horizon`` seconds of steps (a learner that was cut off may report its backlog at
once). Until some learner has ``min_reports`` reports the bucket fills at
``bootstrap_rate``. Pure: the caller passes ``now``; no clock, no I/O.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

from ddiloco.core.robust import credit_progress
from ddiloco.errors import require


@dataclass
class _Learner:
    step: int | None  # the step credited so far (None: not known before its first report)
    at: float  # when its last report was credited
    allowance: float  # steps it may still be credited
    rate: float = 0.0  # steps per second, smoothed
    reports: int = 0
    ceiling: int | None = None  # the highest step its first report may be counted from


@dataclass
class StepBudget:
    factor: float = 4.0
    horizon: float = 60.0  # seconds of steps a bucket holds
    bootstrap_rate: float = 1000.0  # steps/s before the fleet's rate is known
    min_reports: int = 5
    smoothing: float = 0.1
    learners: dict[int, _Learner] = field(default_factory=dict)

    def __post_init__(self) -> None:
        require(self.factor >= 1.0, "factor", self.factor, "must be >= 1")
        require(self.horizon > 0 and self.bootstrap_rate > 0, "horizon", self.horizon, "> 0")

    def join(self, learner: int, step: int | None, now: float, ceiling: int | None = None) -> None:
        """A learner's life starts being counted at ``step``; None: at its first report,
        which then credits the steps its tokens fill (a new life reports what it trained
        before the syncer welcomed it in one report, up to a step the syncer never saw),
        counted from at most ``ceiling`` (the step its hello was counted from)."""
        self.learners[learner] = _Learner(step, now, self.cap() * 1.0, ceiling=ceiling)

    def hello_again(self, learner: int, ceiling: int) -> None:
        """A later hello of the same life before its first report was credited (a newcomer
        said hello at step 0, then adopted a peer's or the run's global step): its first
        report may be counted from ``ceiling`` now. Else the jump from 0 to that step would
        be credited against its allowance, and the reports behind it, with less than one
        step of allowance left, would credit none of the tokens they trained."""
        state = self.learners.get(learner)
        if state is not None and state.step is None:
            state.ceiling = ceiling if state.ceiling is None else max(state.ceiling, ceiling)

    def cap(self) -> float:
        """Steps per second any one learner may be credited at."""
        rates = [s.rate for s in self.learners.values() if s.reports >= self.min_reports]
        return self.factor * statistics.median(rates) if rates else self.bootstrap_rate

    def credit(
        self, learner: int, step: object, tokens: object, tokens_per_step: int, now: float
    ) -> tuple[int, int]:
        """(steps, tokens) to credit for a report claiming ``step`` and ``tokens``; the learner's
        credited step advances by ``steps`` (not to the claim). Unknown learner: nothing."""
        state = self.learners.get(learner)
        if state is None:
            return 0, 0
        cap = self.cap()
        elapsed = max(0.0, now - state.at)
        state.allowance = min(cap * self.horizon, state.allowance + elapsed * cap)
        last = state.step
        if last is None:  # the first report: its tokens say how many steps it covers
            whole = isinstance(step, int) and not isinstance(step, bool) and step >= 0
            if not (whole and isinstance(tokens, int) and tokens >= 0 and tokens_per_step > 0):
                return 0, 0
            last = max(0, step - max(1, -(-tokens // tokens_per_step)))  # type: ignore[operator]
            if state.ceiling is not None:
                last = min(last, state.ceiling)
            state.step = last
        claim: Any = (step, tokens)  # checked by credit_progress, which refuses non-ints
        steps, credited = credit_progress(
            last, claim[0], claim[1], tokens_per_step, state.allowance
        )
        if steps:
            state.allowance -= steps
            inst = steps / max(elapsed, 1e-3)
            state.rate = (
                inst if not state.reports else state.rate + self.smoothing * (inst - state.rate)
            )
            state.reports += 1
            state.step = last + steps
            state.at = now
        return steps, credited

    def step_of(self, learner: int) -> int | None:
        state = self.learners.get(learner)
        return None if state is None else state.step
