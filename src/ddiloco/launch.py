"""The library entry point: :func:`train` runs an experiment and writes its run directory,
as ``ddiloco train`` does (the command parses its arguments and calls this).

    import ddiloco
    summaries = ddiloco.train("configs/smoke.toml", "runs/smoke", overrides=["train.tokens=20000"])

Every method of the config runs in turn, on the config's runtime (``sim``: the simulated
clock in this process; ``processes``/``ray``: real processes, watched until they end); each
method's summary comes back as a dict (the schema of ``summary.json``), and the run
directory holds the config, the chaos plan, ``metrics.jsonl``, ``summary.json``, the plots
and the checkpoints (``runtime/layout.py`` says where each file lives).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import random
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ddiloco.chaos.plan import ChaosEvent, ChaosGenerators, expand, load_plan, to_json
from ddiloco.checkpoints.write import CheckpointWriter
from ddiloco.config import WALL_CLOCK_RUNTIMES, RunConfig, load_config, to_toml
from ddiloco.data.corpus import TokenSplits
from ddiloco.errors import ConfigError, require
from ddiloco.methods import method_for
from ddiloco.report.metrics import write_json
from ddiloco.report.run_writer import RunWriter, finish
from ddiloco.runtime.contract import assemble, check_contract
from ddiloco.runtime.resume import (
    carry_bytes,
    end_line,
    finished_methods,
    held_summaries,
    last_time,
    refuse_reuse,
    resumed_config,
    write_back,
)
from ddiloco.runtime.run import RunSetup
from ddiloco.runtime.sim.data_parallel import DataParallelSim
from ddiloco.runtime.sim.engine import FragmentSim
from ddiloco.runtime.sim.restart import Resume, find_resume

if TYPE_CHECKING:
    from ddiloco.runtime.processes.launcher.data_parallel import DataParallelJob
    from ddiloco.runtime.processes.launcher.fragments import Launcher

DEMO_CHAOS = (  # the demo's (the embedded default config's): a crash with peer recovery and
    ChaosEvent(at=60.0, kind="crash", learner=1, duration=40.0),  # a straggler
    ChaosEvent(at=20.0, kind="slow", learner=3, duration=0.0, factor=1.3),  # to the end
)


def _fragment_processes_only(config: RunConfig, key: str, value: str, what: str) -> None:
    """``key = value`` is for the fragment methods on learner processes: refuse the
    simulated clock and the data-parallel baseline, saying ``what`` the option does."""
    require(
        config.runtime in WALL_CLOCK_RUNTIMES,
        key,
        value,
        f"{what}: set runtime to one of {WALL_CLOCK_RUNTIMES}",
    )
    for name in config.methods:
        require(
            method_for(config, name).fragments,
            "methods",
            name,
            f"{key} is for the fragment methods only ({what}); this baseline trains with "
            f"ddiloco's own loop as a DDP job: drop it from methods, or unset {key}",
        )


def check_parallel(config: RunConfig) -> None:
    """``train.parallel = "fsdp"`` shards the fragment methods' learner processes; the
    simulated clock has no ranks, and the data-parallel baseline is a DDP job."""
    if config.train.parallel != "ddp":
        _fragment_processes_only(
            config, "train.parallel", config.train.parallel, "it shards learner processes"
        )


def check_entry(config: RunConfig) -> None:
    """``train.entry`` (a user's own loop as every learner) runs on learner processes, for the
    fragment methods: the simulated clock and the data-parallel baseline train with ddiloco's
    own loop, which would not be the user's."""
    if config.train.entry:
        _fragment_processes_only(
            config, "train.entry", config.train.entry, "it runs your loop as learner processes"
        )


def train(
    config: RunConfig | str | os.PathLike[str] | None = None,
    out: str | os.PathLike[str] | None = None,
    quiet: bool = False,
    resume: bool = False,
    *,
    overrides: Sequence[str] = (),
) -> list[dict[str, Any]]:
    """Run every method of ``config`` and return their summaries; write the config, the chaos
    plan, metrics, summary and plots into ``out``.

    ``config``: a :class:`RunConfig`, a TOML file, or None for the embedded default;
    ``overrides``: ``key=value`` strings as ``--set`` takes them (with a file or None).
    ``out``: the run directory (default ``runs/<name>-<time>``). ``quiet``: no live progress
    lines. ``resume``: continue the run in ``out`` (its own config: ``config`` must be the
    one it was started with; :mod:`ddiloco.runtime.resume`; the overrides it accepts are
    written back to ``out/config.toml``, and summary.json never goes back to fewer tokens).

    A Ctrl-C (KeyboardInterrupt) after a method finished raises :class:`Interrupted` once
    summary.json and the plots hold the methods that finished. A start refused after the
    run directory was made (a chaos plan, a missing TensorBoard) removes it if this call
    made it."""
    if resume and config is None:  # the run's own config, changed by the overrides it allows
        if out is None:
            raise ConfigError("out", None, "a resume needs the run directory to continue")
        config = resumed_config(Path(out), list(overrides))
    elif isinstance(config, RunConfig):
        if overrides:
            why = "apply them to a TOML file or the default (a RunConfig: dataclasses.replace)"
            raise ConfigError("overrides", list(overrides), why)
    else:
        demo = config is None and not any(o.split("=", 1)[0].strip().startswith("chaos")
                                          for o in overrides)  # fmt: skip
        config = load_config(None if config is None else str(config), list(overrides))
        if demo:  # the embedded default is the demo, its chaos included (ddiloco train)
            config = dataclasses.replace(config, chaos=DEMO_CHAOS)
    out = Path(out or f"runs/{config.name}-{time.strftime('%Y%m%d-%H%M%S')}")
    torch.set_num_threads(max(1, min(torch.get_num_threads(), 2)))
    processes = config.runtime in WALL_CLOCK_RUNTIMES
    check_entry(config)
    check_parallel(config)
    if processes:  # refuse what cannot train before any process starts (or crash-loops)
        from ddiloco.runtime.processes.launcher import preflight

        seq_len = preflight.check(config, config.methods[0]).seq_len
    else:  # the same model contract on the simulated clock, before the first method
        setup = assemble(config, config.methods[0])
        check_contract(setup)
        seq_len = setup.seq_len
    if processes and not resume:
        refuse_reuse(out)
    # (a chaos plan that cannot be read is refused before the run directory is made)
    expanded = config if resume else with_expanded_chaos(config, seq_len)
    made = first_missing(out)  # (a start refused from here on takes it away again)
    out.mkdir(parents=True, exist_ok=True)
    try:
        # a resumed method's times go on from its last record; a method that never ran
        # before starts its clock at 0, as in a first launch
        resumed_at = {m: last_time(out, m) for m in config.methods} if resume else {}
        if resume:  # a later resume trains to the budget this one was given
            for change in write_back(out, config):
                print(f"{out / 'config.toml'}: {change} (this resume's --set, kept for the next)")
        else:  # a resume keeps the first launch's config and chaos plan
            (out / "config.toml").write_text(to_toml(config), encoding="utf-8")
            config = expanded
            write_json(out / "chaos_plan.json", to_json(config.chaos))
        if not processes:  # each process splits the corpus on its own
            splits, evals = setup.splits, setup.eval_batches  # split once, for every method
            del setup  # the contract's model: every method builds its own
        # a simulated run resumes each method from its newest checkpoint, all checked first
        restarts = sim_restarts(config, out) if resume and not processes else {}
        # ... real processes from their stores, except a method that reached the budget
        held = held_summaries(out) if resume and processes else {}
        finished = finished_methods(held, config) if held else {}
        if resume:
            end_line(out)
        starts = {m: r.tokens for m, r in restarts.items() if r is not None}
        starts.update({m: int(s["tokens"]) for m, s in finished.items()})
        writer = RunWriter(
            out,
            config,
            quiet=quiet,
            append=resume,
            methods=config.methods,
            virtual=not processes,
            starts=starts,
        )
    except BaseException:
        if made is not None:  # nothing of the user's: the run never started
            shutil.rmtree(made, ignore_errors=True)
        raise
    summaries: list[dict[str, Any]] = []
    running = None  # the method a signal interrupted
    try:
        for method in config.methods:
            if method in finished:  # (its summary stays as summary.json holds it)
                summaries.append(finished[method])
                continue
            writer.begin(method)

            def emit(record: dict[str, Any], method: str = method) -> None:
                writer.emit(record)
                if record["kind"] == "exited" and record["code"] and not record["gave_up"]:
                    if writer.progress.quiet:  # (a failure is said even then)
                        line = f"[t={record['t']:8.1f}] {method:<14} {exited_line(record)}"
                        print(line, file=sys.stderr, flush=True)
                    else:  # in the progress lines' shape, under a terminal's live line
                        writer.progress.say(exited_line(record))

            started = time.monotonic()
            if processes:
                t0 = None  # (its clock starts with it)
                if resumed_at.get(method):  # where its records go on (the plots break there)
                    emit({"kind": "resume", "t": resumed_at[method]})
                    t0 = time.time() - resumed_at[method]
                job = process_job(config, method, out, emit, resume, t0)
                with stopping_on_signals(job):
                    summary = job.run()
                carry_bytes(summary, held.get(method))
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
    except KeyboardInterrupt:
        if not summaries:
            raise  # (the command: killed, no summary)
        done = {s["method"] for s in summaries}  # (methods run in order: the first not done)
        running = next((m for m in config.methods if m not in done), None)
    finally:
        writer.close()
    kept = finish(out, summaries, resumed=resume, interrupted=running)
    if running is not None:  # the methods that finished keep their summary
        raise Interrupted(running, kept, [s["method"] for s in summaries])
    return kept


class Interrupted(KeyboardInterrupt):
    """A signal (Ctrl-C) stopped the run during ``method`` after the methods before it had
    finished (``finished``): summary.json and the plots hold their summaries
    (``summaries``; on a resume also a method's summary from an earlier launch)."""

    def __init__(self, method: str, summaries: list[dict[str, Any]], finished: list[str]) -> None:
        super().__init__(method)
        self.method = method
        self.summaries = summaries
        self.finished = finished


def first_missing(path: Path) -> Path | None:
    """The topmost directory of ``path`` that does not exist yet (None if it does): what a
    ``mkdir -p`` makes, so all a refused start may remove."""
    if path.exists():
        return None
    while not path.parent.exists() and path.parent != path:
        path = path.parent
    return path


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


def exited_line(r: dict[str, Any]) -> str:
    """A process that exited on its own, for the terminal: what it said, what happens next."""
    from ddiloco.runtime.processes.launcher.supervision import describe

    said = f" ({r['reason']})" if r.get("reason") else ""
    if r["restart"]:
        then = f"restarting in {r['delay']:.1f}s (failure {r['failures']} in a row)"
    else:  # (one given up is told by the LaunchError, with its log)
        then = "giving up" if r["gave_up"] else "not restarted"
    return f"{r['process']} exited with {describe(r['code'])}{said}: {then}"


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
