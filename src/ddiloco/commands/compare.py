"""``ddiloco compare RUN...``: several run directories side by side, as a table and a plot."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from ddiloco.commands.train import render
from ddiloco.errors import ConfigError
from ddiloco.report.plots import plot_eval, read_metrics, time_label


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("runs", nargs="+", help="run directories written by ddiloco train")
    parser.add_argument("--out", default="compare.png", help="plot file (default: %(default)s)")


def load_run(path: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(summaries of every method, metrics records) of one run directory: the records its
    curves stand on (a resumed run's abandoned records left out, as in its own plots)."""
    summary_file = path / "summary.json"
    if not summary_file.is_file():
        raise ConfigError("run", str(path), "not a run directory (no summary.json)")
    summary = json.loads(summary_file.read_text(encoding="utf-8"))
    methods = summary.get("methods", {summary["method"]: summary})
    first = methods.get(summary["method"], summary)  # (the run's first method, then the rest)
    summaries = [first, *(s for m, s in methods.items() if m != summary["method"])]
    metrics = path / "metrics.jsonl"
    return summaries, read_metrics(metrics) if metrics.is_file() else []


def run(args: argparse.Namespace) -> int:
    summaries: list[dict[str, Any]] = []
    records: list[dict[str, Any]] = []
    for name in args.runs:
        path = Path(name)
        run_summaries, run_records = load_run(path)
        for s in run_summaries:
            summaries.append({**s, "method": f"{path.name}/{s['method']}"})
        records.extend({**r, "method": f"{path.name}/{r['method']}"} for r in run_records)
    print(render(summaries))
    if records:
        out = Path(args.out)
        if not out.suffix:  # (matplotlib would add .png, and the path printed be wrong)
            out = out.with_suffix(".png")
        labels = {time_label(Path(name)) for name in args.runs}
        seconds = labels.pop() if len(labels) == 1 else "seconds (virtual or wall, per run)"
        out = plot_eval(records, out, seconds=seconds)
        print(f"\nplot: {out}")
    return 0
