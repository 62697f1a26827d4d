"""PNG plots of a run directory: eval loss against tokens and time, each learner's train
loss, a learner timeline with failures and observed outages, and bytes on the wire per
second (both directions, every method). Time is virtual seconds on the simulated clock and
wall seconds on real processes (the run's ``runtime``, from its config.toml). A resumed
run's abandoned records (after the point a method resumed from) are left out of every plot
(:func:`ddiloco.report.metrics.kept_records`)."""

from __future__ import annotations

import json
import math
import tomllib
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.ticker import FuncFormatter

from ddiloco.config import WALL_CLOCK_RUNTIMES
from ddiloco.report.metrics import kept_records, read_records
from ddiloco.report.progress import human_count

COUNT = FuncFormatter(lambda x, _: human_count(x))  # tick labels: 100K, 1.5M
LOSS_SMOOTHING = 0.1  # train-loss curves: an exponential moving average of the steps
DOWN_KINDS = ("crash", "node_loss", "preempt")  # drawn as observed: down until it merges again


def save(fig: Any, out: Path) -> Path:
    """Write ``fig`` to ``out`` (PNG, 100 dpi) and free it."""
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The records a run's curves are drawn from: a line cut by a crash skipped, a resumed
    run's abandoned records left out."""
    return kept_records(read_records(path))


def time_label(run_dir: Path) -> str:
    """The time axis of a run: wall seconds on real processes, else virtual seconds."""
    config = run_dir / "config.toml"
    runtime = "sim"
    if config.is_file():
        runtime = str(tomllib.loads(config.read_text(encoding="utf-8")).get("runtime", "sim"))
    return "wall seconds" if runtime in WALL_CLOCK_RUNTIMES else "virtual seconds"


def plot_run(run_dir: Path) -> list[Path]:
    """Write every plot for one run directory; return their paths."""
    records = read_metrics(run_dir / "metrics.jsonl")
    seconds = time_label(run_dir)
    return [
        plot_eval(records, run_dir / "eval_loss.png", seconds=seconds),
        plot_train_loss(records, run_dir / "train_loss.png", seconds),
        plot_timeline(records, run_dir / "timeline.png", seconds),
        plot_bytes(records, run_dir / "bytes.png", seconds=seconds, totals=totals_of(run_dir)),
    ]


def totals_of(run_dir: Path) -> dict[str, dict[str, Any]]:
    """Each method's summary (its byte totals), from the run's summary.json ({} if none)."""
    path = run_dir / "summary.json"
    if not path.is_file():
        return {}
    try:
        summary = json.loads(path.read_text(encoding="utf-8"))
        return dict(summary.get("methods") or {summary["method"]: summary})
    except (ValueError, KeyError, AttributeError):
        return {}


def eval_tokens(record: dict[str, Any]) -> float:
    """Where an evaluation belongs on the tokens axis: an in-place evaluation of the syncer
    (``processes.eval_in_place``) read the global model while merges went on, from
    ``tokens`` to ``tokens_end``; it is drawn at the middle of that span, not at its start."""
    return (float(record["tokens"]) + float(record.get("tokens_end", record["tokens"]))) / 2


def plot_eval(
    records: Iterable[dict[str, Any]],
    out: Path,
    label_prefix: str = "",
    seconds: str = "virtual seconds",
) -> Path:
    evals: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in records:
        if r["kind"] == "eval":
            evals[label_prefix + r["method"]].append(r)
    fig, (ax_tokens, ax_time) = plt.subplots(1, 2, figsize=(11, 4))
    for method, rows in sorted(evals.items()):
        ax_tokens.plot(
            [eval_tokens(r) for r in rows], [r["loss"] for r in rows], marker=".", label=method
        )
        ax_time.plot([r["t"] for r in rows], [r["loss"] for r in rows], marker=".", label=method)
    ax_tokens.set(xlabel="tokens trained (all learners)", ylabel="eval loss (nats/token)")
    ax_tokens.xaxis.set_major_formatter(COUNT)
    ax_time.set(xlabel=seconds, ylabel="eval loss (nats/token)")
    for ax in (ax_tokens, ax_time):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("Eval loss of the global model")
    return save(fig, out)


