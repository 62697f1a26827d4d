"""A process's own state on disk: one file a save, checked to the byte when it is read.

Used for what a process needs to carry on after its death, not for the model a user takes home
(:mod:`ddiloco.checkpoints`): the data-parallel job's rollback checkpoints and a learner's
local checkpoint (weights, inner optimizer, step, data position, sync state). The layout is a
magic naming the kind, a format version, the payload length and a BLAKE3 digest of all that and
the payload, then :func:`~ddiloco.runtime.processes.transport.tree.pack_tree` bytes (msgpack
plus raw tensors: nothing is unpickled). A save is written to a temp file, fsynced, renamed,
the directory fsynced, and the newest ``keep`` are kept, so a crash mid-save leaves the last
one intact. A damaged, truncated, foreign or incomplete file is refused naming the path.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import blake3

from ddiloco.checkpoints.format import CheckpointError
from ddiloco.checkpoints.write import fsync
from ddiloco.runtime.processes.transport.tree import pack_tree, unpack_tree


@dataclass(frozen=True)
class StateFile:
    """One kind of state file: ``<prefix>-<step>.bin`` files in a directory."""

    magic: bytes  # 8 bytes naming the kind
    version: int
    fields: tuple[str, ...]  # what every save must hold
    what: str  # the kind in words, for errors
    prefix: str = "ckpt"
    keep: int = 2

    def __post_init__(self) -> None:
        assert len(self.magic) == 8

    @property
    def head(self) -> int:
        return len(self.magic) + 4 + 8 + 32  # magic, version, payload length, BLAKE3 digest

    def path(self, directory: Path, step: int) -> Path:
        return directory / f"{self.prefix}-{step:08d}.bin"

    def saves(self, directory: Path) -> list[tuple[int, Path]]:
        """Every save in ``directory``, (step, path), oldest first."""
        name = re.compile(rf"{re.escape(self.prefix)}-(\d{{8,}})\.bin")
        found = [
            (int(m.group(1)), p)
            for p in directory.glob(f"{self.prefix}-*.bin")
            if (m := name.fullmatch(p.name))
        ]
        return sorted(found)

    def latest(self, directory: Path) -> tuple[int, Path] | None:
        """The newest save (by step), None if there is none."""
        found = self.saves(directory)
        return found[-1] if found else None

    def encode(self, state: dict[str, Any]) -> bytes:
        payload = pack_tree(state)
        head = self.magic + self.version.to_bytes(4, "little") + len(payload).to_bytes(8, "little")
        return head + blake3.blake3(head + payload).digest() + payload

    def write(self, directory: Path, step: int, state: dict[str, Any]) -> tuple[Path, int]:
        """Save ``state`` atomically and keep the newest ``keep``; returns its path and size.
        A failed write (disk full) is a :class:`CheckpointError` naming the file; the earlier
        saves are intact."""
        return self.write_bytes(directory, step, self.encode(state))

    def write_bytes(self, directory: Path, step: int, data: bytes) -> tuple[Path, int]:
        """:meth:`write` of what :meth:`encode` returned (encode on one thread, write on
        another)."""
        directory.mkdir(parents=True, exist_ok=True)
        path = self.path(directory, step)
        tmp = directory / f".{path.name}.tmp"
        try:
            with tmp.open("wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
            fsync(directory)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            raise CheckpointError(path, f"cannot write it: {exc}") from exc
        for _, old in self.saves(directory)[: -self.keep]:
            old.unlink(missing_ok=True)
        return path, len(data)

    def read(self, path: Path) -> dict[str, Any]:
        """A save's state after checking every byte; :class:`CheckpointError` naming the file
        if it is missing, truncated, damaged, another kind's or lacks a field."""
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise CheckpointError(path, f"cannot read it: {exc.strerror or exc}") from None
        head, n = self.head, len(self.magic)
        if len(data) < head:
            raise CheckpointError(path, f"truncated: {len(data)} bytes, shorter than its header")
        if data[:n] != self.magic:
            raise CheckpointError(path, f"not a ddiloco {self.what} (bad magic)")
        version = int.from_bytes(data[n : n + 4], "little")
        if version != self.version:
            raise CheckpointError(
                path, f"format version {version}, this build reads {self.version}"
            )
        length = int.from_bytes(data[n + 4 : n + 12], "little")
        if length != len(data) - head:
            why = (
                f"truncated or extended: {len(data) - head} payload bytes, its header says {length}"
            )
            raise CheckpointError(path, why)
        if blake3.blake3(data[: n + 12] + data[head:]).digest() != data[n + 12 : head]:
            raise CheckpointError(path, "checksum mismatch: the file is damaged")
        try:
            state = unpack_tree(memoryview(data)[head:])
        except Exception as exc:  # a well-checksummed file we cannot decode: another build's
            raise CheckpointError(path, f"cannot decode it: {exc}") from exc
        if not isinstance(state, dict):
            raise CheckpointError(path, f"a {type(state).__name__}, not a {self.what}'s fields")
        missing = [k for k in self.fields if k not in state]
        if missing:
            raise CheckpointError(path, f"missing fields {missing}")
        return state
