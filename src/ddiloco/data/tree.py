"""Which files a directory or glob source reads: only what lies inside the corpus' root.

A corpus is often someone else's download, so its links are not trusted: ``os.walk`` or
``glob`` would follow a symlink to ``~/.ssh/id_ed25519`` into ``train.bin`` (and into what
the model may recite), or loop forever on ``a/loop -> ..``. Here (docs/data.md, "Hostile
corpora"):

- a symlink whose target resolves outside the root (the directory named, or a glob's part
  before its first wildcard) is refused: one line naming the link and its target;
- a symlinked directory is never descended into (what it points at inside the root is read
  under its own name), so no link loop can be entered;
- a file reached under two names (a link inside the root, a hard link) is read once;
- a dangling or looping link, a link to a directory and a file that vanished are skipped,
  each with one warning line.

The walk is ours (``os.scandir``, no ``glob``): ``**`` matches any number of directories,
``*`` and friends one name (``fnmatch``), and a matching directory brings every file under it.
Hidden names (a dot first) below the root are skipped, as before.
"""

from __future__ import annotations

import fnmatch
import os
from collections.abc import Callable
from pathlib import Path

from ddiloco.errors import ConfigError

WILDCARDS = "*?["


def glob_root(pattern: str) -> tuple[Path, tuple[str, ...]]:
    """The directory a glob cannot leave (its leading parts without a wildcard) and the
    pattern's remaining parts."""
    parts = Path(pattern).parts
    fixed = 0
    while fixed < len(parts) and not any(c in parts[fixed] for c in WILDCARDS):
        fixed += 1
    return Path(*parts[:fixed]) if fixed else Path("."), tuple(parts[fixed:])


def matches(pattern: tuple[str, ...], parts: tuple[str, ...]) -> bool:
    """Whether a relative path (its parts) matches a glob's parts (``**``: zero or more)."""
    if not pattern:
        return not parts
    if pattern[0] == "**":
        return any(matches(pattern[1:], parts[i:]) for i in range(len(parts) + 1))
    if not parts or not fnmatch.fnmatchcase(parts[0], pattern[0]):
        return False
    return matches(pattern[1:], parts[1:])


class Walk:
    """Every regular file under ``root`` by the module's rules (``key`` names the setting in
    errors; ``warn`` says each skip, ``skipped`` counts them)."""

    def __init__(self, root: Path, key: str, warn: Callable[[str], None]) -> None:
        self.root = root
        self.real_root = root.resolve()
        self.key = key
        self.warn = warn
        self.skipped = 0
        self._seen: set[tuple[int, int]] = set()  # (device, inode) of the files taken

    def files(self, pattern: tuple[str, ...] | None = None) -> list[Path]:
        """The files, sorted; with ``pattern``, those matching it or under a directory that
        does."""
        out: list[Path] = []
        stack: list[tuple[Path, tuple[str, ...], bool]] = [(self.root, (), pattern is None)]
        while stack:
            directory, parts, taken = stack.pop()
            try:
                entries = sorted(os.scandir(directory), key=lambda e: e.name)
            except OSError as exc:
                self._skip(f"unreadable directory {directory}: {exc.strerror}")
                continue
            for entry in entries:
                if entry.name.startswith("."):
                    continue
                path, rel = Path(entry.path), (*parts, entry.name)
                wanted = taken or (pattern is not None and matches(pattern, rel))
                if not wanted and entry.is_symlink():
                    continue  # (a link the glob does not name is neither read nor followed)
                kind = self._kind(entry, path)
                if kind == "dir":
                    stack.append((path, rel, wanted))
                elif kind == "file" and wanted:
                    out.append(path)
        return [path for path in sorted(out) if self._first(path)]  # (the first in order)

    def _kind(self, entry: os.DirEntry[str], path: Path) -> str | None:
        """ "dir", "file" or None (skipped); a link out of the root raises."""
        try:
            if not entry.is_symlink():
                return "dir" if entry.is_dir() else ("file" if entry.is_file() else None)
            target = Path(os.path.realpath(path))
            if not target.is_relative_to(self.real_root):
                why = f"a symlink out of the corpus (to {target}): refused; copy the file in"
                raise ConfigError(self.key, str(path), why)
            if not target.exists():
                self._skip(f"skipping {path}: a dangling or looping symlink")
            elif target.is_dir():
                self._skip(f"skipping {path}: a symlink to a directory (not followed)")
            elif target.is_file():
                return "file"
        except OSError as exc:
            self._skip(f"skipping {path}: {exc.strerror}")
        return None

    def _first(self, path: Path) -> bool:
        """Whether this is the first name the file is read under."""
        try:
            st = path.stat()
        except OSError as exc:
            self._skip(f"skipping {path}: {exc.strerror}")
            return False
        if (st.st_dev, st.st_ino) in self._seen:
            self._skip(f"skipping {path}: the same file as one read already")
            return False
        self._seen.add((st.st_dev, st.st_ino))
        return True

    def _skip(self, line: str) -> None:
        self.skipped += 1
        self.warn(line)
