"""The syncer's durable state: what a syncer killed at any moment restarts from.

Owns the on-disk record of the global fragments, their outer-optimizer state, versions,
next round ids and the applied-update ids (the answer keys merged into each fragment, and
the highest base merged per learner life), and how that record is read back into a fresh
:class:`~ddiloco.core.syncer_state.SyncerState`. One file per fragment, rewritten after each
of its merges *before* the merged fragment is broadcast, so every acknowledged merge is on
disk; a write is crash-safe (temp file, fsync, rename, fsync of the directory), so a file is
always either the old or the new version, never a torn mix. An optional append-only journal
keeps every merge's inputs (answer metadata and payloads) so a test or an audit can recompute
the merged state from Theta_0.

The token ledger is durable too (docs/decisions.md 33): its plain-data snapshot rides in the
header of every fragment file, so a merge and the ledger that counts it are written by one
rename, and ``ledger.bin`` takes a fresher snapshot between merges. Every snapshot carries a
sequence number; the highest one on disk is the ledger a restarted syncer loads, and it
counts exactly the merges that are durable (each merge is written before any later one).

Refuse rather than guess: a lost fragment file must not quietly restart its fragment from
Theta_0 (its merges forgotten, the journal cut to match). ``manifest.json`` (checksummed)
holds the format, the run's fingerprint (:func:`fingerprint_of`), the fragment count, whether
a journal is kept and which fragments have a file. It is written before the first file of
any kind (the first ``save``, ``save_ledger`` or ``append_journal``); a fragment's first file
is announced as ``pending`` before it is written and listed after, so a crash between leaves
a pending name whose file exists or not, both consistent. On load, a missing, unlisted,
mislabelled or damaged fragment file, a damaged ``ledger.bin``, store files without a
manifest, or another run's manifest raise :class:`StoreError` naming the file. Only the
journal's last record may be torn (a kill mid-append): it is cut, as are merges no fragment
file recorded (never broadcast), and both cuts are noted (``SyncerStore.notes``, logged);
damage elsewhere is refused. A failed write (a full disk) raises StoreError and leaves the
previous file, or the journal's previous length. The directory is 0700, every file 0600.

This module is the store's public API (:class:`SyncerStore`; :func:`record_of` and
:func:`restore` from :mod:`~ddiloco.runtime.processes.syncer.restore`, the bridge to the
core's SyncerState): when each file is written, and what a restart may trust. The bytes are
:mod:`~ddiloco.runtime.processes.syncer.store_format`'s (fragment, ledger and manifest files) and
:mod:`~ddiloco.runtime.processes.syncer.store_journal`'s (the journal, its cuts, the audits); every
public name of both is importable from here.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import stat
import zlib
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from ddiloco.core.fragment_state import Key
from ddiloco.runtime.processes.syncer.restore import record_of, restore

# Re-exported for the damage tests, which forge files with them.
from ddiloco.runtime.processes.syncer.store_format import (
    FRAGMENT_FILE,
    MAGIC,
    MANIFEST,
    MANIFEST_FORMAT,
    TICKETS_FILE,
    FragmentRecord,
    StoreError,
    canonical,
    check_manifest,
    fingerprint_of,
    fragment_chunks,
    fragment_of,
    ledger_snapshot,
    pack_state,
    unpack_state,
)
from ddiloco.runtime.processes.syncer.store_journal import (
    JOURNAL_MAGIC,
    Journal,
    journal_chunks,
    journal_header,
    journal_keep,
    recompute,
    replay_journal,
    scan_journal,
)

__all__ = [
    "JOURNAL_MAGIC",
    "MAGIC",
    "MANIFEST",
    "MANIFEST_FORMAT",
    "FragmentRecord",
    "Journal",
    "Key",
    "StoreError",
    "SyncerStore",
    "fingerprint_of",
    "journal_header",
    "recompute",
    "record_of",
    "replay_journal",
    "restore",
    "write_atomic",
]

log = logging.getLogger(__name__)


def _os_error(path: Path, exc: OSError, doing: str) -> StoreError:
    """An OSError as a StoreError naming the file; ENOSPC says "disk full"."""
    code = errno.errorcode.get(exc.errno or 0, str(exc.errno))
    why = "disk full" if exc.errno == errno.ENOSPC else (exc.strerror or str(exc))
    return StoreError(str(path), code, f"{why} while {doing}")


def _fsync_dir(path: Path) -> None:
    try:
        dfd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except OSError as exc:
        raise _os_error(path, exc, "syncing its directory") from exc


def _write_all(fd: int, chunks: Iterable[bytes | bytearray | memoryview]) -> None:
    for chunk in chunks:
        view = memoryview(chunk)
        while view:
            view = view[os.write(fd, view) :]


def write_atomic(path: Path, data: bytes | bytearray | Iterable[bytes]) -> None:
    """Write ``data`` (or its chunks, streamed) so that ``path`` holds either its old content
    or all of it (mode 0600). A failed write (a full disk) removes the temp file and raises
    StoreError."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.fchmod(fd, 0o600)  # a temp file left by a crash may predate the mode
            _write_all(fd, [data] if isinstance(data, bytes | bytearray) else data)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise _os_error(path, exc, "writing it (the previous version is intact)") from exc
    _fsync_dir(path)


