"""``ddiloco syncer``: the CPU syncer service of a real-processes run.

Binds to loopback unless told otherwise; every frame is authenticated with the run secret
($DDILOCO_SECRET in hex, or --secret-file). Restarted with the same --store it resumes from
its durable state. Prints events as ``@event {json}`` lines (the launcher relays them); with
``--out RUN`` (a syncer started by hand, e.g. on the head host of a multi-host run) it
writes a run directory instead, laid out as ``ddiloco train``'s (runtime/layout.py):
``metrics.jsonl`` (the syncer's records: rounds, evaluations, joins, detections, and each
learner's reported steps and train losses, which no launcher relays here), progress lines
on the terminal, TensorBoard if configured, the global model's checkpoints in
``RUN/checkpoints``, and at the end ``summary.json``, the plots and the final table, so
``ddiloco compare``, ``export``, ``eval`` and ``sample`` read it as any run. The store then
defaults to ``RUN/processes/syncer_state`` (``RUN/syncer_state`` where an earlier version
put it); a syncer restarted with the same ``--out`` resumes from it and appends to the
records.
"""

from __future__ import annotations

import argparse
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from ddiloco.commands import add_config_arguments
from ddiloco.config import load_config, to_toml
from ddiloco.runtime.layout import STORE, syncer_store
from ddiloco.runtime.processes.transport.events import Events
from ddiloco.runtime.processes.transport.sockets import load_secret, parse_address


def add_common(parser: argparse.ArgumentParser) -> None:
    """Arguments the syncer and the learners share: the run's config, id and secret."""
    add_config_arguments(parser, "the run's TOML config (the same file for every process)")
    parser.add_argument("--run-id", help="the run's id, bound into every frame (default: name)")
    parser.add_argument("--secret-file", help="the run secret (default: $DDILOCO_SECRET, hex)")
    parser.add_argument("--method", default="decoupled", help="default: %(default)s")
    parser.add_argument("--t0", type=float, help="run start (epoch s) event times count from")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--bind",
        default="127.0.0.1:5555",
        help="HOST:PORT to listen on (default: %(default)s, loopback only)",
    )
    parser.add_argument(
        "--store",
        help="durable state directory (default: OUT/syncer_state, else runs/<name>-syncer)",
    )
    parser.add_argument("--out", metavar="RUN", help="a run directory: metrics, summary, plots")
    parser.add_argument("--quiet", action="store_true", help="with --out: no progress lines")
    parser.add_argument("--journal", action="store_true", help="also journal every merge's inputs")
    parser.add_argument(
        "--detect-seconds",
        type=float,
        default=None,
        help="silence before a learner is given up (default: the config's)",
    )
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads for merging (default: %(default)s)"
    )
    add_common(parser)


def run(args: argparse.Namespace) -> int:
    from ddiloco.runtime.processes.terminate import on_terminate

    stop = threading.Event()  # SIGTERM ends the run cleanly, with a summary
    on_terminate(stop.set)
    import torch

    from ddiloco.runtime.processes.memory import give_back_freed_memory
    from ddiloco.runtime.processes.syncer.service import SyncerService
    from ddiloco.runtime.run import RunSetup

    give_back_freed_memory()  # before the model: fragment-sized buffers are given back
    torch.set_num_threads(max(1, args.threads))
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s syncer %(message)s")
    parse_address(args.bind, "--bind")
    config = load_config(args.config, list(args.set))
    secret = load_secret(args.secret_file)
    setup = RunSetup(config, args.method)
    out = Path(args.out) if args.out else None
    store = Path(args.store) if args.store else default_store(out, args.method, config.name)
    t0 = args.t0 if args.t0 is not None else time.time()
    writer = None
    again = False  # (a syncer restarted on its run directory)
    if out is not None:  # a run directory of our own (a restart appends to it)
        from ddiloco.report.run_writer import RunWriter
        from ddiloco.runtime.resume import end_line, last_time

        again = (out / "metrics.jsonl").is_file()
        out.mkdir(parents=True, exist_ok=True)
        if not (out / "config.toml").is_file():  # the tools read the run's method from it
            ran = replace(config, methods=(args.method,))
            (out / "config.toml").write_text(to_toml(ran), encoding="utf-8")
        if again:
            end_line(out)
            t0 = t0 if args.t0 is not None else time.time() - last_time(out)
        writer = RunWriter(out, config, quiet=args.quiet, append=again)
        writer.begin(args.method)
    sink: Callable[[dict[str, Any]], None] | None = None
    if writer is not None and out is not None:
        from ddiloco.report.run_writer import note_status_url

        def sink(record: dict[str, Any], writer: RunWriter = writer, out: Path = out) -> None:
            writer.emit(record)
            note_status_url(out, record)

    if writer is None:  # a person at a terminal reads lines; a supervisor or a log, the records
        from ddiloco.report.progress import terminal_sink

        sink = terminal_sink(config.train.tokens, config.report.progress_seconds, args.method)
    events = Events(t0, sink=sink)
    service = SyncerService(
        setup,
        args.bind,
        args.run_id or config.name,
        secret,
        store,
        events,
        journal=args.journal or config.processes.journal,
        detect_seconds=args.detect_seconds or config.processes.detect_seconds,
        stop=stop,
        run=out,
        steps=out is not None,
        secret_file=args.secret_file,
    )
    summary = None
    try:
        result = service.serve()
        if writer is not None:
            from ddiloco.report.summary import syncer_summary

            summary = syncer_summary(
                result, method=args.method, runtime="processes", seconds=events.now()
            )
            summary["stop_signal"] = "SIGTERM" if stop.is_set() else None
            writer.ended(summary)
    finally:
        if writer is not None:
            writer.close()
    if out is not None and summary is not None:
        from ddiloco.commands.train import models, render
        from ddiloco.report.run_writer import finish

        kept = finish(out, [summary], resumed=again)  # (a restart never takes it back)
        print(f"\n{render(kept)}\n\nrun directory: {out}\n{models(kept, out)}")
    return 0


def default_store(out: Path | None, method: str, name: str) -> Path:
    """Where a syncer keeps its durable state by default: in its run directory where the
    launcher would (``RUN/processes/syncer_state``; ``RUN/syncer_state`` if an earlier version
    began the run there), else ``runs/<name>-syncer``."""
    if out is None:
        return Path(f"runs/{name}-syncer")
    older = out / STORE
    return older if older.is_dir() else syncer_store(out, method)
