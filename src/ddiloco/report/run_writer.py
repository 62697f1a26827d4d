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

import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ddiloco.config import RunConfig
from ddiloco.report.metrics import (
    MetricsWriter,
    kept_records,
    method_summaries,
    read_records,
    write_json,
)
from ddiloco.report.progress import Progress
from ddiloco.report.summary import add_equal_time


class RunWriter:
    """Where one run's records go (see the module)."""

    def __init__(
        self,
        out: Path,
        config: RunConfig,
        quiet: bool = False,
        append: bool = False,
        *,
        methods: Sequence[str] = (),
        virtual: bool = False,
        starts: Mapping[str, int] | None = None,
    ) -> None:
        """``append``: a resumed run adds to the records it has. ``methods``, ``virtual``,
        ``starts``: for the progress line (:class:`.progress.Progress`): every method the run
        trains, whether its clock is simulated, and where a resumed run's methods stand."""
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
            config.train.tokens,
            quiet=quiet,
            every=config.report.progress_seconds,
            methods=methods,
            virtual=virtual,
            resumed=append,
            starts=starts,
            limit_seconds=config.train.max_virtual_seconds,
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


def finish(
    out: Path,
    summaries: Sequence[dict[str, Any]],
    *,
    resumed: bool = False,
    interrupted: str | None = None,
) -> list[dict[str, Any]]:
    """``summary.json`` (the first method's summary, every method's under ``methods``, each
    with its eval loss at equal time) and the plots; returns the summaries it holds.

    ``resumed``: a resumed launch never takes a method back: a method the run's summary.json
    already holds with more tokens keeps that summary (said on stderr; this launch's goes to
    ``summary.fewer.json``), and a method this launch did not finish keeps its earlier one.
    ``interrupted``: the method a signal stopped before its summary (``interrupted`` in
    summary.json: the methods it holds are those that finished)."""
    from ddiloco.report.plots import plot_run  # (the plotting stack: only at the end)

    summaries = [dict(s) for s in summaries]
    if resumed:
        summaries = never_back(out, summaries)
    add_equal_time(summaries, eval_curves(out / "metrics.jsonl"))
    primary = dict(summaries[0])
    primary["methods"] = {s["method"]: s for s in summaries}
    if interrupted is not None:
        primary["interrupted"] = interrupted
    write_json(out / "summary.json", primary)
    plot_run(out)
    return summaries


def never_back(out: Path, summaries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """This launch's summaries merged into the run's summary.json, none taken back to fewer
    tokens (see :func:`finish`)."""
    path = out / "summary.json"
    before = method_summaries(out)
    if before is None:
        print(f"ddiloco: {path} unreadable: replaced", file=sys.stderr, flush=True)
        return summaries
    kept, fewer = [], []
    for s in summaries:
        old = before.pop(s["method"], None)
        if isinstance(old, dict) and int(old.get("tokens", 0)) > int(s["tokens"]):
            fewer.append(s)
            kept.append(old)
            print(
                f"ddiloco: WARNING: {s['method']} ended this launch at {s['tokens']:,} tokens, "
                f"fewer than the {int(old['tokens']):,} of {path}: summary.json keeps the "
                f"earlier summary (checkpoint {old.get('checkpoint')}); this launch's is in "
                f"{out / FEWER}",
                file=sys.stderr,
                flush=True,
            )
        else:
            kept.append(s)
    if fewer:
        write_json(out / FEWER, {s["method"]: s for s in fewer})
    # a method this launch did not reach (interrupted before it) keeps its earlier summary
    kept += [s for s in before.values() if isinstance(s, dict)]
    return kept


FEWER = "summary.fewer.json"  # a resumed launch's summaries that would have taken the run back


def eval_curves(path: Path) -> dict[str, list[tuple[float, float]]]:
    """Each method's (time, eval loss) evaluations, from a run's metrics (a resumed run's
    earlier launches included, their abandoned records left out: :func:`kept_records`)."""
    curves: dict[str, list[tuple[float, float]]] = {}
    for r in kept_records(read_records(path)):
        if r.get("kind") == "eval" and "t" in r:
            curves.setdefault(r["method"], []).append((float(r["t"]), float(r["loss"])))
    return curves
