"""Bandwidth planner: the WAN bandwidth each method needs for a target compute utilization.

Closed form (docs/bandwidth.md). Every method is a periodic transfer: every ``period`` seconds
of compute a node sends ``volume`` bits, of which ``hidden`` seconds of compute overlap the
transfer; the rest is exposed and stalls training. At utilization CU the job may spend
period·(1/CU − 1) exposed per period, so each transfer meets its deadline when

    B >= volume / (hidden + period·(1/CU − 1))        (the published model)

When transfers overlap (Streaming/Decoupled with τ > H/P, e.g. one fragment every step and
τ = 2) the link must also keep up on average: B >= volume·CU/period. The published figures
leave that term out; ``sustained=True`` adds it, and it is always reported. Pure: no torch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ddiloco.errors import require

METHODS = ("dp", "diloco", "streaming", "decoupled")
# The grid the published tables were reported on: 50 log-spaced values from 0.1 to 1000
# Gbit/s (ratio 10^(4/49) ≈ 1.207). 102.9 snaps up to 104.8 and 1.58 to 1.68
# (docs/design.md §8.2).
GRID_LOW, GRID_HIGH, GRID_POINTS = 0.1, 1000.0, 50
GRID_RATIO = (GRID_HIGH / GRID_LOW) ** (1.0 / (GRID_POINTS - 1))
REFERENCE_BITS = 16.0  # the published simulator's wire format (bf16)

# The paper's figures (Gbit/s): 5B parameters, bf16, 1 s step, 2 datacenters, 90% utilization.
PAPER_BANDWIDTH = {"dp": 104.0, "decoupled": 1.7, "decoupled_int4": 0.43}
# A peer copy (learner/peer.py) moves a learner's state: its fp32 parameters and AdamW's two
# moments, 12 bytes per parameter (measured: 12.01 on gpt-1m, with the snapshot's head and
# step counters); not its fragment bases, which the newcomer takes from the copied values.
SNAPSHOT_BYTES_PER_PARAM = 12.0
RECOVERY_LINKS = (10.0, 1.0, 0.05)  # Gbit/s: a datacenter, a site's uplink, a slow WAN link


@dataclass(frozen=True)
class BandwidthQuery:
    """A method and the job it runs.

    ``params`` model parameters; ``bits`` per value on the wire (bf16: 16; int4 with a 32-bit
    scale per 128 values: 4.25); ``step_time_s`` one learner step; ``utilization`` the target
    compute utilization; ``datacenters`` how many the job spans. DP all-reduces the gradient
    every step, hidden behind the backward pass (``backward_fraction`` of the step). DiLoCo
    all-reduces the model every ``inner_steps`` steps, blocking. Streaming and Decoupled send
    one of ``fragments`` fragments every ``inner_steps / fragments`` steps and have
    ``overlap`` (τ) steps to do it; Decoupled sends to a central syncer instead of a ring.
    ``inner_steps`` 0 means H = P for those two and H = 100 for DiLoCo.
    """

    @property
    def sync_every(self) -> int:
        if self.inner_steps:
            return self.inner_steps
        return 100 if self.method == "diloco" else self.fragments

    method: str
    params: float = 5e9
    bits: float = 16.0
    step_time_s: float = 1.0
    utilization: float = 0.9
    datacenters: int = 2
    fragments: int = 24
    overlap: float = 2.0
    inner_steps: int = 0  # 0: H = fragments (one fragment every step): docs/design.md §3.2
    backward_fraction: float = 2.0 / 3.0

    def __post_init__(self) -> None:
        require(self.method in METHODS, "method", self.method, f"known: {', '.join(METHODS)}")
        for name in ("params", "bits", "step_time_s"):
            value = getattr(self, name)
            require(value > 0 and math.isfinite(value), name, value, "must be > 0")
        require(0 < self.utilization < 1, "utilization", self.utilization, "must be in (0, 1)")
        require(
            self.datacenters >= 2,
            "datacenters",
            self.datacenters,
            "must be >= 2 (WAN traffic is between datacenters)",
        )
        require(self.fragments >= 1, "fragments", self.fragments, "must be >= 1")
        require(self.overlap >= 0, "overlap", self.overlap, "must be >= 0")
        require(self.inner_steps >= 0, "inner_steps", self.inner_steps, "must be >= 1 (0: P)")
        require(
            0 <= self.backward_fraction <= 1,
            "backward_fraction",
            self.backward_fraction,
            "must be in [0, 1]",
        )


@dataclass(frozen=True)
class Traffic:
    volume_bits: float  # bits one node sends per transfer
    period_s: float  # compute seconds between transfers
    hidden_s: float  # compute that overlaps one transfer


def ring_factor(n: int) -> float:
    """Bytes a node sends in a ring all-reduce, per byte of the vector: 2(n − 1)/n."""
    return 2.0 * (n - 1) / n


def traffic(q: BandwidthQuery) -> Traffic:
    model_bits = q.params * q.bits
    t, n = q.step_time_s, q.datacenters
    if q.method == "dp":
        return Traffic(model_bits * ring_factor(n), t, q.backward_fraction * t)
    if q.method == "diloco":
        return Traffic(model_bits * ring_factor(n), q.sync_every * t, 0.0)
    fragment = model_bits / q.fragments
    period = q.sync_every * t / q.fragments
    if q.method == "streaming":
        return Traffic(fragment * ring_factor(n), period, q.overlap * t)
    # decoupled: one learner per datacenter; the syncer's datacenter exchanges a fragment
    # with each of the n − 1 others (full duplex: the same volume each way)
    return Traffic(fragment * (n - 1), period, q.overlap * t)


def required_gbps(q: BandwidthQuery, sustained: bool = False) -> dict[str, float]:
    """Bandwidth (Gbit/s) for the target utilization, and its two constraints."""
    tr = traffic(q)
    exposed = tr.period_s * (1.0 / q.utilization - 1.0)
    deadline = tr.volume_bits / (tr.hidden_s + exposed) / 1e9
    average = tr.volume_bits * q.utilization / tr.period_s / 1e9
    need = max(deadline, average) if sustained else deadline
    return {"gbit_per_s": need, "deadline": deadline, "sustained": average}


def utilization_at(q: BandwidthQuery, gbit_per_s: float, sustained: bool = False) -> float:
    """Compute utilization a link of ``gbit_per_s`` yields (the inverse of the above)."""
    require(gbit_per_s > 0, "bandwidth", gbit_per_s, "must be > 0")
    tr = traffic(q)
    transfer = tr.volume_bits / (gbit_per_s * 1e9)
    deadline = tr.period_s / (tr.period_s + max(0.0, transfer - tr.hidden_s))
    average = gbit_per_s * 1e9 * tr.period_s / tr.volume_bits
    return min(1.0, deadline, average) if sustained else deadline


def snap_up(gbit_per_s: float) -> float:
    """The smallest grid value >= ``gbit_per_s`` (what a sweep over the grid reports)."""
    k = math.ceil(math.log(gbit_per_s / GRID_LOW) / math.log(GRID_RATIO) - 1e-9)
    return float(GRID_LOW * GRID_RATIO**k)


def grid_gbps(q: BandwidthQuery, sustained: bool = False) -> float:
    """The figure as the published tables print it.

    Their simulator swept bf16 runs over the grid, so the 16-bit requirement snaps up to the
    grid; other wire formats scale that figure by bits/16, as the published int4 figure
    scales the bf16 one.
    """
    reference = BandwidthQuery(**{**q.__dict__, "bits": REFERENCE_BITS})
    return snap_up(required_gbps(reference, sustained)["gbit_per_s"]) * q.bits / REFERENCE_BITS


def plan(
    q: BandwidthQuery,
    grid: bool = False,
    bandwidth: float | None = None,
    sustained: bool = False,
) -> dict[str, Any]:
    """Everything the command prints, as plain data."""
    need = required_gbps(q, sustained)
    tr = traffic(q)
    dp_query = BandwidthQuery(**{**q.__dict__, "method": "dp"})
    dp = required_gbps(dp_query, sustained)["gbit_per_s"]
    out: dict[str, Any] = {
        "method": q.method,
        "gbit_per_s": grid_gbps(q, sustained) if grid else need["gbit_per_s"],
        "raw_gbit_per_s": need["gbit_per_s"],
        "deadline_gbit_per_s": need["deadline"],
        "sustained_gbit_per_s": need["sustained"],
        "transfers_overlap": need["sustained"] > need["deadline"],
        "sustained_included": sustained,
        "grid": grid,
        "sync_every_steps": q.sync_every,
        "gbit_per_transfer": tr.volume_bits / 1e9,
        "transfer_period_s": tr.period_s,
        "hidden_s": tr.hidden_s,
        "times_less_than_dp": dp / need["gbit_per_s"],
        "query": dict(q.__dict__),
    }
    if grid:
        out["grid_gbit_per_s"] = out["gbit_per_s"]
    if bandwidth is not None:
        out["bandwidth_gbit_per_s"] = bandwidth
        out["utilization_at_bandwidth"] = utilization_at(q, bandwidth, sustained)
    return out


def recovery(
    params: float, links_gbit: Sequence[float] = RECOVERY_LINKS, buffer_bytes: float = 0.0
) -> dict[str, Any]:
    """What a peer recovery moves (the donor's snapshot, as many bytes in its memory while it
    serves it) and how long the copy takes on each link, at the link's full rate."""
    require(params > 0 and math.isfinite(params), "params", params, "must be > 0")
    for g in links_gbit:
        require(g > 0 and math.isfinite(g), "link", g, "must be > 0 Gbit/s")
    nbytes = params * SNAPSHOT_BYTES_PER_PARAM + buffer_bytes
    return {
        "params": params,
        "snapshot_bytes": nbytes,
        "bytes_per_param": nbytes / params,
        "links": [{"gbit_per_s": g, "seconds": nbytes * 8 / (g * 1e9)} for g in links_gbit],
    }