def outages(rows: list[dict[str, Any]], end: float) -> list[tuple[int, float, float]]:
    """(learner, start, end) of every observed outage: from a crash, node loss or preemption
    (or an unplanned exit) of a learner to the first round that merged its answer after it
    recovered, or the run's end."""
    spans: list[tuple[int, float, float]] = []
    down: dict[int, float] = {}
    back: set[int] = set()
    for r in rows:
        kind = r["kind"]
        if kind == "chaos" and r["event"] in DOWN_KINDS and "skipped" not in r:
            down.setdefault(r["learner"], r["t"])
        elif (
            kind == "exited" and r.get("code") and str(r.get("process", "")).startswith("learner-")
        ):
            down.setdefault(int(str(r["process"]).split("-")[1]), r["t"])
        elif kind in ("recovered", "caught_up") and r["learner"] in down:
            back.add(r["learner"])
        elif kind == "round":
            for m in [m for m in back if r["weights"].get(str(m))]:
                spans.append((m, down.pop(m), r["t"]))
                back.discard(m)
    spans += [(m, t, end) for m, t in down.items()]
    return spans


def plot_timeline(
    records: Iterable[dict[str, Any]], out: Path, seconds: str = "virtual seconds"
) -> Path:
    """Each learner's steps as ticks, observed outages (down until its answers merge again)
    and planned faults as coloured spans, recoveries as green marks."""
    records = list(records)
    rows = [r for r in records if r["method"] == "decoupled"] or records
    fig, ax = plt.subplots(figsize=(11, 3.5))
    steps = defaultdict(list)
    end = max((r["t"] for r in rows), default=1.0)
    colors = {
        "slow": "tab:orange",
        "freeze": "tab:purple",
        "link_cut": "tab:gray",
        "link_slow": "tab:brown",
    }
    for m, start, stop in outages(rows, end):
        ax.barh(m, stop - start, left=start, color="tab:red", alpha=0.3, height=0.6)
    for r in rows:
        if r["kind"] == "step":
            steps[r["learner"]].append(r["t"])
        elif r["kind"] == "chaos" and r["event"] in colors and "skipped" not in r:
            span = min(r["duration"] or end, end - r["t"])  # a duration of 0 lasts to the end
            ax.barh(
                r["learner"], span, left=r["t"], color=colors[r["event"]], alpha=0.3, height=0.6
            )
        elif r["kind"] == "recovered":
            ax.plot([r["t"]], [r["learner"]], marker="^", color="tab:green", markersize=9)
    for learner, times in sorted(steps.items()):
        ax.plot(times, [learner] * len(times), "|", color="tab:blue", markersize=6)
    ax.set(
        xlabel=seconds,
        ylabel="learner",
        xlim=(0, end),
        title="Learner timeline: steps (|), down until merged again (red), slow (orange), "
        "freeze (purple), link cut (grey), recovered (^)",
    )
    ax.set_yticks(sorted(steps))
    return save(fig, out)


def train_loss_curves(
    records: Iterable[dict[str, Any]],
) -> dict[tuple[str, int], list[tuple[float, float]]]:
    """(time, smoothed loss) of each (method, learner). A curve breaks (a NaN point) where a
    learner's steps do not follow on (a restart that copied a peer, a rollback) and where
    its method resumed (a ``resume`` record: the stop/resume gap): no line across the
    outage, and the average starts again from the new life's own losses instead of
    dragging the old life's."""
    curves: dict[tuple[str, int], list[tuple[float, float]]] = defaultdict(list)
    last_step: dict[tuple[str, int], int] = {}
    for r in records:
        if r["kind"] == "resume":
            for key in [k for k in last_step if k[0] == r["method"]]:
                del last_step[key]  # (the next step does not follow on: a break)
            continue
        if r["kind"] != "step" or r.get("loss") is None:  # (an own loop may not say its loss)
            continue
        key, loss = (r["method"], r["learner"]), float(r["loss"])
        points = curves[key]
        follows = bool(points) and last_step.get(key) == int(r["step"]) - 1
        if points and not follows:
            points.append((r["t"], math.nan))  # (matplotlib breaks the line at a NaN)
        last = points[-1][1] if follows else loss
        points.append((r["t"], (1 - LOSS_SMOOTHING) * last + LOSS_SMOOTHING * loss))
        last_step[key] = int(r["step"])
    return curves


