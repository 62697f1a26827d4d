"""``ddiloco train``: run an experiment and write its run directory.

With no arguments it runs the embedded demo: 4 learners train a ~0.9M-parameter GPT on
Shakespeare with Decoupled DiLoCo under a chaos plan (a crash with peer recovery, a
straggler), then data-parallel on the same tokens, and prints a side-by-side table.

Under ``--runtime processes`` a pre-flight check refuses a model or data set that cannot
train before any process starts; a process that keeps failing stops the run with its log's
last lines and exit status 2 (as every error); the first SIGINT or SIGTERM stops the run
cleanly (the syncer's final evaluation and summary, then summary.json and the plots as at
a normal end) and exits 128 + the signal (130 for Ctrl-C, 143 for SIGTERM), a second one
kills every process at once and exits 130 with no summary. On any runtime, a Ctrl-C that
interrupts a later method keeps the summary of the methods that finished (summary.json,
the plots, the table) and says which method it interrupted. A refused start (the config,
the pre-flight checks) leaves no run directory behind.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import signal
import sys
import time
from pathlib import Path
from typing import Any

from ddiloco.commands import add_config_arguments
from ddiloco.config import METHODS, RUNTIMES, WALL_CLOCK_RUNTIMES, RunConfig, load_config
from ddiloco.errors import ConfigError
from ddiloco.launch import DEMO_CHAOS, Interrupted, train
from ddiloco.methods import method_for
from ddiloco.report.text import human_bytes, table
from ddiloco.runtime.resume import resumed_config


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser, "a TOML file (see configs/); default: the demo")
    parser.add_argument("--seed", type=int, help="override the config's seed")
    parser.add_argument("--out", help="run directory (default: runs/<name>-<time>)")
    parser.add_argument("--quiet", action="store_true", help="no live progress lines")
    parser.add_argument(
        "--resume",
        metavar="RUN",
        help="continue a stopped or crashed run in its directory (its own config; --set may "
        "change the budget, the eval and checkpoint cadence, processes.*); on the simulated "
        "clock each unfinished method restarts from its newest checkpoint",
    )
    parser.add_argument(
        "--runtime",
        choices=RUNTIMES,
        help="sim: simulated clock; processes: a syncer and learners as OS processes on this "
        "host; ray: the same as Ray actors on a cluster (ray.address, else a local one)",
    )


def resolve(args: argparse.Namespace) -> RunConfig:
    config = load_config(args.config, list(args.set))
    touched = any(item.split("=", 1)[0].strip().startswith("chaos") for item in args.set)
    if args.config is None and not touched:  # the demo, unless its chaos was overridden
        config = dataclasses.replace(config, chaos=DEMO_CHAOS)
    if args.seed is not None:
        config = dataclasses.replace(config, seed=args.seed)
    if getattr(args, "runtime", None):
        config = dataclasses.replace(config, runtime=args.runtime)
    if config.runtime in WALL_CLOCK_RUNTIMES:
        # each method says where it runs (Method.runtimes)
        runnable = tuple(m for m in METHODS if config.runtime in method_for(config, m).runtimes)
        kept = tuple(m for m in config.methods if m in runnable)
        if kept != config.methods:
            print(
                f"runtime {config.runtime}: running {kept or runnable[:1]}; the other methods "
                "run on the simulated clock (--runtime sim), compare with ddiloco compare"
            )
        config = dataclasses.replace(config, methods=kept or runnable[:1])
    return config


def run(args: argparse.Namespace) -> int:
    if args.resume:
        if args.config or args.out or args.seed is not None or args.runtime:
            why = "a resumed run keeps its own config and directory: use --set to change it"
            raise ConfigError("--resume", args.resume, why)
        out = Path(args.resume)
        config = resumed_config(out, list(args.set))
    else:
        config = resolve(args)
        out = Path(args.out or f"runs/{config.name}-{time.strftime('%Y%m%d-%H%M%S')}")
    # (train makes the run directory once the config and the pre-flight checks have passed)
    from ddiloco.runtime.processes.launcher.supervision import LaunchError

    try:
        summaries = train(config, out, quiet=args.quiet, resume=bool(args.resume))  # the library's
    except LaunchError as exc:
        print(exc.details(), file=sys.stderr, flush=True)
        raise  # the cli's one-line error, exit status 2
    except Interrupted as stop:  # a later method: those that finished keep their summary
        print(f"\n{render(stop.summaries)}\n\nrun directory: {out}\n{models(stop.summaries, out)}")
        earlier = any(s["method"] == stop.method for s in stop.summaries)
        print(
            f"ddiloco train: interrupted during {stop.method}: summary.json and the plots hold "
            f"{', '.join(stop.finished)}, which finished"
            + (f" ({stop.method}: its earlier launch's summary)" if earlier else ""),
            file=sys.stderr,
        )
        return 128 + signal.SIGINT
    except KeyboardInterrupt:
        print(f"\nddiloco train: killed, no summary (run directory: {out})", file=sys.stderr)
        return 128 + signal.SIGINT
    print()
    print(render(summaries))
    for note in late_notes(config, summaries):
        print(note)
    print(f"\nrun directory: {out}")
    print(models(summaries, out))
    stopped = next((s["stop_signal"] for s in summaries if s.get("stop_signal")), None)
    if stopped:
        print(f"stopped early by {stopped}: summary.json and the plots cover the run so far")
        return 128 + int(signal.Signals[stopped])
    return 0


def render(summaries: list[dict[str, Any]]) -> str:
    """The side-by-side table printed at the end of a run."""
    rows = []
    for s in summaries:
        wasted = sum(s["tokens_wasted"].values())
        at_time = s.get("eval_loss_equal_time")
        rows.append(
            [
                s["method"],
                f"{s['eval_loss']:.4f}",
                f"{at_time:.4f}" if at_time is not None else "-",
                f"{s['eval_bpb']:.4f}" if s.get("eval_bpb") is not None else "-",
                f"{s['tokens']:,}",
                f"{s['tokens_merged']:,.0f}",
                f"{wasted:,.0f}",
                f"{100 * s['goodput']:.1f}%",
                f"{100 * s['uptime']:.1f}%",
                f"{s['virtual_seconds']:.0f}",
                human_bytes(s["bytes_per_token"]),
            ]
        )
    clock = "wall s" if all(s.get("clock") == "wall" for s in summaries) else "virtual s"
    horizons = {float(s.get("equal_time_seconds", s["virtual_seconds"])) for s in summaries}
    horizon = min(horizons)  # one run's: the time its first method finished
    first = next((s for s in summaries if s["virtual_seconds"] == horizon), summaries[0])
    at, when = f"at {horizon:.0f} {clock}", f"when {first['method']} finished"
    if len(horizons) > 1:  # (ddiloco compare of runs that took different times)
        at, when = "at equal time", "each run's, when its first method finished"
    text = table(
        [
            "method",
            "eval loss",
            at,
            "bits/byte",
            "tokens",
            "merged",
            "wasted",
            "goodput",
            "uptime",
            clock,
            "bytes/token",
        ],
        rows,
    )
    text += f"\n(eval loss: at equal tokens; {at}: {when}, between evaluations)"
    for s in summaries:
        if s.get("resumed_from"):
            text += f"\n{s['method']} {resumed_line(s['resumed_from'])}"
    for s in summaries:
        if s["tokens_wasted"]:
            text += f"\n{s['method']} wasted tokens by reason: " + json.dumps(
                {k: round(v) for k, v in s["tokens_wasted"].items()}
            )
    return text


LATE_SHARE = 0.25  # late answers this common make outer momentum a poor choice (§12)


def late_notes(config: RunConfig, summaries: list[dict[str, Any]]) -> list[str]:
    """A method whose merged answers came late this often, under outer momentum: the one
    setting where the merged delta as it is measured better (docs/results.md §12)."""
    notes = []
    for s in summaries:
        answers = s.get("answers") or {}
        admitted = answers.get("accepted", 0) + answers.get("waiting", 0)
        late = answers.get("late", 0)
        if not admitted or late < LATE_SHARE * admitted or s["method"] not in config.methods:
            continue
        outer = method_for(config, s["method"]).sync.outer
        if outer.momentum > 0:
            notes.append(
                f"note: {late:,} of {s['method']}'s {admitted:,} answers came late (after their "
                "round closed), and outer momentum carries each late delta on: with answers "
                "this late the merged delta as it is did better (--set sync.outer.lr=1.0 "
                "--set sync.outer.momentum=0.0; docs/results.md §12)"
            )
    return notes


def resumed_line(note: dict[str, Any]) -> str:
    """How a method of a resumed simulated run got where it is, for the final table."""
    if note["checkpoint"] is None:
        return "had no checkpoint to resume from: trained from the beginning"
    if note["finished"]:
        return f"had finished ({note['checkpoint']}): not run again"
    return (
        f"resumed from {note['checkpoint']} ({note['tokens']:,} tokens, t={note['t']:.1f}): "
        "not bit for bit the uninterrupted run"
    )


def models(summaries: list[dict[str, Any]], out: Path) -> str:
    """Where each method's global model is, and the commands that use it."""
    lines = [f"{s['method']} model: {out / s['checkpoint']}" for s in summaries if s["checkpoint"]]
    if not lines:
        return "no checkpoint written (the run stopped first): ddiloco export can recover one"
    use = f"ddiloco sample|eval {out}, ddiloco export {out} --out DIR"
    return "\n".join([*lines, f"use it: {use}"])
