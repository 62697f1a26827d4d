"""The three system models, run on one failure trace: where each chip-second goes.

- ``dp``: non-elastic data-parallel. Any outage stops the job; it restarts from the last
  checkpoint after detection + replacement + restart, losing the work since that checkpoint.
- ``elastic``: elastic data-parallel. An outage pauses the whole job to downscale; repaired
  domains come back in batched upscale pauses.
- ``decoupled``: Decoupled DiLoCo with M learners and quorum K. Each learner is an elastic job
  of N/M chips (or restarts and copies a peer); an outage pauses only its learner.

A job's timeline is a chain of pauses: a pause starts at an outage (or an upscale) while the
job runs, and every outage that starts while it lasts joins it. The chain is the only loop
(one step per pause, ``bisect`` over plain lists); everything else is numpy over all outages.
Results are fractions of allocated chip-time: goodput + the badput causes = 1.
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from dataclasses import dataclass, field
from statistics import NormalDist

import numpy as np

from ddiloco.cluster.failures import FailureTrace, learner_bounds
from ddiloco.cluster.params import ClusterParams

FloatArray = np.ndarray


@dataclass(frozen=True)
class Outcome:
    """One system on one trace: fractions of allocated chip-time (and of wall time)."""

    goodput: float
    uptime: float  # fraction of wall time the system as a whole advances
    badput: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Pauses:
    """A job's pauses, sorted and disjoint, clipped to the horizon."""

    start: FloatArray
    end: FloatArray
    upscale: np.ndarray  # bool: an upscale pause (else started by an outage)

    def paused_before(self, x: FloatArray) -> FloatArray:
        """Total paused time in [0, x) for every x."""
        dur = self.end - self.start
        cum = np.concatenate([[0.0], np.cumsum(dur)])
        q = np.searchsorted(self.start, x, side="right") - 1
        qc = np.maximum(q, 0)
        inside = np.clip(np.minimum(x, self.end[qc]) - self.start[qc], 0.0, None) if dur.size else 0
        out: FloatArray = np.where(q >= 0, cum[qc] + inside, 0.0)
        return out

    def running_between(self, a: FloatArray, b: FloatArray) -> FloatArray:
        """Time not paused in [a, b) for every pair."""
        out: FloatArray = (b - a) - (self.paused_before(b) - self.paused_before(a))
        return out


def pause_chain(
    fail_time: list[float],
    fail_duration: list[float],
    repaired: list[float],
    upscale_duration: list[float],
    batch_s: float,
    rejoin_in_downscale: bool,
    horizon_s: float,
) -> Pauses:
    """Walk the pauses of one job.

    ``fail_time`` sorted, with the pause each outage would start; ``repaired`` sorted repair
    times (empty: nothing ever rejoins, e.g. a restart on spares); ``upscale_duration`` one per
    possible upscale. A repaired domain waits ``batch_s`` for others, then an upscale pause
    starts (not before the current pause ends) unless an outage starts a downscale first.
    """
    n, nr = len(fail_time), len(repaired)
    starts: list[float] = []
    ends: list[float] = []
    ups: list[bool] = []
    i = j = u = 0
    last = -math.inf  # start of the last reconfiguration that took repaired domains back
    end = 0.0
    while True:
        j = bisect_right(repaired, last, j)
        tu = max(repaired[j] + batch_s, end) if j < nr else math.inf
        tf = fail_time[i] if i < n else math.inf
        if tf <= tu:
            if tf >= horizon_s:
                break
            s, e = tf, tf + fail_duration[i]
            ups.append(False)
            if rejoin_in_downscale:
                last = s
            i += 1  # even a zero-length pause consumes the outage that started it
        else:
            if tu >= horizon_s:
                break
            s, e = tu, tu + upscale_duration[u]
            u += 1
            ups.append(True)
            last = s
        starts.append(s)
        ends.append(e)
        end = e
        i = bisect_left(fail_time, e, i)  # outages during the pause join it
    return Pauses(
        np.asarray(starts, dtype=float),
        np.minimum(np.asarray(ends, dtype=float), horizon_s),
        np.asarray(ups, dtype=bool),
    )


def straggler_efficiency(chips: int, cv: float) -> float:
    """Speed of a synchronous group of ``chips`` chips paced by its slowest, per step.

    Per-step chip times 1 + cv·Z (Z standard normal); the expected maximum of n normals is
    Blom's approximation Φ⁻¹((n − 0.375)/(n + 0.25)).
    """
    if cv == 0.0 or chips <= 1:
        return 1.0
    z = NormalDist().inv_cdf((chips - 0.375) / (chips + 0.25))
    return 1.0 / (1.0 + cv * z)


