"""The goodput table: every system × cluster size × seed, with confidence intervals.

For each cluster size and seed one failure trace is sampled and every system runs on it. The
generators are keyed by (seed, seed index, chips, system), so a cell's result does not depend
on which other cells are run, and the same parameters give the same table bit for bit.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ddiloco.cluster.failures import sample_trace
from ddiloco.cluster.goodput import Outcome, simulate_decoupled, simulate_dp, simulate_elastic
from ddiloco.cluster.params import (
    PAPER_CHIPS,
    PAPER_TABLE,
    PAPER_TOLERANCE,
    ClusterParams,
)

# Two-sided 95% Student t quantiles by degrees of freedom (1..30); beyond: 1.96.
_T95 = (
    12.706,
    4.303,
    3.182,
    2.776,
    2.571,
    2.447,
    2.365,
    2.306,
    2.262,
    2.228,
    2.201,
    2.179,
    2.160,
    2.145,
    2.131,
    2.120,
    2.110,
    2.101,
    2.093,
    2.086,
    2.080,
    2.074,
    2.069,
    2.064,
    2.060,
    2.056,
    2.052,
    2.048,
    2.045,
    2.042,
)


def t95(dof: int) -> float:
    return _T95[dof - 1] if 1 <= dof <= len(_T95) else 1.96


def system_names(p: ClusterParams) -> list[str]:
    return ["dp", "elastic_dp"] + [f"decoupled_m{m}" for m in p.decoupled.learners]


@dataclass(frozen=True)
class Cell:
    """One system at one cluster size, over seeds (fractions 0..1)."""

    goodput: tuple[float, ...]
    uptime: tuple[float, ...]
    badput: dict[str, float]  # mean over seeds

    @property
    def mean(self) -> float:
        return float(np.mean(self.goodput))

    @property
    def ci95(self) -> float:
        return ci95(self.goodput)

    @property
    def uptime_mean(self) -> float:
        return float(np.mean(self.uptime))


def ci95(values: tuple[float, ...]) -> float:
    """Half-width of the 95% confidence interval of the mean over seeds (0 for one seed)."""
    n = len(values)
    return 0.0 if n < 2 else t95(n - 1) * float(np.std(values, ddof=1)) / math.sqrt(n)


@dataclass(frozen=True)
class TableResult:
    params: ClusterParams
    cells: dict[str, list[Cell]]  # system -> one cell per cluster size
    seconds: float = 0.0

    @property
    def chips(self) -> tuple[int, ...]:
        return self.params.run.chips


def _rng(p: ClusterParams, seed_index: int, chips: int, stream: int) -> np.random.Generator:
    return np.random.default_rng([p.run.seed, seed_index, chips, stream])


def simulate_cell(p: ClusterParams, chips: int, seed_index: int) -> dict[str, Outcome]:
    """Every system on the trace of one (cluster size, seed)."""
    trace = sample_trace(_rng(p, seed_index, chips, 0), chips, p.horizon_s, p.failures)
    out = {
        "dp": simulate_dp(trace, p, _rng(p, seed_index, chips, 1)),
        "elastic_dp": simulate_elastic(trace, p, _rng(p, seed_index, chips, 2)),
    }
    for m in p.decoupled.learners:
        out[f"decoupled_m{m}"] = simulate_decoupled(trace, p, m, _rng(p, seed_index, chips, 2 + m))
    return out


def run_table(p: ClusterParams, progress: Callable[[str], None] | None = None) -> TableResult:
    """Simulate the whole table."""
    import time

    t0 = time.perf_counter()
    names = system_names(p)
    per: dict[str, list[list[Outcome]]] = {s: [] for s in names}
    for chips in p.run.chips:
        outcomes: dict[str, list[Outcome]] = {s: [] for s in names}
        for seed_index in range(p.run.seeds):
            for s, o in simulate_cell(p, chips, seed_index).items():
                outcomes[s].append(o)
            if progress:
                progress(f"{_chips_label(chips)} chips, seed {seed_index + 1}/{p.run.seeds}")
        for s in names:
            per[s].append(outcomes[s])
    cells = {s: [_cell(os) for os in per[s]] for s in names}
    return TableResult(p, cells, time.perf_counter() - t0)


def _cell(outcomes: list[Outcome]) -> Cell:
    causes = sorted({c for o in outcomes for c in o.badput})
    badput = {c: float(np.mean([o.badput.get(c, 0.0) for o in outcomes])) for c in causes}
    return Cell(tuple(o.goodput for o in outcomes), tuple(o.uptime for o in outcomes), badput)


def paper_value(system: str, chips: int) -> float | None:
    """The paper's goodput (%) for this cell, if it published one."""
    if system in PAPER_TABLE and chips in PAPER_CHIPS:
        return PAPER_TABLE[system][PAPER_CHIPS.index(chips)]
    return None


