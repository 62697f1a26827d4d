"""Where a run's files live: the one place every runtime writes them and every tool (export,
eval, status, resume) finds them, so a tool never imports a launcher to learn a path.

``<run>/`` holds ``metrics.jsonl``, ``summary.json`` and ``checkpoints/`` (``ddiloco.checkpoints``
owns that tree). A processes run keeps each method's processes in a home of its own: the
config they were started with, their logs, the syncer's durable store (a fragment method) or
the torchrun job's rollback checkpoints (data-parallel), the run secret.
"""

from __future__ import annotations

from pathlib import Path

PROCESSES = "processes"  # <run>/processes: the processes runtime's homes
STORE = "syncer_state"  # a fragment method's syncer store, in its home
ROLLBACK = "checkpoints"  # the data-parallel job's rollback checkpoints, in its home
SECRET = "run.secret"  # a fragment method's run secret (0600), in its home


def processes_home(run: Path, method: str) -> Path:
    """Where ``method``'s processes keep their config, logs and state: ``decoupled`` (the
    main method) in ``<run>/processes``, every other method in a folder of its own (a syncer
    store is one method's: another method's syncer would refuse it)."""
    home = Path(run) / PROCESSES
    return home if method == "decoupled" else home / method


def syncer_store(run: Path, method: str) -> Path:
    """A fragment method's syncer store in run ``run``."""
    return processes_home(run, method) / STORE


def rollback_checkpoints(run: Path, method: str) -> Path:
    """The data-parallel job's rollback checkpoints in run ``run``."""
    return processes_home(run, method) / ROLLBACK


def run_secret(run: Path, method: str) -> Path:
    """The run secret ``method``'s processes were started with (a fragment method's; the
    syncer authenticates its checkpoints with a key derived from it)."""
    return processes_home(run, method) / SECRET
