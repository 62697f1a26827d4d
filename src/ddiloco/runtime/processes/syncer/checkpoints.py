"""Where the syncer's checkpoints of the global model go (docs/checkpoints.md): the writer
itself is :class:`ddiloco.checkpoints.write.CheckpointWriter`, which copies the fragments
between two merges and writes them on a thread of its own."""

from __future__ import annotations

from pathlib import Path

from ddiloco.checkpoints.format import manifest_key
from ddiloco.checkpoints.write import CheckpointWriter
from ddiloco.runtime.layout import processes_home
from ddiloco.runtime.run import RunSetup


def checkpoint_writer(
    setup: RunSetup, store: Path, run: Path | None, tokens: int, secret: bytes
) -> CheckpointWriter:
    """The syncer's checkpoint writer: into ``run`` when given, else into the run directory
    the launcher put the store in (``<run>/processes[/<method>]/syncer_state``), else (a
    syncer started by hand) beside the store, in ``<store>-checkpoints/``. Every manifest
    is authenticated under a key derived from the run ``secret`` (checkpoints/format.py)."""
    key = manifest_key(secret)
    method = setup.method_name
    if run is None:
        run = next(
            (r for r in store.parents if processes_home(r, method) / store.name == store), None
        )
    if run is None:
        home = store.with_name(f"{store.name}-checkpoints")
        return CheckpointWriter(setup, store.parent, home, tokens, key=key)
    return CheckpointWriter(setup, run, tokens=tokens, key=key)
