"""``ddiloco train --resume RUN``: continue a stopped or crashed run in its own directory.

The run's resolved config (``RUN/config.toml``) is the config; ``--set`` may change only what
does not change what was trained: the budget (``train.tokens``, ``train.max_virtual_seconds``),
evaluation and checkpoint cadence, and how processes are supervised (``processes.*`` except
``processes.ranks``). A change to anything else (the model, the data, the methods, the seed,
the fragment plan, the learners) is refused naming the key: the saved states would not fit it.
``metrics.jsonl`` is appended to, never truncated. What ``--set`` changed is written back to
``RUN/config.toml`` before training starts (:func:`write_back`), so a later resume trains to
the raised budget, not the first launch's; and a resume never takes ``summary.json`` back to
fewer tokens than it holds (:func:`ddiloco.report.run_writer.finish` keeps the summary with
more tokens, saying so on stderr). Evaluations stay on the run's cadence: the simulated clock
keeps the next evaluation due in each checkpoint's state.

Under ``--runtime processes`` the syncer continues from its durable store and each learner
from its newest local checkpoint (else a healthy peer, else the global fragments); the data-
parallel baseline from its newest rollback checkpoint. Event times continue from the last
record of ``metrics.jsonl``. The chaos plan is not played again (its times are the first
launch's).

On the simulated clock each method restarts from its newest checkpoint
(``RUN/checkpoints[/<method>]/step-N``, :mod:`ddiloco.runtime.sim.restart`): every file is
checked first, and a damaged one (or one without the resume state this build writes) is
refused naming the file, with the older checkpoint to fall back on by removing it; nothing is
skipped silently. A method whose newest checkpoint is its final one at the budget is not run
again (its summary is rebuilt from that checkpoint); one with no checkpoint starts from the
beginning, saying so. A ``resume`` record (checkpoint, step, tokens, virtual time) starts each
method's records of the resumed launch, and its summary has ``resumed_from``.

What a simulated resume restores: the global model (the syncer's fragments), the outer
optimizers' momentum, the round counters (fragment versions, round ids, the global step, the
grace-window averages, the outlier norm windows), the token ledger, the step-time generator,
the run's totals (tokens, bytes, idle, down and up time) and the virtual time, all as they were
at the checkpoint; the budget counts the tokens trained by then. Every learner present then
starts from the global model, as after a recovery from the syncer's fragments, at its own step,
learning-rate step and data position. What is lost, so a resumed run is *not* bit for bit the
uninterrupted one (same config and seed: the same resumed run, though): each learner's local
progress since its last merged fragment and the answers in flight (wasted as ``resumed`` in the
ledger), the learners' inner optimizer state (AdamW moments: fresh), the rounds open at the
checkpoint (their fragments are asked again at their next due step), the queues on the links,
and whatever a crash, freeze, preemption or join had left in progress (every allocated learner
is up at the checkpoint's time; a slowdown or link fault still in effect is struck again for
the rest of its duration, and every later event of ``chaos_plan.json`` strikes on time).
Data-parallel keeps its model, step, data position and totals (AdamW: fresh; elastic: a
replica on its way back is live at once). The abandoned launch's work after the checkpoint is
not counted anywhere: its records stay in ``metrics.jsonl`` (before the ``resume`` record),
and the equal-time comparison leaves its evaluations out.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

from ddiloco.chaos.plan import ChaosGenerators
from ddiloco.config import RunConfig, load_config, to_toml
from ddiloco.errors import ConfigError
from ddiloco.report.metrics import method_summaries

CONFIG = "config.toml"
METRICS = "metrics.jsonl"
# what a resume may change: how long, how often it reports, how processes are supervised
CHANGEABLE = (
    "train.tokens",
    "train.max_virtual_seconds",
    "train.eval_every",
    "train.checkpoint_every",
    "data.eval_batches",
    "name",
)
# a resume plays no chaos of its own: it would be ignored, so it is refused
CHAOS_KEYS = ("chaos", "chaos_gen", "chaos_plan")
CHAOS_WHY = (
    "a resume plays no new chaos (processes: none, its plan's times were the first launch's; "
    "simulated clock: the rest of the run's own chaos_plan.json); start a new run for another"
)
CHANGEABLE_TABLES = ("processes",)
FIXED_IN_TABLES = ("processes.ranks",)


def resumed_config(run: Path, overrides: list[str]) -> RunConfig:
    """``run``'s config with ``overrides``; refused if the run cannot be resumed or an
    override changes what its saved states were trained with."""
    path = run / CONFIG
    if not path.is_file():
        raise ConfigError("--resume", str(run), f"no {CONFIG}: not a ddiloco run directory")
    before = load_config(path)
    after = load_config(path, overrides)
    for key, old, new in _changes(before, after):
        if key in CHAOS_KEYS:
            raise ConfigError(key, new, CHAOS_WHY)
        if not _changeable(key):
            raise ConfigError(key, new, f"cannot change on resume (the run has {old!r})")
    # processes: the plan's times are the first launch's, a resume plays no chaos; the
    # simulated clock replays the rest of its chaos_plan.json (ddiloco.runtime.sim.restart)
    return dataclasses.replace(after, chaos=(), chaos_gen=ChaosGenerators(), chaos_plan="")


def write_back(run: Path, config: RunConfig) -> list[str]:
    """Write what a resume changed (``config``, the run's config with the overrides it
    accepted) into ``run``'s config.toml, its chaos as the first launch had it; return each
    change as ``key: old -> new``. A change a resume does not accept is refused."""
    path = run / CONFIG
    before = load_config(path)
    after = dataclasses.replace(
        config, chaos=before.chaos, chaos_gen=before.chaos_gen, chaos_plan=before.chaos_plan
    )
    changes = _changes(before, after)
    for key, old, new in changes:
        if not _changeable(key):
            raise ConfigError(key, new, f"cannot change on resume (the run has {old!r})")
    if changes:
        part = path.with_name(CONFIG + ".part")  # (a crash mid-write leaves the old one)
        part.write_text(to_toml(after), encoding="utf-8")
        os.replace(part, path)
    return [f"{key}: {old!r} -> {new!r}" for key, old, new in changes]


def finished_methods(held: dict[str, dict[str, Any]], config: RunConfig) -> dict[str, Any]:
    """The methods of a run's summaries (``held``: :func:`held_summaries`) that trained to
    ``config``'s budget and were not stopped early (each one's summary), said on the terminal:
    a resume of real processes does not start them again (a simulated run tells the same from
    its final checkpoints)."""
    done = {}
    for method in config.methods:
        s = held.get(method)
        if (
            isinstance(s, dict)
            and isinstance(s.get("tokens"), int)
            and s["tokens"] >= config.train.tokens
            and not s.get("stop_signal")
        ):
            done[method] = s
            print(
                f"{method}: finished ({s['tokens']:,} tokens of {config.train.tokens:,}): "
                "not run again"
            )
    return done


def held_summaries(run: Path) -> dict[str, dict[str, Any]]:
    """Each method's summary in ``run``'s summary.json ({} if there is none or it is
    unreadable: every method then resumes from its own state)."""
    return method_summaries(run) or {}


def carry_bytes(summary: dict[str, Any], before: dict[str, Any] | None) -> None:
    """A resumed real-process method's byte counts go on from its earlier launches' (its
    syncer counts from its own start): the earlier summary's, where one was written (a launch
    killed with no summary is missing from them)."""
    for key in ("bytes_sent", "bytes_received"):
        if before and isinstance(before.get(key), int) and isinstance(summary.get(key), int):
            summary[key] += before[key]
    if "bytes_per_token" in summary:  # (over the run's tokens, every launch's)
        moved = summary.get("bytes_sent", 0) + summary.get("bytes_received", 0)
        summary["bytes_per_token"] = moved / max(int(summary.get("tokens", 0)), 1)


def last_time(run: Path, method: str | None = None) -> float:
    """The time of the run's last metrics record (of ``method``'s, when given: events of the
    resumed run continue from it), 0 if there is none."""
    path = run / METRICS
    if not path.is_file():
        return 0.0
    last = 0.0
    with path.open(encoding="utf-8") as f:
        for line in f:
            try:
                record = json.loads(line)
            except ValueError:  # a line cut by the crash: the records before it stand
                continue
            if not isinstance(record, dict) or method not in (None, record.get("method")):
                continue
            t = record.get("t")
            if isinstance(t, int | float):
                last = max(last, float(t))
    return last


def end_line(run: Path) -> None:
    """Before a resumed run appends to ``metrics.jsonl``: a last line cut by the crash is
    ended, so the first new record starts a line of its own (the cut one is kept as it is,
    and readers skip it)."""
    path = run / METRICS
    if not path.is_file() or path.stat().st_size == 0:
        return
    with path.open("rb") as f:
        f.seek(-1, 2)
        if f.read(1) == b"\n":
            return
    with path.open("ab") as f:
        f.write(b"\n")


def refuse_reuse(out: Path) -> None:
    """A fresh run must not land in a directory holding one: its syncer would silently
    continue from the old store while everything else starts anew."""
    held = [p for p in (out / "processes").glob("**/syncer_state") if any(p.iterdir())]
    if held:
        why = f"holds a run ({held[0]}): continue it with --resume {out}, or use another --out"
        raise ConfigError("--out", str(out), why)


def _changes(a: Any, b: Any, prefix: str = "") -> list[tuple[str, Any, Any]]:
    found: list[tuple[str, Any, Any]] = []
    for f in dataclasses.fields(a):
        key, x, y = f"{prefix}{f.name}", getattr(a, f.name), getattr(b, f.name)
        if dataclasses.is_dataclass(x) and not isinstance(x, type) and f.name != "chaos_gen":
            found += _changes(x, y, key + ".")
        elif x != y:
            found.append((key, x, y))
    return found


def _changeable(key: str) -> bool:
    if key in FIXED_IN_TABLES:
        return False
    return key in CHANGEABLE or key.split(".")[0] in CHANGEABLE_TABLES