def _durations(
    rng: np.random.Generator, n: int, fixed: float, varied: float, sigma: float
) -> FloatArray:
    """``fixed`` + ``varied`` × a log-normal factor of median 1 (sigma 0: exactly)."""
    if sigma == 0.0:
        return np.full(n, fixed + varied)
    return fixed + varied * np.exp(sigma * rng.standard_normal(n))


def _with_stragglers(useful: float, badput: dict[str, float], eff: float) -> float:
    badput["stragglers"] = useful * (1.0 - eff)
    return useful * eff


def simulate_dp(trace: FailureTrace, p: ClusterParams, rng: np.random.Generator) -> Outcome:
    """Non-elastic data-parallel: stop, swap in spares, restart from the last checkpoint."""
    t, horizon = p.timing, trace.horizon_s
    rest = p.data_parallel.replace_s + p.data_parallel.restart_s
    dur = _durations(rng, len(trace), t.detect_s, rest, t.time_sigma)
    pauses = pause_chain(trace.time.tolist(), dur.tolist(), [], [], 0.0, False, horizon)
    return _restart_outcome(pauses, p, trace.chips, horizon, checkpointed=True)


def checkpoint_interval(p: ClusterParams, chips: int) -> float:
    """Training seconds between checkpoints: the configured one, or Young/Daly's optimum."""
    if p.data_parallel.checkpoint_interval_s > 0:
        return max(p.data_parallel.checkpoint_interval_s, p.timing.step_s)
    mtbf = p.mtbi_s / chips
    return max(math.sqrt(2.0 * p.data_parallel.checkpoint_cost_s * mtbf), p.timing.step_s)


def _restart_outcome(
    pauses: Pauses, p: ClusterParams, chips: int, horizon: float, checkpointed: bool
) -> Outcome:
    """Accounting of a job that stops at every outage and resumes at full size."""
    seg_start = np.concatenate([[0.0], pauses.end])
    seg_end = np.concatenate([pauses.start, [horizon]])
    x = np.maximum(seg_end - seg_start, 0.0)
    ended_by_failure = np.arange(x.size) < pauses.start.size
    down = pauses.end - pauses.start
    detection = np.minimum(down, p.timing.detect_s).sum()
    badput = {"detection": detection / horizon, "restart": (down.sum() - detection) / horizon}
    if checkpointed:
        c, cost = checkpoint_interval(p, chips), p.data_parallel.checkpoint_cost_s
        done = np.floor(x / (c + cost))
        lost = np.where(ended_by_failure, x - done * (c + cost), 0.0)
        badput["checkpoint"] = float((done * cost).sum()) / horizon
        badput["rollback"] = float(lost.sum()) / horizon
    else:  # a Decoupled learner restarting from a peer loses only the step in flight
        lost = np.where(ended_by_failure, np.minimum(x, p.timing.step_s / 2), 0.0)
        badput["lost_step"] = float(lost.sum()) / horizon
    useful = 1.0 - sum(badput.values())
    useful = _with_stragglers(useful, badput, straggler_efficiency(chips, p.timing.chip_step_cv))
    return Outcome(useful, float(x.sum()) / horizon, badput)


@dataclass(frozen=True)
class JobRun:
    """An elastic job's outcome plus its pauses (Decoupled needs them for the quorum)."""

    outcome: Outcome
    pauses: Pauses


def elastic_job(trace: FailureTrace, p: ClusterParams, rng: np.random.Generator) -> JobRun:
    """An elastic job over ``trace``: downscale at outages, batched upscales at repairs."""
    t, e, horizon = p.timing, p.elastic, trace.horizon_s
    n = len(trace)
    down = _durations(rng, n, t.detect_s, e.downscale_s, t.time_sigma)
    up = _durations(rng, n + 1, 0.0, e.upscale_s, t.time_sigma)
    rep_sorted = np.sort(trace.repaired)
    pauses = pause_chain(
        trace.time.tolist(),
        down.tolist(),
        rep_sorted.tolist(),
        up.tolist(),
        e.upscale_batch_s,
        e.rejoin_in_downscale,
        horizon,
    )
    # Each outage keeps its domain out from its start until the first eligible
    # reconfiguration that starts after its repair (or the end of the run).
    eligible = pauses.start if e.rejoin_in_downscale else pauses.start[pauses.upscale]
    k = np.searchsorted(eligible, trace.repaired, side="left")
    rejoin = np.where(k < eligible.size, eligible[np.minimum(k, eligible.size - 1)], horizon)
    out_running = pauses.running_between(trace.time, np.minimum(rejoin, horizon)).sum()

    dur = pauses.end - pauses.start
    is_up = pauses.upscale
    detection = np.minimum(dur[~is_up], t.detect_s).sum()
    started_by_outage = int((~is_up).sum())
    lost = rng.uniform(0.0, t.step_s, started_by_outage).sum()
    badput = {
        "detection": detection / horizon,
        "downscale": (dur[~is_up].sum() - detection) / horizon,
        "upscale": dur[is_up].sum() / horizon,
        "repair": out_running / trace.domains / horizon,
        "lost_step": lost / horizon,
    }
    useful = 1.0 - sum(badput.values())
    useful = _with_stragglers(
        useful, badput, straggler_efficiency(trace.chips, p.timing.chip_step_cv)
    )
    uptime = 1.0 - dur.sum() / horizon
    return JobRun(Outcome(useful, uptime, badput), pauses)


