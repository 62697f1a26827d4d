"""A process's own state on disk: one file a save, checked to the byte when it is read.

Used for what a process needs to carry on after its death, not for the model a user takes home
(:mod:`ddiloco.checkpoints`): the data-parallel job's rollback checkpoints and a learner's
local checkpoint (weights, inner optimizer, step, data position, sync state). The layout is a
magic naming the kind, a format version, the payload length and a BLAKE3 digest of all that and
the payload (keyed by the run secret where the process has one: :func:`state_key`), then the
tree format of :mod:`~ddiloco.runtime.processes.transport.tree` (msgpack plus raw tensors:
nothing is unpickled). A save is written to a temp file, fsynced, renamed,
the directory fsynced, and the newest ``keep`` are kept, so a crash mid-save leaves the last
one intact. A damaged, truncated, foreign or incomplete file is refused naming the path.

Tensors go between memory and the file one at a time, never through a serialized copy of the
whole state (issue 28: that copy and its leftovers were 5x a learner's training memory): a
save streams each tensor's own bytes into the temp file (:meth:`StateFile.stage`, through a
:class:`~ddiloco.runtime.processes.transport.tree.Layout`: a copy into the page cache, on the
caller's thread, so the caller may change its tensors once it returns)
and hashes, fsyncs and renames it after (:meth:`StateFile.publish`, which may run on another
thread); a read checks the digest in chunks, then reads each tensor's bytes straight into a
tensor allocated after its size was checked against the file (a ``TreeWriter``).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import blake3

from ddiloco.checkpoints.format import CheckpointError
from ddiloco.checkpoints.write import fsync
from ddiloco.runtime.processes.transport.tree import PREFIX, Layout, TreeWriter

CHUNK = 8 << 20  # bytes hashed (read back) at a time
KEYED = 1 << 31  # set in the version word: the digest is BLAKE3 keyed by the run secret
KEY_CONTEXT = "ddiloco 2026-12 process state file v1"


def state_key(secret: bytes) -> bytes:
    """The key a process's saves are digested under: derived from the run secret, so a save
    is bound to its run (another run's, or one whose digest was recomputed by someone
    without the secret, is refused) and the secret itself never keys anything but frames."""
    return blake3.blake3(secret, derive_key_context=KEY_CONTEXT).digest()


def _hasher(key: bytes | None, data: bytes) -> Any:
    return blake3.blake3(data, key=key) if key is not None else blake3.blake3(data)


def private_directory(directory: Path) -> None:
    """``directory``, made if missing, readable by this user only (0700, as the syncer's
    store): a learner's saves hold the model and its optimizer state, and are files a
    resumed run trusts."""
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = directory.stat()
    if info.st_mode & 0o077 and info.st_uid == os.getuid():
        directory.chmod(0o700)


@dataclass(frozen=True)
class Staged:
    """A save written to its temp file, not yet hashed, fsynced or renamed."""

    directory: Path
    step: int
    tmp: Path
    size: int  # the whole file's bytes


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

    def write(
        self, directory: Path, step: int, state: dict[str, Any], key: bytes | None = None
    ) -> tuple[Path, int]:
        """Save ``state`` atomically and keep the newest ``keep``; returns its path and size.
        A failed write (disk full) is a :class:`CheckpointError` naming the file; the earlier
        saves are intact. ``key`` (:func:`state_key`): digest under it."""
        return self.publish(self.stage(directory, step, state, key), key)

    def stage(
        self, directory: Path, step: int, state: dict[str, Any], key: bytes | None = None
    ) -> Staged:
        """Stream ``state`` into the save's temp file, one tensor at a time (a device tensor
        through one host copy of itself); its digest is left zero for :meth:`publish`."""
        path = self.path(directory, step)
        tmp = directory / f".{path.name}.tmp"
        layout = Layout(state)  # views over the tensors (a device tensor: one host copy)
        length = layout.size
        word = self.version | (KEYED if key is not None else 0)
        prefix = self.magic + word.to_bytes(4, "little") + length.to_bytes(8, "little")
        try:
            private_directory(directory)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
            os.fchmod(fd, 0o600)  # a temp file left by a crash may predate the mode
            with os.fdopen(fd, "wb") as f:
                f.write(prefix + bytes(32))
                for part in layout.parts:  # the GIL is released while each is written
                    f.write(part)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            raise CheckpointError(path, f"cannot write it: {exc}") from exc
        return Staged(directory, step, tmp, self.head + length)

    def publish(self, staged: Staged, key: bytes | None = None) -> tuple[Path, int]:
        """Hash a staged save (read back in chunks; under ``key``, as it was staged), write
        its digest, fsync it, rename it to its name and keep the newest ``keep``; returns
        its path and size."""
        path = self.path(staged.directory, staged.step)
        n = len(self.magic)
        try:
            with staged.tmp.open("r+b") as f:
                hasher = _hasher(key, f.read(n + 12))
                f.seek(self.head)
                _hash_rest(f, hasher)
                f.seek(n + 12)
                f.write(hasher.digest())
                f.flush()
                os.fsync(f.fileno())
            os.replace(staged.tmp, path)
            fsync(staged.directory)
        except OSError as exc:
            staged.tmp.unlink(missing_ok=True)
            raise CheckpointError(path, f"cannot write it: {exc}") from exc
        for _, old in self.saves(staged.directory)[: -self.keep]:
            old.unlink(missing_ok=True)
        return path, staged.size

    def read(self, path: Path, key: bytes | None = None) -> dict[str, Any]:
        """A save's state after checking every byte (under ``key``: a save keyed otherwise,
        or not keyed, is refused); :class:`CheckpointError` naming the file if it is
        missing, truncated, damaged, another run's, another kind's or lacks a field."""
        try:
            with path.open("rb") as f:
                state = self._read(path, f, key)
        except OSError as exc:
            raise CheckpointError(path, f"cannot read it: {exc.strerror or exc}") from None
        if not isinstance(state, dict):
            raise CheckpointError(path, f"a {type(state).__name__}, not a {self.what}'s fields")
        missing = [k for k in self.fields if k not in state]
        if missing:
            raise CheckpointError(path, f"missing fields {missing}")
        return state

    def _read(self, path: Path, f: BinaryIO, key: bytes | None) -> Any:
        size = os.fstat(f.fileno()).st_size
        head, n = self.head, len(self.magic)
        first = f.read(head)
        if size < head:
            raise CheckpointError(path, f"truncated: {size} bytes, shorter than its header")
        if first[:n] != self.magic:
            raise CheckpointError(path, f"not a ddiloco {self.what} (bad magic)")
        word = int.from_bytes(first[n : n + 4], "little")
        version, keyed = word & ~KEYED, bool(word & KEYED)
        if version != self.version:
            raise CheckpointError(
                path, f"format version {version}, this build reads {self.version}"
            )
        length = int.from_bytes(first[n + 4 : n + 12], "little")
        if length != size - head:
            why = f"truncated or extended: {size - head} payload bytes, its header says {length}"
            raise CheckpointError(path, why)
        if keyed and key is None:
            raise CheckpointError(path, "digested under a run secret, and this reader has none")
        if key is not None and not keyed:
            why = "not digested under the run secret (another build's, or rewritten by hand)"
            raise CheckpointError(path, why)
        hasher = _hasher(key, first[: n + 12])
        _hash_rest(f, hasher)
        if hasher.digest() != first[n + 12 : head]:
            why = "checksum mismatch: the file is damaged"
            if key is not None:
                why += ", or it is another run's (digested under another secret)"
            raise CheckpointError(path, why)
        f.seek(head)
        try:
            n = int.from_bytes(f.read(PREFIX), "little")
            writer = TreeWriter(length, n, length, source=self.what)
            writer.write(PREFIX, f.read(n))
            writer.write(0, n.to_bytes(PREFIX, "little"))
            writer.parse_head()
            writer.fill(f)
            return writer.tree()
        except Exception as exc:  # a well-checksummed file we cannot decode: another build's
            raise CheckpointError(path, f"cannot decode it: {exc}") from exc


def _hash_rest(f: BinaryIO, hasher: Any) -> None:
    """Feed the rest of ``f`` to ``hasher``, a reused chunk at a time."""
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    while n := f.readinto(view):  # type: ignore[attr-defined]
        hasher.update(view[:n])
