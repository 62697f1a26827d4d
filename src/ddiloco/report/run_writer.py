"""The live half of a run directory: every record to ``metrics.jsonl`` (the source of truth,
flushed line by line), the terminal (:mod:`.progress`), TensorBoard and W&B; at the end
``summary.json`` and the plots.

``ddiloco train`` writes through it for every runtime, and so does a hand-started
``ddiloco syncer --out RUN``: the two directories read the same to ``ddiloco compare``.

Call order: :meth:`RunWriter.begin` before a method's first record, :meth:`RunWriter.emit`
for each, :meth:`RunWriter.ended` with its summary; :meth:`RunWriter.close` once, then
:func:`finish` with every method's summary.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ddiloco.config import RunConfig
from ddiloco.report.metrics import MetricsWriter, write_json
from ddiloco.report.progress import Progress
from ddiloco.report.summary import add_equal_time


class RunWriter:
    """Where one run's records go (see the module)."""

    def __init__(
        self, out: Path, config: RunConfig, quiet: bool = False, append: bool = False
    ) -> None:
        """``append``: a resumed run adds to the records it has."""
        from ddiloco.report.tensorboard import ScalarView, TensorBoardSink

        self.out = out
        self.sinks: list[ScalarView] = []  # (a missing package is refused here, at the start)
        if config.report.tensorboard:
            self.sinks.append(TensorBoardSink(out))
        if config.report.wandb:
            from ddiloco.report.wandb_sink import WandbSink

            self.sinks.append(WandbSink(out, config))
        self.metrics = MetricsWriter(out / "metrics.jsonl", append=append)
        self.progress = Progress(
            config.train.tokens, quiet=quiet, every=config.report.progress_seconds
        )
        self.method = ""

    def begin(self, method: str) -> None:
        self.method = self.metrics.method = method

    def emit(self, record: dict[str, Any]) -> None:
        self.metrics.emit(record)
        self.progress(self.method, record)
        for sink in self.sinks:
            sink(self.method, record)

    def ended(self, summary: dict[str, Any]) -> None:
        for sink in self.sinks:
            sink.summary(self.method, summary)

    def close(self) -> None:
        self.progress.close()
        self.metrics.close()
        for sink in self.sinks:
            sink.close()


def note_status_url(out: Path, record: dict[str, Any]) -> None:
    """``<run>/status_url`` from a syncer's ``syncer_up`` record (each syncer life binds its
    own port); the launchers and a hand-started ``ddiloco syncer --out`` both call it."""
    if record.get("kind") == "syncer_up" and record.get("status_url"):
        (out / "status_url").write_text(f"{record['status_url']}\n", encoding="utf-8")


def finish(out: Path, summaries: Sequence[dict[str, Any]]) -> None:
    """``summary.json`` (the first method's summary, every method's under ``methods``, each
    with its eval loss at equal time) and the plots."""
    from ddiloco.report.plots import plot_run  # (the plotting stack: only at the end)

    summaries = list(summaries)
    add_equal_time(summaries, eval_curves(out / "metrics.jsonl"))
    primary = dict(summaries[0])
    primary["methods"] = {s["method"]: s for s in summaries}
    write_json(out / "summary.json", primary)
    plot_run(out)


def eval_curves(path: Path) -> dict[str, list[tuple[float, float]]]:
    """Each method's (time, eval loss) evaluations, from a run's metrics (a resumed run's
    earlier launches included; on the simulated clock, a method's evaluations after the
    time it resumed from are the abandoned launch's, and left out)."""
    curves: dict[str, list[tuple[float, float]]] = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                r = json.loads(line)
            except ValueError:  # a line cut by a crash (a resumed run's earlier launch)
                continue
            if r.get("kind") == "resume" and "t" in r:
                kept = [p for p in curves.get(r["method"], []) if p[0] <= float(r["t"])]
                curves[r["method"]] = kept
            elif r.get("kind") == "eval" and "t" in r:
                curves.setdefault(r["method"], []).append((float(r["t"]), float(r["loss"])))
    return curves