def plot_train_loss(
    records: Iterable[dict[str, Any]], out: Path, seconds: str = "virtual seconds"
) -> Path:
    """Each learner's train loss (:func:`train_loss_curves`) against time, per method."""
    curves = train_loss_curves(records)
    fig, ax = plt.subplots(figsize=(11, 4))
    for (method, m), points in sorted(curves.items()):
        ax.plot([t for t, _ in points], [v for _, v in points], label=f"{method} {m}", lw=1)
    ax.set(xlabel=seconds, ylabel="train loss (nats/token, smoothed)", title="Train loss")
    ax.grid(alpha=0.3)
    if curves:
        ax.legend(fontsize="small", ncol=2)
    return save(fig, out)


def plot_bytes(
    records: Iterable[dict[str, Any]],
    out: Path,
    bucket: float = 0.0,
    seconds: str = "virtual seconds",
    totals: dict[str, dict[str, Any]] | None = None,
) -> Path:
    """Bytes per second on the wire, in buckets of ``bucket`` seconds (0: about 60 over the
    run), both directions of every method (:func:`byte_series`)."""
    series = byte_series(list(records), totals or {})
    end = max((t for points in series.values() for t, _ in points), default=1.0)
    bucket = bucket or max(1.0, math.ceil(end / 60))
    fig, ax = plt.subplots(figsize=(11, 3.5))
    for label, points in series.items():
        per_bucket: dict[int, float] = defaultdict(float)
        for t, n in points:
            per_bucket[int(t // bucket)] += n
        keys = range(min(per_bucket, default=0), max(per_bucket, default=0) + 1)
        ax.plot(
            [k * bucket for k in keys],
            [per_bucket.get(k, 0.0) / bucket for k in keys],
            drawstyle="steps-post",
            label=label,
        )
    ax.set(xlabel=seconds, ylabel="bytes / s", title="Bytes on the wire, each direction")
    ax.yaxis.set_major_formatter(COUNT)
    if series:
        ax.set_yscale("symlog", linthresh=1.0)  # (data-parallel moves far more)
        ax.yaxis.set_major_formatter(COUNT)
        ax.legend(fontsize="small")
    ax.grid(alpha=0.3)
    return save(fig, out)


def byte_series(
    records: list[dict[str, Any]], totals: dict[str, dict[str, Any]]
) -> dict[str, list[tuple[float, float]]]:
    """(time, bytes) points of each method and direction. A fragment method's merges
    broadcast each merged fragment to the learners asked (``round`` records:
    ``broadcast_bytes`` x ``asked``); what the learners sent (their answers) has no record
    of its own: each round's answers x its fragment's bytes, scaled so the method's sum is
    its summary's total. Data-parallel: the all-reduce, the same bytes each way, its total
    spread over its steps."""
    series: dict[str, list[tuple[float, float]]] = {}
    methods = list(dict.fromkeys(str(r.get("method")) for r in records))
    for method in methods:
        rows = [r for r in records if r.get("method") == method]
        rounds = [r for r in rows if r["kind"] == "round"]
        summary = totals.get(method, {})
        if rounds:
            down = [(r["t"], r["broadcast_bytes"] * max(r["asked"], 1)) for r in rounds]
            up = [(r["t"], r["broadcast_bytes"] * r["answers"]) for r in rounds]
            total = learners_sent(summary)
            scale = total / max(1.0, sum(n for _, n in up)) if total else 1.0
            series[f"{method} syncer -> learners"] = down
            series[f"{method} learners -> syncer"] = [(t, n * scale) for t, n in up]
            continue
        steps = [r for r in rows if r["kind"] == "step"]
        moved = float(summary.get("bytes_sent") or 0)
        if steps and moved:
            each = moved / len(steps)
            series[f"{method} all-reduce (each way)"] = [(r["t"], each) for r in steps]
    return series


def learners_sent(summary: dict[str, Any]) -> float:
    """The bytes a fragment method's learners sent, from its summary: counted by the
    learners on the simulated clock (``bytes_sent``), by the syncer on real processes
    (``bytes_received``)."""
    if not summary:
        return 0.0
    key = "bytes_sent" if summary.get("clock") == "virtual" else "bytes_received"
    return float(summary.get(key) or 0)
