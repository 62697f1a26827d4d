"""PNG plots of a run directory: eval loss against tokens and virtual time, a learner
timeline with failures and recoveries, and bytes on the wire per virtual second."""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def read_metrics(path: Path) -> list[dict[str, Any]]:
    with path.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def plot_run(run_dir: Path) -> list[Path]:
    """Write every plot for one run directory; return their paths."""
    records = read_metrics(run_dir / "metrics.jsonl")
    return [
        plot_eval(records, run_dir / "eval_loss.png"),
        plot_timeline(records, run_dir / "timeline.png"),
        plot_bytes(records, run_dir / "bytes.png"),
    ]


def plot_eval(records: Iterable[dict[str, Any]], out: Path, label_prefix: str = "") -> Path:
    evals: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in records:
        if r["kind"] == "eval":
            evals[label_prefix + r["method"]].append(r)
    fig, (ax_tokens, ax_time) = plt.subplots(1, 2, figsize=(11, 4))
    for method, rows in sorted(evals.items()):
        ax_tokens.plot(
            [r["tokens"] for r in rows], [r["loss"] for r in rows], marker=".", label=method
        )
        ax_time.plot([r["t"] for r in rows], [r["loss"] for r in rows], marker=".", label=method)
    ax_tokens.set(xlabel="tokens trained (all learners)", ylabel="eval loss (nats/token)")
    ax_time.set(xlabel="virtual seconds", ylabel="eval loss (nats/token)")
    for ax in (ax_tokens, ax_time):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("Eval loss of the global model")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def plot_timeline(records: Iterable[dict[str, Any]], out: Path) -> Path:
    """Each learner's steps as ticks, faults as coloured spans, recoveries as green marks."""
    records = list(records)
    rows = [r for r in records if r["method"] == "decoupled"] or records
    fig, ax = plt.subplots(figsize=(11, 3.5))
    steps = defaultdict(list)
    end = max((r["t"] for r in rows), default=1.0)
    colors = {
        "crash": "tab:red",
        "node_loss": "darkred",
        "slow": "tab:orange",
        "freeze": "tab:purple",
        "link_cut": "tab:gray",
        "link_slow": "tab:brown",
    }
    for r in rows:
        if r["kind"] == "step":
            steps[r["learner"]].append(r["t"])
        elif r["kind"] == "chaos" and r["event"] in colors:
            span = min(r["duration"] or end, end - r["t"])  # a duration of 0 lasts to the end
            ax.barh(
                r["learner"], span, left=r["t"], color=colors[r["event"]], alpha=0.3, height=0.6
            )
        elif r["kind"] == "recovered":
            ax.plot([r["t"]], [r["learner"]], marker="^", color="tab:green", markersize=9)
    for learner, times in sorted(steps.items()):
        ax.plot(times, [learner] * len(times), "|", color="tab:blue", markersize=6)
    ax.set(
        xlabel="virtual seconds",
        ylabel="learner",
        xlim=(0, end),
        title="Learner timeline: steps (|), crash (red), node lost (dark red), slow (orange), "
        "freeze (purple), link cut (grey), recovered (^)",
    )
    ax.set_yticks(sorted(steps))
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def plot_bytes(records: Iterable[dict[str, Any]], out: Path, bucket: float = 10.0) -> Path:
    """Syncer broadcast bytes per virtual second, in buckets (Decoupled run)."""
    per_bucket: dict[int, float] = defaultdict(float)
    for r in records:
        if r["method"] == "decoupled" and r["kind"] == "round":
            per_bucket[int(r["t"] // bucket)] += r["broadcast_bytes"] * max(r["asked"], 1)
    fig, ax = plt.subplots(figsize=(11, 3))
    keys = sorted(per_bucket)
    ax.plot(
        [k * bucket for k in keys], [per_bucket[k] / bucket for k in keys], drawstyle="steps-post"
    )
    ax.set(xlabel="virtual seconds", ylabel="bytes / s", title="Syncer -> learners bandwidth")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
