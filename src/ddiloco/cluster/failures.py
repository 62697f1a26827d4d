"""Failure traces of a whole cluster, sampled in bulk with numpy.

A trace lists every domain outage over the horizon: when it starts, which failure domain
(host or slice), and when that domain is usable again. Each domain is a renewal process
(Weibull lifetimes, exponential by default; a repaired domain starts a fresh lifetime), drawn
generation by generation for all domains at once: there is never one Python object per chip,
domain or event. Every system is then simulated on the same trace (common random numbers), so
their differences are not sampling noise. Pure: the caller hands in the generator.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ddiloco.cluster.params import Failures

FloatArray = np.ndarray
IntArray = np.ndarray


@dataclass(frozen=True)
class FailureTrace:
    """Domain outages, sorted by start time (seconds from the start of the run)."""

    time: FloatArray  # outage start
    domain: IntArray  # which failure domain, 0 .. domains-1
    repaired: FloatArray  # when the domain is usable again
    domains: int
    chips: int
    horizon_s: float

    def __len__(self) -> int:
        return int(self.time.size)

    def subset(self, first: int, stop: int) -> FailureTrace:
        """The outages of domains ``first .. stop-1`` (one learner's share)."""
        keep = (self.domain >= first) & (self.domain < stop)
        chips = round(self.chips * (stop - first) / self.domains)
        return FailureTrace(
            self.time[keep],
            self.domain[keep] - first,
            self.repaired[keep],
            stop - first,
            chips,
            self.horizon_s,
        )


def domain_count(chips: int, domain_chips: int) -> int:
    """Failure domains of a cluster of ``chips`` (at least one)."""
    return max(1, round(chips / domain_chips))


def learner_bounds(domains: int, learners: int) -> list[tuple[int, int]]:
    """Contiguous, nearly equal domain ranges, one per learner."""
    edges = [domains * m // learners for m in range(learners + 1)]
    return [(edges[m], edges[m + 1]) for m in range(learners)]


def sample_trace(
    rng: np.random.Generator, chips: int, horizon_s: float, f: Failures
) -> FailureTrace:
    """All domain outages of a ``chips``-chip cluster over ``horizon_s`` seconds."""
    domains = domain_count(chips, f.domain_chips)
    # Each chip fails once per MTBI on average; a domain fails when any of its chips does.
    mean_life = f.mtbi_hours * 3600.0 * domains / chips
    k = f.weibull_shape
    scale = mean_life / math.gamma(1.0 + 1.0 / k)

    def lifetimes(n: int) -> FloatArray:
        return scale * rng.weibull(k, n) if k != 1.0 else rng.exponential(mean_life, n)

    def repairs(n: int) -> FloatArray:
        return f.repair_median_s * np.exp(f.repair_sigma * rng.standard_normal(n))

    ids = np.arange(domains)
    if k == 1.0 or f.initial_age_hours == 0.0:
        t = lifetimes(domains)
    else:  # residual life of a Weibull domain of age a: scale·((a/scale)^k + E)^(1/k) − a
        age = rng.uniform(0.0, f.initial_age_hours * 3600.0, domains)
        e = rng.exponential(1.0, domains)
        t = scale * ((age / scale) ** k + e) ** (1.0 / k) - age
    times, doms, reps = [], [], []
    while ids.size:
        keep = t < horizon_s
        t, ids = t[keep], ids[keep]
        r = t + repairs(t.size)
        times.append(t)
        doms.append(ids)
        reps.append(r)
        t = r + lifetimes(t.size)
    time = np.concatenate(times)
    domain = np.concatenate(doms)
    repaired = np.concatenate(reps)
    if f.correlated_probability > 0.0 and f.correlated_domains > 1:
        time, domain, repaired = _add_correlated(rng, time, domain, repaired, domains, f)
    order = np.argsort(time, kind="stable")
    return FailureTrace(time[order], domain[order], repaired[order], domains, chips, horizon_s)


def _add_correlated(
    rng: np.random.Generator,
    time: FloatArray,
    domain: IntArray,
    repaired: FloatArray,
    domains: int,
    f: Failures,
) -> tuple[FloatArray, IntArray, FloatArray]:
    """Some outages also take down the rest of their group of domains (same start time)."""
    g = f.correlated_domains
    hit = np.flatnonzero(rng.random(time.size) < f.correlated_probability)
    base = (domain[hit] // g) * g
    offsets = np.arange(g)
    others = base[:, None] + offsets[None, :]
    mask = (others != domain[hit][:, None]) & (others < domains)
    extra_domain = others[mask]
    extra_time = np.broadcast_to(time[hit][:, None], others.shape)[mask]
    extra_rep = extra_time + f.repair_median_s * np.exp(
        f.repair_sigma * rng.standard_normal(extra_time.size)
    )
    return (
        np.concatenate([time, extra_time]),
        np.concatenate([domain, extra_domain]),
        np.concatenate([repaired, extra_rep]),
    )
