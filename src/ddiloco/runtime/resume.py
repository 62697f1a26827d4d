"""``ddiloco train --resume RUN``: continue a stopped or crashed run in its own directory.

The run's resolved config (``RUN/config.toml``) is the config; ``--set`` may change only what
does not change what was trained: the budget (``train.tokens``, ``train.max_virtual_seconds``),
evaluation and checkpoint cadence, and how processes are supervised (``processes.*`` except
``processes.ranks``). A change to anything else (the model, the data, the methods, the seed,
the fragment plan, the learners) is refused naming the key: the saved states would not fit it.

Under ``--runtime processes`` the syncer continues from its durable store and each learner
from its newest local checkpoint (else a healthy peer, else the global fragments); the data-
parallel baseline from its newest rollback checkpoint. Event times continue from the last
record of ``metrics.jsonl``, which is appended to. The chaos plan is not played again (its
times are the first launch's). The simulated clock does not resume: it is deterministic, so
the same config and seed run it again to the same result.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from ddiloco.chaos.plan import ChaosGenerators
from ddiloco.config import RunConfig, load_config
from ddiloco.errors import ConfigError

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
    "chaos",
    "chaos_gen",
    "chaos_plan",
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
    if before.runtime != "processes":
        why = (
            "the simulated clock does not resume: it is deterministic, so run the same "
            "config and seed again (it gives the same run)"
        )
        raise ConfigError("--resume", str(run), why)
    for key, old, new in _changes(before, after):
        if not _changeable(key):
            raise ConfigError(key, new, f"cannot change on resume (the run has {old!r})")
    # the plan's times are the first launch's: a resume plays no chaos
    return dataclasses.replace(after, chaos=(), chaos_gen=ChaosGenerators(), chaos_plan="")


def last_time(run: Path) -> float:
    """The time of the run's last metrics record (events of the resumed run continue from
    it), 0 if there is none."""
    path = run / METRICS
    if not path.is_file():
        return 0.0
    last = 0.0
    with path.open(encoding="utf-8") as f:
        for line in f:
            try:
                t = json.loads(line).get("t")
            except ValueError:  # a line cut by the crash: the records before it stand
                continue
            if isinstance(t, int | float):
                last = max(last, float(t))
    return last


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