def simulate_elastic(trace: FailureTrace, p: ClusterParams, rng: np.random.Generator) -> Outcome:
    """Elastic data-parallel: the whole cluster is one elastic job."""
    return elastic_job(trace, p, rng).outcome


def _restart_learner(trace: FailureTrace, p: ClusterParams, rng: np.random.Generator) -> JobRun:
    """A Decoupled learner that restarts on spares and copies its state from a peer."""
    rest = p.data_parallel.replace_s + p.data_parallel.restart_s + p.decoupled.peer_copy_s
    dur = _durations(rng, len(trace), p.timing.detect_s, rest, p.timing.time_sigma)
    pauses = pause_chain(trace.time.tolist(), dur.tolist(), [], [], 0.0, False, trace.horizon_s)
    return JobRun(_restart_outcome(pauses, p, trace.chips, trace.horizon_s, False), pauses)


def simulate_decoupled(
    trace: FailureTrace, p: ClusterParams, learners: int, rng: np.random.Generator
) -> Outcome:
    """Decoupled DiLoCo with ``learners`` learners and quorum ``p.decoupled.quorum``."""
    d, horizon = p.decoupled, trace.horizon_s
    bounds = learner_bounds(trace.domains, learners)
    job = elastic_job if d.recovery == "reform" else _restart_learner
    runs = [job(trace.subset(a, b), p, rng) for a, b in bounds]
    weights = np.array([b - a for a, b in bounds], dtype=float) / trace.domains
    causes = sorted({c for r in runs for c in r.outcome.badput})
    pairs = list(zip(weights, runs, strict=True))
    badput = {c: float(sum(w * r.outcome.badput.get(c, 0.0) for w, r in pairs)) for c in causes}
    useful_m = np.array([r.outcome.goodput for r in runs])
    running_m = np.array([r.outcome.uptime for r in runs])

    # Persistent learner speeds: progress beyond the K-th fastest learner's pace is not counted.
    if d.learner_speed_cv > 0:
        speed = np.exp(d.learner_speed_cv * rng.standard_normal(learners))
        pace = np.sort(speed)[::-1][d.quorum - 1]
        factor = np.minimum(speed, pace) / speed
        badput["learner_speed"] = float((weights * useful_m * (1.0 - factor)).sum())
        useful_m = useful_m * factor

    # Quorum: compute while 0 < (learners up) < K is wasted; uptime is the time with >= K up.
    uptime, short = _quorum_time(runs, learners, d.quorum, horizon)
    rate = float((useful_m / np.maximum(running_m, 1e-12)).mean())
    badput["quorum"] = short * rate
    goodput = float((weights * useful_m).sum()) - badput["quorum"]
    return Outcome(goodput, uptime, badput)


def _quorum_time(runs: list[JobRun], m: int, k: int, horizon: float) -> tuple[float, float]:
    """(fraction of time with >= k learners up, learner-time fraction with 0 < up < k)."""
    starts = np.concatenate([r.pauses.start for r in runs])
    ends = np.concatenate([r.pauses.end for r in runs])
    times = np.concatenate([starts, ends, [horizon]])
    delta = np.concatenate([np.ones(starts.size), -np.ones(ends.size), [0.0]])
    order = np.argsort(times, kind="stable")
    times, down = times[order], np.cumsum(delta[order])
    edges = np.concatenate([[0.0], times])
    dur = np.diff(edges)
    up = m - np.concatenate([[0.0], down[:-1]])
    uptime = float(dur[up >= k].sum()) / horizon
    short = float((dur * up / m)[(up > 0) & (up < k)].sum()) / horizon
    return uptime, short
