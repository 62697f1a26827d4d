"""``ddiloco train``: run an experiment and write its run directory.

With no arguments it runs the embedded demo: 4 learners train a ~0.9M-parameter GPT on
Shakespeare with Decoupled DiLoCo under a chaos plan (a crash with peer recovery, a
straggler), then data-parallel on the same tokens, and prints a side-by-side table.

Under ``--runtime processes`` a pre-flight check refuses a model or data set that cannot
train before any process starts; a process that keeps failing stops the run with its log's
last lines and exit status 2 (as every error); the first SIGINT or SIGTERM stops the run
cleanly (the syncer's final evaluation and summary, then summary.json and the plots as at
a normal end) and exits 128 + the signal (130 for Ctrl-C, 143 for SIGTERM), a second one
kills every process at once and exits 130 with no summary.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import random
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ddiloco.chaos.plan import ChaosEvent, ChaosGenerators, expand, load_plan, to_json
from ddiloco.checkpoints.write import CheckpointWriter
from ddiloco.commands import add_config_arguments
from ddiloco.config import RUNTIMES, WALL_CLOCK_RUNTIMES, RunConfig, load_config, to_toml
from ddiloco.data.corpus import TokenSplits
from ddiloco.errors import ConfigError
from ddiloco.methods import method_for
from ddiloco.report.metrics import write_json
from ddiloco.report.run_writer import RunWriter, finish
from ddiloco.report.text import human_bytes, table
from ddiloco.runtime.contract import assemble, check_contract
from ddiloco.runtime.resume import end_line, last_time, refuse_reuse, resumed_config
from ddiloco.runtime.run import RunSetup
from ddiloco.runtime.sim.data_parallel import DataParallelSim
from ddiloco.runtime.sim.engine import FragmentSim
from ddiloco.runtime.sim.restart import Resume, find_resume

if TYPE_CHECKING:
    from ddiloco.runtime.processes.launcher.data_parallel import DataParallelJob
    from ddiloco.runtime.processes.launcher.fragments import Launcher

# What --runtime processes runs: every fragment method (syncer + learner processes) and the
# data-parallel baseline (torchrun DDP); elastic_dp only on the simulated clock.
PROCESS_METHODS = ("decoupled", "decoupled_sync", "streaming", "diloco", "data_parallel")
RAY_METHODS = PROCESS_METHODS[:-1]  # the fragment methods (no data-parallel job on Ray yet)

DEMO_CHAOS = (
    ChaosEvent(at=60.0, kind="crash", learner=1, duration=40.0),
    ChaosEvent(at=20.0, kind="slow", learner=3, duration=0.0, factor=1.3),  # to the end
)


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
        runnable = PROCESS_METHODS if config.runtime == "processes" else RAY_METHODS
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
    out.mkdir(parents=True, exist_ok=True)
    from ddiloco.runtime.processes.launcher.supervision import LaunchError

    try:
        summaries = train(config, out, quiet=args.quiet, resume=bool(args.resume))
    except LaunchError as exc:
        print(exc.details(), file=sys.stderr, flush=True)
        raise  # the cli's one-line error, exit status 2
    except KeyboardInterrupt:
        print(f"\nddiloco train: killed, no summary (run directory: {out})", file=sys.stderr)
        return 128 + signal.SIGINT
    print()
    print(render(summaries))
    print(f"\nrun directory: {out}")
    print(models(summaries, out))
    stopped = next((s["stop_signal"] for s in summaries if s.get("stop_signal")), None)
    if stopped:
        print(f"stopped early by {stopped}: summary.json and the plots cover the run so far")
        return 128 + int(signal.Signals[stopped])
    return 0


def train(
    config: RunConfig, out: Path, quiet: bool = False, resume: bool = False
) -> list[dict[str, Any]]:
    """Run every method of ``config``; write config, chaos plan, metrics, summary, plots.
    ``resume``: continue the run in ``out`` (:mod:`ddiloco.runtime.resume`)."""
    torch.set_num_threads(max(1, min(torch.get_num_threads(), 2)))
    processes = config.runtime in WALL_CLOCK_RUNTIMES
    if processes:  # refuse what cannot train before any process starts (or crash-loops)
        from ddiloco.runtime.processes.launcher import preflight

        seq_len = preflight.check(config, config.methods[0]).seq_len
    else:  # the same model contract on the simulated clock, before the first method
        setup = assemble(config, config.methods[0])
        check_contract(setup)
        seq_len = setup.seq_len
    if processes and not resume:
        refuse_reuse(out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time() - last_time(out) if resume else None  # times go on from the last record
    if not resume:  # a resume keeps the first launch's config and chaos plan
        (out / "config.toml").write_text(to_toml(config), encoding="utf-8")
        config = with_expanded_chaos(config, seq_len)
        write_json(out / "chaos_plan.json", to_json(config.chaos))
    if not processes:  # each process splits the corpus on its own
        splits, evals = setup.splits, setup.eval_batches  # split once, for every method
        del setup  # the contract's model: every method builds its own
    # a simulated run resumes each method from its newest checkpoint, all checked first
    restarts = sim_restarts(config, out) if resume and not processes else {}
    if resume:
        end_line(out)
    writer = RunWriter(out, config, quiet=quiet, append=resume)
    summaries = []
    try:
        for method in config.methods:
            writer.begin(method)

            def emit(record: dict[str, Any], method: str = method) -> None:
                writer.emit(record)
                if record["kind"] == "exited" and record["code"] and not record["gave_up"]:
                    print(exited_line(method, record), file=sys.stderr, flush=True)

            started = time.monotonic()
            if processes:
                job = process_job(config, method, out, emit, resume, t0)
                with stopping_on_signals(job):
                    summary = job.run()
            elif resume:
                restart = restarts[method]
                note = restart.note(out) if restart else dict(FROM_SCRATCH)
                emit({"kind": "resume", **note})
                summary = run_method(config, method, splits, evals, emit, out, restart)
                summary["resumed_from"] = note
            else:
                summary = run_method(config, method, splits, evals, emit, out)
            summary["wall_seconds"] = time.monotonic() - started
            summaries.append(summary)
            writer.ended(summary)
            if summary.get("stop_signal"):
                break  # the user stopped the run: not the next method either
    finally:
        writer.close()
    finish(out, summaries)
    return summaries


def process_job(
    config: RunConfig,
    method: str,
    out: Path,
    emit: Callable[[dict[str, Any]], None],
    resume: bool = False,
    t0: float | None = None,
) -> Launcher | DataParallelJob:
    """One method's real processes: a syncer and learners, or a torchrun DDP job."""
    if config.runtime == "ray":
        from ddiloco.runtime.processes.ray.launcher import RayLauncher

        return RayLauncher(config, method, out, emit, resume=resume, t0=t0)
    if method_for(config, method).fragments:
        from ddiloco.runtime.processes.launcher.fragments import Launcher

        return Launcher(config, method, out, emit, resume=resume, t0=t0)
    from ddiloco.runtime.processes.launcher.data_parallel import DataParallelJob

    return DataParallelJob(config, method, out, emit, resume=resume, t0=t0)


