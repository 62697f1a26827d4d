"""PNG of goodput against cluster size, ours (lines, 95% CI bars) beside the paper's (rings).

Uses matplotlib's Agg canvas directly, so it never touches the global backend or a display.
"""

from __future__ import annotations

from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from ddiloco.cluster.table import TableResult, paper_value


def plot_table(result: TableResult, path: str | Path, title: str = "") -> Path:
    """Write the goodput figure to ``path`` and return it."""
    fig = Figure(figsize=(8, 5.5), dpi=120)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    chips = list(result.chips)
    for i, (system, cells) in enumerate(result.cells.items()):
        color = f"C{i}"
        ours = [100 * c.mean for c in cells]
        err = [100 * c.ci95 for c in cells]
        ax.errorbar(
            chips,
            ours,
            yerr=err,
            color=color,
            marker="o",
            ms=4,
            lw=1.6,
            capsize=3,
            label=f"{system} (ours)",
        )
        ref = [(n, v) for n in chips if (v := paper_value(system, n)) is not None]
        if ref:
            ax.plot(
                [n for n, _ in ref],
                [v for _, v in ref],
                color=color,
                ls="--",
                lw=1,
                marker="o",
                mfc="none",
                ms=8,
                label=f"{system} (paper)",
            )
    ax.set_xscale("log")
    ax.set_xticks(chips)
    ax.set_xticklabels([f"{n / 1e6:g}M" if n >= 1e6 else f"{n / 1e3:g}K" for n in chips])
    ax.minorticks_off()
    ax.set_xlabel("chips")
    ax.set_ylabel("goodput (%)")
    ax.set_ylim(0, 101)
    ax.grid(True, alpha=0.3)
    p = result.params
    ax.set_title(
        title
        or f"goodput vs cluster size (MTBI {p.failures.mtbi_hours:g} h/chip, "
        f"{p.run.seeds} seeds x {p.run.days:g} days)"
    )
    ax.legend(fontsize=7, ncol=2, loc="lower left")
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    return out
