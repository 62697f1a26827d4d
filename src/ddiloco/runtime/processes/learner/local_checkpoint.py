"""A learner's local checkpoint: its own state, so a resumed run continues where it stopped.

Every ``processes.learner_checkpoint_every`` seconds rank 0 saves what a newcomer would copy
from it (weights, the inner optimizer's moments, the step — the LR schedule's position —, the
data position, and the sync state: the fragments' base versions), between two steps, to
``<run>/processes/learners/learner-<m>/state-<step>.bin`` (:mod:`..state_file`: checked to
the byte, nothing pickled). The state's tensors are streamed into the save's temp file on the
training thread, between two steps (a consistent save with no copy of the state in memory:
one costs as much as the training itself, issue 28); hashing, fsync and the rename follow on
a thread of its own, one save at a time; a save that comes due while the last is still being
finished is skipped. ``ddiloco train --resume`` starts each learner from its
newest save; one of another model, method or fragment plan is refused naming the file, and
so is one of another run: a save is digested under a key derived from the run secret
(state_file.py's ``state_key``; the launcher keeps a run's secret across ``--resume``).
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any

from ddiloco.checkpoints.format import CheckpointError
from ddiloco.runtime.processes.state_file import Staged, StateFile
from ddiloco.runtime.run import RunSetup

log = logging.getLogger(__name__)

LEARNER_STATE = StateFile(
    b"DDLSTAT\0",
    1,
    ("identity", "trainer", "sync", "learner"),
    "learner checkpoint",
    prefix="state",
)


def learner_directory(home: Path, m: int) -> Path:
    """Where learner ``m`` of the run whose processes live in ``home`` keeps its saves."""
    return home / "learners" / f"learner-{m}"


def identity(setup: RunSetup, m: int) -> dict[str, Any]:
    """What a save must agree with to be resumed from: a different model, method or plan
    would load weights into the wrong places."""
    plan = setup.plan
    return {
        "learner": m,
        "model": setup.config.model,
        "method": setup.method.name,
        "fragments": plan.num_fragments,
        "plan_bytes": plan.total_bytes,
        "seq_len": setup.seq_len,
    }


def load_latest(
    directory: Path, expected: dict[str, Any], key: bytes | None = None
) -> dict[str, Any] | None:
    """The newest save's state, None if there is none; refused (naming the file) when it is
    damaged or another run's (digested under another key, or of another model or plan)."""
    found = LEARNER_STATE.latest(directory)
    return None if found is None else load_save(found[1], expected, key)


def load_save(path: Path, expected: dict[str, Any], key: bytes | None = None) -> dict[str, Any]:
    """The save at ``path``; refused (naming it) when it is damaged or another run's."""
    state = LEARNER_STATE.read(path, key)
    held = state["identity"]
    if not isinstance(held, dict):
        raise CheckpointError(path, "its identity is not a table")
    differ = {k: (held.get(k), v) for k, v in expected.items() if held.get(k) != v}
    if differ:
        said = ", ".join(f"{k} {a!r} (this run: {b!r})" for k, (a, b) in differ.items())
        raise CheckpointError(path, f"another run's state: {said}")
    return state


class LocalCheckpoints:
    """Saves one learner's state every ``every`` seconds (0: never), off the training thread."""

    def __init__(
        self, directory: Path, every: float, expected: dict[str, Any], key: bytes | None = None
    ) -> None:
        self.directory = directory
        self.key = key  # (state_file.state_key of the run secret)
        self.every = every
        self.identity = expected
        self.last = time.monotonic()
        self.thread: threading.Thread | None = None
        self.saved = 0
        self.skipped = 0
        self.failed: str | None = None  # the last failure, said once

    def due(self) -> bool:
        return self.every > 0 and time.monotonic() - self.last >= self.every

    def save(self, step: int, state: dict[str, Any]) -> None:
        """Stream ``state`` into its file now, and finish the save in the background
        (skipped if the last one is still being finished)."""
        self.last = time.monotonic()
        if self.thread is not None and self.thread.is_alive():
            self.skipped += 1
            return
        try:
            staged = LEARNER_STATE.stage(
                self.directory, step, {"identity": self.identity, **state}, self.key
            )
        except CheckpointError as exc:  # disk full: training goes on, the failure is said
            self._failed(exc)
            return
        self.thread = threading.Thread(
            target=self._publish, args=(staged,), name="learner-checkpoint", daemon=True
        )
        self.thread.start()

    def _publish(self, staged: Staged) -> None:
        try:
            LEARNER_STATE.publish(staged, self.key)
        except CheckpointError as exc:
            self._failed(exc)
            return
        self.saved += 1

    def _failed(self, exc: CheckpointError) -> None:
        if str(exc) != self.failed:
            log.error("learner checkpoint failed: %s", exc)
        self.failed = str(exc)

    def close(self, timeout: float = 30.0) -> None:
        """Wait for a write under way (a clean stop keeps its last save whole)."""
        if self.thread is not None:
            self.thread.join(timeout)