@contextlib.contextmanager
def stopping_on_signals(launcher: Launcher | DataParallelJob) -> Iterator[None]:
    """While the launcher runs, SIGINT and SIGTERM go to :meth:`Launcher.interrupt` (the
    first: a clean stop; the second: kill), not to a KeyboardInterrupt or a sudden death
    that would orphan its processes. Only the main thread can take signals."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, _frame: object) -> None:
        launcher.interrupt(signum)

    # a signal ignored from the start stays ignored (a background job's SIGINT, as Python does)
    sigs = [s for s in (signal.SIGINT, signal.SIGTERM) if signal.getsignal(s) != signal.SIG_IGN]
    old = {s: signal.signal(s, handler) for s in sigs}
    try:
        yield
    finally:
        for s, previous in old.items():
            signal.signal(s, previous)


def exited_line(method: str, r: dict[str, Any]) -> str:
    """A process that exited on its own, for the terminal: what it said, what happens next."""
    from ddiloco.runtime.processes.launcher.supervision import describe

    said = f" ({r['reason']})" if r.get("reason") else ""
    if r["restart"]:
        then = f"restarting in {r['delay']:.1f}s (failure {r['failures']} in a row)"
    else:  # (one given up is told by the LaunchError, with its log)
        then = "giving up" if r["gave_up"] else "not restarted"
    return (
        f"[t={r['t']:8.1f}] {method:<14} {r['process']} exited with {describe(r['code'])}"
        f"{said}: {then}"
    )


def with_expanded_chaos(config: RunConfig, seq_len: int) -> RunConfig:
    """The config with its chaos plan expanded into explicit events (or replayed from a
    chaos_plan.json), generators switched off so nothing is generated twice."""
    if config.chaos_plan:
        events = load_plan(config.chaos_plan)
    else:
        t = config.train
        horizon = config.chaos_gen.horizon_seconds
        if horizon == 0:  # twice the failure-free duration of the slowest learner
            steps = t.tokens / (t.learners * t.batch_size * t.grad_accum * seq_len)
            slowest = max(config.hardware.speed, default=1.0)
            horizon = 2.0 * steps * config.hardware.step_seconds * slowest
        rng = random.Random(config.seed * 7919 + 17)
        events = expand(config.chaos, config.chaos_gen, t.learners, t.scavenged, horizon, rng)
    return dataclasses.replace(config, chaos=events, chaos_gen=ChaosGenerators(), chaos_plan="")


def run_method(
    config: RunConfig,
    method: str,
    splits: TokenSplits,
    evals: list[tuple[torch.Tensor, torch.Tensor]],
    emit: Callable[[dict[str, Any]], None],
    out: Path | None = None,
    resume: Resume | None = None,
) -> dict[str, Any]:
    """One method on the simulated clock (writing its checkpoints into run ``out``), from
    the start or from the checkpoint ``resume``."""
    setup = RunSetup(config, method, splits_given=splits, evals_given=evals)
    writer = None
    if out is not None:
        writer = CheckpointWriter(
            setup, out, tokens=int(resume.manifest["tokens"]) if resume else 0
        )
        writer.last = resume.checkpoint if resume else None
    if setup.method.fragments:
        return FragmentSim(setup, emit, writer, resume).run()
    return DataParallelSim(setup, emit, writer, resume).run()


# the resume record and summary note of a method that had no checkpoint to resume from
FROM_SCRATCH = {"checkpoint": None, "step": 0, "tokens": 0, "t": 0.0, "finished": False}


def sim_restarts(config: RunConfig, out: Path) -> dict[str, Resume | None]:
    """Every method's checkpoint to resume from (checked), saying for each what happens."""
    plan = load_plan(out / "chaos_plan.json") if (out / "chaos_plan.json").is_file() else ()
    found = {m: find_resume(out, config, m, plan) for m in config.methods}
    for method, r in found.items():
        if r is None:
            print(f"{method}: no checkpoint to resume from: it starts from the beginning")
        elif r.finished:
            print(f"{method}: finished ({r.where(out)}): not run again")
        else:
            print(
                f"{method}: resuming from {r.where(out)} ({r.tokens:,} tokens, "
                f"t={r.t:.1f} virtual s); not bit for bit the uninterrupted run"
            )
    return found


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
    horizon = summaries[0].get("equal_time_seconds", summaries[0]["virtual_seconds"])
    text = table(
        [
            "method",
            "eval loss",
            f"at {horizon:.0f} {clock}",
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
    text += (
        f"\n(eval loss: at equal tokens; at {horizon:.0f} {clock}: when {summaries[0]['method']}"
        " finished, between evaluations)"
    )
    for s in summaries:
        if s.get("resumed_from"):
            text += f"\n{s['method']} {resumed_line(s['resumed_from'])}"
    for s in summaries:
        if s["tokens_wasted"]:
            text += f"\n{s['method']} wasted tokens by reason: " + json.dumps(
                {k: round(v) for k, v in s["tokens_wasted"].items()}
            )
    return text


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