def _read(path: Path) -> tuple[dict[str, Any], list[torch.Tensor]]:
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise _os_error(path, exc, "reading it") from exc
    return unpack_state(data, str(path))


def _read_fragment(path: Path) -> tuple[FragmentRecord, int]:
    """One fragment file and its ledger snapshot's seq, every field checked."""
    header, tensors = _read(path)
    return fragment_of(header, tensors, str(path))


class SyncerStore:
    """A directory holding one syncer's durable state (and, optionally, its journal).

    ``fingerprint`` names the run (:func:`fingerprint_of`) and ``fragments`` is its plan's
    count: a store begun under others is refused. An audit that only reads may omit both."""

    def __init__(
        self,
        directory: str | Path,
        journal: bool = False,
        *,
        fingerprint: str | None = None,
        fragments: int | None = None,
    ) -> None:
        self.dir = Path(directory)
        self.journal_enabled = journal
        self.fingerprint = fingerprint
        self.fragments = fragments
        self.manifest_path = self.dir / MANIFEST
        self.journal_path = self.dir / "journal.bin"
        self.ledger_path = self.dir / "ledger.bin"
        self.tickets_path = self.dir / TICKETS_FILE  # the connection tickets admitted
        self.writes = 0
        self.seq = 0  # of the latest ledger snapshot written or loaded
        self.ledger_state: dict[str, Any] | None = None  # the latest one on disk, after load()
        self.notes: list[str] = []  # what was cut or tightened (each also logged)
        self._manifest: dict[str, Any] | None = None  # as on disk, once read or written
        try:
            self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
            self._tighten(self.dir, 0o700)
            for entry in os.scandir(self.dir):
                if entry.is_file(follow_symlinks=False):
                    self._tighten(Path(entry.path), 0o600)
        except OSError as exc:
            raise _os_error(self.dir, exc, "opening the store directory") from exc

    def fragment_path(self, p: int) -> Path:
        return self.dir / f"fragment-{p:04d}.bin"

    def _note(self, message: str) -> None:
        self.notes.append(message)
        log.warning("%s", message)

    def _tighten(self, path: Path, mode: int) -> None:
        """Merge payloads and the ledger are the run's private state: owner only."""
        old = stat.S_IMODE(path.stat().st_mode)
        if old & 0o077:
            path.chmod(mode)
            self._note(f"{path}: tightened its permissions from {old:04o} to {mode:04o}")

    # -- the manifest -----------------------------------------------------------------------
    def _read_manifest(self) -> dict[str, Any] | None:
        """The manifest, checked against this run; None when there is none."""
        where = str(self.manifest_path)
        try:
            outer: dict[str, Any] = json.loads(self.manifest_path.read_bytes())
            body: dict[str, Any] = outer["manifest"]
            crc = outer["crc32"]
            ok = crc == zlib.crc32(canonical(body)) and isinstance(body, dict)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise _os_error(self.manifest_path, exc, "reading it") from exc
        except Exception as exc:
            raise StoreError(where, type(exc).__name__, f"undecodable: {exc}") from None
        if not ok:
            raise StoreError(where, crc, "checksum mismatch: the manifest is damaged")
        check_manifest(body, where)
        theirs, count = body.get("fingerprint"), body.get("fragments")
        if self.fingerprint is not None and theirs != self.fingerprint:
            raise StoreError(
                str(self.dir),
                theirs,
                f"store {self.dir} was written by another "
                f"model/plan/run: its fingerprint is {theirs!r}, this run's is "
                f"{self.fingerprint!r}",
            )
        if self.fragments is not None and count not in (None, self.fragments):
            raise StoreError(
                str(self.dir),
                count,
                f"store {self.dir} was written by another "
                f"plan: {count} fragments, this run has {self.fragments}",
            )
        return body

    def _write_manifest(self, body: dict[str, Any]) -> None:
        manifest = {"crc32": zlib.crc32(canonical(body)), "manifest": body}
        write_atomic(self.manifest_path, json.dumps(manifest, sort_keys=True, indent=1).encode())
        self._manifest = body

    def _refuse_strays(self) -> None:
        """Store files without a manifest: an older build's, or the manifest was deleted."""
        strays = sorted(
            e.name
            for e in os.scandir(self.dir)
            if FRAGMENT_FILE.fullmatch(e.name)
            or e.name in (self.ledger_path.name, self.journal_path.name)
        )
        if strays:
            raise StoreError(
                str(self.manifest_path),
                strays,
                f"missing, but store {self.dir} "
                f"holds {', '.join(strays)}: refusing to guess whose they are "
                "(an older build's store, or its manifest was deleted)",
            )

    def _settled(self, body: dict[str, Any]) -> dict[str, Any]:
        """The pending fragment file listed if it was written, dropped if not."""
        pending = body["pending"]
        if pending is None:
            return body
        files = set(body["files"]) | ({pending} if (self.dir / pending).exists() else set())
        return {**body, "files": sorted(files), "pending": None}

    def _opened(self) -> dict[str, Any]:
        """The manifest before a write: read and checked once, or begun before any file."""
        if self._manifest is None:
            body = self._read_manifest()
            if body is None:
                self._refuse_strays()
                body = {
                    "format": MANIFEST_FORMAT,
                    "fingerprint": self.fingerprint,
                    "fragments": self.fragments,
                    "journal": self.journal_enabled,
                    "files": [],
                    "pending": None,
                }
                self._write_manifest(body)
            self._manifest = body
        if self._manifest["journal"] != self.journal_enabled:
            raise StoreError(
                str(self.journal_path),
                self.journal_enabled,
                f"store {self.dir} "
                f"was begun with journal={self._manifest['journal']}: a journal "
                "covers a whole run or none of it",
            )
        return self._manifest

    # -- writing ----------------------------------------------------------------------------
    def save(self, record: FragmentRecord) -> None:
        """Fragment ``record.fragment``'s file, after its merge and before the broadcast."""
        manifest = self._opened()
        p = record.fragment
        if self.fragments is not None and not 0 <= p < self.fragments:
            raise StoreError("fragment", p, f"the plan has {self.fragments} fragments")
        path = self.fragment_path(p)
        first = path.name not in manifest["files"]
        if first:  # announced before it exists, listed once it does (see the module doc)
            self._write_manifest({**self._settled(manifest), "pending": path.name})
        seq = self.seq + (record.ledger is not None)
        write_atomic(path, fragment_chunks(record, seq))
        self.seq = seq
        self.writes += 1
        if first:
            self._write_manifest(self._settled(self._opened()))

    def save_ledger(self, state: dict[str, Any]) -> None:
        """A ledger snapshot between merges (every merge it counts is already durable)."""
        self._opened()
        write_atomic(
            self.ledger_path, pack_state({"ledger": {"seq": self.seq + 1, "state": state}}, [])
        )
        self.seq += 1

    def append_journal(self, header: dict[str, Any], payloads: list[bytes]) -> None:
        """One merge's inputs: a length-prefixed, checksummed record, fsynced. A failed
        append (a full disk) is cut back, so it is not mistaken for damage later."""
        self._opened()
        record = journal_chunks(header, payloads)
        path, created = self.journal_path, not self.journal_path.exists()
        try:
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        except OSError as exc:
            raise _os_error(path, exc, "opening it to append") from exc
        try:
            size = os.fstat(fd).st_size
            _write_all(fd, record)
            os.fsync(fd)
        except OSError as exc:
            try:
                os.ftruncate(fd, size)
                os.fsync(fd)
            except OSError as again:
                raise _os_error(path, again, f"cutting back a failed append ({exc})") from exc
            raise _os_error(path, exc, "appending a record (cut back to the previous one)") from exc
        finally:
            os.close(fd)
        if created:
            _fsync_dir(path)

    # -- reading ----------------------------------------------------------------------------
    def load(self) -> dict[int, FragmentRecord]:
        """Every fragment file (an empty dict for a fresh start), checked against the manifest;
        left-over temp files from a crash mid-write are removed, and the journal is cut to
        match. Anything missing, foreign or damaged raises StoreError (see the module doc)."""
        try:
            for tmp in self.dir.glob(".*.tmp"):
                tmp.unlink()
        except OSError as exc:
            raise _os_error(self.dir, exc, "removing temp files") from exc
        self.seq, self.ledger_state = 0, None
        manifest = self._read_manifest()
        if manifest is None:
            self._refuse_strays()
            return {}
        settled = self._settled(manifest)
        if settled != manifest:
            self._write_manifest(settled)
        self._manifest = settled
        if self.journal_enabled and not settled["journal"]:
            raise StoreError(
                str(self.journal_path),
                True,
                f"store {self.dir} was begun without "
                "a journal: one started now would miss its first merges",
            )
        records, latest, problems = self._fragments(settled)
        if self.ledger_path.exists():
            try:
                snap = ledger_snapshot(
                    _read(self.ledger_path)[0].get("ledger"), str(self.ledger_path)
                )
                if snap is None:
                    raise StoreError(str(self.ledger_path), None, "no ledger snapshot in it")
                if snap["seq"] > latest[0]:
                    latest = (snap["seq"], snap["state"])
            except StoreError as exc:
                problems.append(str(exc))
        if problems:
            raise StoreError(
                str(self.dir),
                len(problems),
                f"refusing to start from store {self.dir}: " + "; ".join(problems),
            )
        self.seq, self.ledger_state = latest
        versions = {p: r.version for p, r in records.items()}
        if self.journal_path.exists():
            self._trim_journal(versions, complete=settled["journal"])
        elif settled["journal"] and any(versions.values()):
            raise StoreError(
                str(self.journal_path),
                "missing",
                f"store {self.dir} keeps a journal and has durable merges {versions}",
            )
        return records

    def _fragments(
        self, manifest: dict[str, Any]
    ) -> tuple[dict[int, FragmentRecord], tuple[int, dict[str, Any] | None], list[str]]:
        """The fragment files, the freshest ledger snapshot among them, and what is wrong."""
        records: dict[int, FragmentRecord] = {}
        latest: tuple[int, dict[str, Any] | None] = (0, None)
        problems: list[str] = []
        listed = set(manifest["files"])
        present = {e.name for e in os.scandir(self.dir) if e.name.startswith("fragment-")}
        count = manifest["fragments"]
        for name in sorted(listed | present):
            path = self.dir / name
            match = FRAGMENT_FILE.fullmatch(name)
            p = int(match[1]) if match else -1
            if match is None or self.fragment_path(p).name != name:
                problems.append(f"{path}: not a fragment file name this store writes")
                continue
            if name not in present:
                problems.append(
                    f"{path}: missing (listed in {MANIFEST}: its fragment merged, "
                    "and restarting it from Theta_0 would lose that)"
                )
                continue
            try:
                rec, seq = _read_fragment(path)
            except StoreError as exc:
                problems.append(str(exc))
                continue
            if rec.fragment != p:
                problems.append(f"{path}: mislabelled: its header says fragment {rec.fragment}")
            elif name not in listed:
                problems.append(f"{path}: not listed in {MANIFEST} (a file from elsewhere)")
            elif count is not None and p >= count:
                problems.append(f"{path}: the manifest's plan has {count} fragments")
            else:
                records[p] = rec
                if seq > latest[0]:
                    latest = (seq, rec.ledger)
        return records, latest, problems

    def journal(self) -> Iterator[tuple[dict[str, Any], list[bytes]]]:
        """The journal's intact records, in order: (header, payloads)."""
        if self.journal_path.exists():
            for _, _, header, payloads in self._scan(self.journal_path.read_bytes())[0]:
                yield header, payloads

    def _scan(self, data: bytes) -> tuple[Journal, str | None]:
        """The journal's records and, if it ends in a torn one, why; damage elsewhere raises."""
        return scan_journal(data, str(self.journal_path))

    def _trim_journal(self, versions: dict[int, int], complete: bool) -> None:
        """Cut a torn tail, and merges whose fragment file was not written before a crash
        (they were never broadcast, so they never happened); with ``complete`` (the store
        keeps a journal) every durable merge must be in it, in order."""
        data = self.journal_path.read_bytes()
        keep = journal_keep(data, versions, complete, str(self.journal_path), self._note)
        if keep != len(data):
            try:
                with self.journal_path.open("r+b") as f:
                    f.truncate(keep)
                    f.flush()
                    os.fsync(f.fileno())
            except OSError as exc:
                raise _os_error(self.journal_path, exc, "cutting it") from exc