def tolerance(system: str) -> float:
    return PAPER_TOLERANCE["decoupled" if system.startswith("decoupled") else system]


def worst_deviation(result: TableResult) -> dict[str, float]:
    """Per system, the largest |ours − paper| in points over the cells the paper has."""
    worst: dict[str, float] = {}
    for s, cells in result.cells.items():
        for chips, cell in zip(result.chips, cells, strict=True):
            ref = paper_value(s, chips)
            if ref is not None:
                worst[s] = max(worst.get(s, 0.0), abs(100 * cell.mean - ref))
    return worst


def to_json(result: TableResult) -> dict[str, Any]:
    """The machine-readable table (percentages, rounded to 0.01)."""

    def pct(x: float) -> float:
        return round(100.0 * x, 2)

    table, ci, uptime, uptime_ci, badput, paper = {}, {}, {}, {}, {}, {}
    for s, cells in result.cells.items():
        table[s] = [pct(c.mean) for c in cells]
        ci[s] = [pct(c.ci95) for c in cells]
        uptime[s] = [pct(c.uptime_mean) for c in cells]
        uptime_ci[s] = [pct(ci95(c.uptime)) for c in cells]
        badput[s] = [{k: pct(v) for k, v in c.badput.items()} for c in cells]
        paper[s] = [paper_value(s, n) for n in result.chips]
    return {
        "chips": list(result.chips),
        "table": table,
        "ci95": ci,
        "uptime": uptime,
        "uptime_ci95": uptime_ci,
        "badput": badput,
        "paper": paper,
        "worst_deviation": {k: round(v, 2) for k, v in worst_deviation(result).items()},
        "tolerance": {s: tolerance(s) for s in result.cells},
        "seconds": round(result.seconds, 2),
        "params": result.params.to_dict(),
    }


def _chips_label(n: int) -> str:
    if n >= 1_000_000:
        return f"{n / 1e6:g}M"
    if n >= 1_000:
        return f"{n / 1e3:g}K"
    return str(n)


def render(result: TableResult) -> str:
    """The table for people: goodput ± CI, the paper's value and the difference."""
    p = result.params
    head = ["system"] + [_chips_label(n) for n in result.chips]
    lines = [
        f"goodput (%) over {p.run.seeds} seed(s) x {p.run.days:g} days, per-chip MTBI "
        f"{p.failures.mtbi_hours:g} h; cell: ours ±95% CI [paper, ours − paper]",
        "",
    ]
    rows = []
    for s, cells in result.cells.items():
        row = [s]
        for chips, cell in zip(result.chips, cells, strict=True):
            text = f"{100 * cell.mean:5.1f}±{100 * cell.ci95:.1f}"
            ref = paper_value(s, chips)
            if ref is not None:
                text += f" [{ref:g}, {100 * cell.mean - ref:+.1f}]"
            row.append(text)
        rows.append(row)
    lines.append(_table(head, rows))
    worst = worst_deviation(result)
    if worst:
        verdicts = [f"{s} {w:.1f} (tol {tolerance(s):g})" for s, w in worst.items()]
        lines += ["", "largest |ours − paper| per row: " + ", ".join(verdicts)]
    lines += ["", "uptime (%) ±95% CI: fraction of wall time the system as a whole advances"]
    up_rows = [
        [s] + [f"{100 * c.uptime_mean:.1f}±{100 * ci95(c.uptime):.1f}" for c in cells]
        for s, cells in result.cells.items()
    ]
    lines.append(_table(head, up_rows))
    big = result.chips[-1]
    lines += ["", f"badput (%) by cause at {_chips_label(big)} chips"]
    causes = sorted({c for cells in result.cells.values() for c in cells[-1].badput})
    bad_rows = [
        [s] + [f"{100 * cells[-1].badput.get(c, 0.0):.1f}" for c in causes]
        for s, cells in result.cells.items()
    ]
    lines.append(_table(["system", *causes], bad_rows))
    lines += ["", f"simulated in {result.seconds:.1f} s"]
    return "\n".join(lines)


def _table(header: list[str], rows: list[list[str]]) -> str:
    cells = [header, *rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    out = [
        "  ".join(
            c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))
        )
        for r in cells
    ]
    out.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(out)
