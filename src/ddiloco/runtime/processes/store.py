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

Format (never pickle): b"DDSF" | u32 header length | msgpack header | codec bundle of the
fragment's tensors then the outer state's tensors | u32 crc32 of everything before it.
Journal record: u64 n | n-byte body (b"DDSJ" | u32 header length | msgpack header | payloads)
| u32 crc32 of the body.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import re
import stat
import struct
import zlib
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import torch

from ddiloco.config import RunConfig
from ddiloco.core.codec import CodecSpec, decode_tensors, encode_tensors
from ddiloco.core.merge import tensor_norms, token_weight
from ddiloco.core.outer import make_outer_optimizer
from ddiloco.core.plans import gather
from ddiloco.core.syncer_state import MergeResult, SyncerConfig, SyncerState, merge_step
from ddiloco.errors import ConfigError, DDiLoCoError
from ddiloco.runtime.processes.setup import RunSetup

MAGIC = b"DDSF"
JOURNAL_MAGIC = b"DDSJ"
MANIFEST = "manifest.json"
MANIFEST_FORMAT = 1
_HEAD = struct.Struct("<4sI")
_CRC = struct.Struct("<I")
_LEN = struct.Struct("<Q")
_FP32 = CodecSpec("fp32")
_NAME = re.compile(r"fragment-(\d{4,})\.bin")

log = logging.getLogger(__name__)
Key = tuple[int, int, int]
Journal = list[tuple[int, int, dict[str, Any], list[bytes]]]  # (start, end, header, payloads)


class StoreError(DDiLoCoError):
    """A durable file is missing, damaged, foreign or could not be written: the syncer must
    not start (or go on) from it. A torn write cannot happen; a torn journal tail is cut."""


class _Torn(Exception):
    """What is left of the journal could be a record cut short by a kill."""


class _Damaged(Exception):
    """A journal record no kill could have produced."""


@dataclass
class FragmentRecord:
    """Everything the syncer must not lose about one fragment."""

    fragment: int
    version: int
    next_round_id: int
    global_step: int
    tokens: int
    values: list[torch.Tensor]
    outer: dict[str, Any]  # the outer optimizer's state_dict: ints, None, lists of tensors
    applied: list[Key]  # answer keys merged into this fragment
    merged_base: dict[tuple[int, int], int]  # (learner, incarnation) -> highest merged base
    ledger: dict[str, Any] | None = None  # the token ledger's plain state, with this merge


def fingerprint_of(setup: RunSetup) -> str:
    """The run's identity for the manifest: a store written for another model, seed, method,
    plan or outer optimizer holds state this run cannot continue from."""
    plan, cfg = setup.plan, setup.settings.sync.syncer_config()
    layout = [
        [plan.strategy, plan.sync_every, cfg.merge_rule, repr(cfg.outer)],
        [[s.name, list(s.shape)] for s in plan.specs],
        [[f.offset, [[s.name, s.rows] for s in f.slices]] for f in plan.fragments],
    ]
    digest = hashlib.sha256(json.dumps(layout).encode()).hexdigest()[:16]
    c = setup.config
    return (f"model={c.model} seed={c.seed} method={setup.method} "
            f"fragments={plan.num_fragments} plan={digest}")  # fmt: skip


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


def write_atomic(path: Path, data: bytes | bytearray) -> None:
    """Write ``data`` so that ``path`` holds either its old content or all of ``data`` (mode
    0600). A failed write (a full disk) removes the temp file and raises StoreError."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.fchmod(fd, 0o600)  # a temp file left by a crash may predate the mode
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise _os_error(path, exc, "writing it (the previous version is intact)") from exc
    _fsync_dir(path)


def _pack(header: dict[str, Any], tensors: list[torch.Tensor]) -> bytes:
    head: bytes = msgpack.packb(header, use_bin_type=True)
    body = _HEAD.pack(MAGIC, len(head)) + head + encode_tensors(tensors, _FP32)
    return body + _CRC.pack(zlib.crc32(body))


def _unpack(data: bytes, where: str) -> tuple[dict[str, Any], list[torch.Tensor]]:
    if len(data) < _HEAD.size + _CRC.size:
        raise StoreError(where, len(data), "too short to be a syncer state file")
    (crc,) = _CRC.unpack_from(data, len(data) - _CRC.size)
    body = memoryview(data)[: len(data) - _CRC.size]
    if zlib.crc32(body) != crc:
        raise StoreError(where, crc, "checksum mismatch: the file is damaged")
    magic, head_len = _HEAD.unpack_from(body, 0)
    if magic != MAGIC:
        raise StoreError(where, bytes(magic), f"expected {MAGIC!r}")
    try:
        header = msgpack.unpackb(body[_HEAD.size : _HEAD.size + head_len], raw=False)
        tensors = decode_tensors(body[_HEAD.size + head_len :])
    except Exception as exc:  # msgpack's, the codec's: any of them means a damaged file
        raise StoreError(where, type(exc).__name__, f"undecodable: {exc}") from None
    if not isinstance(header, dict):
        raise StoreError(where, type(header).__name__, "the header is not a map")
    return header, tensors


def _read(path: Path) -> tuple[dict[str, Any], list[torch.Tensor]]:
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise _os_error(path, exc, "reading it") from exc
    return _unpack(data, str(path))


def _snapshot(value: Any, where: str) -> dict[str, Any] | None:
    if value is not None and not (isinstance(value, dict) and type(value.get("seq")) is int):
        raise StoreError(where, "ledger", "malformed ledger snapshot")
    return value


def _read_fragment(path: Path) -> tuple[FragmentRecord, int]:
    """One fragment file and its ledger snapshot's seq, every field checked."""
    header, tensors = _read(path)
    where = str(path)
    try:
        count, meta = header["count"], header["outer"]
        if count + sum(item.get("tensors", 0) for item in meta.values()) != len(tensors):
            raise ValueError(f"{len(tensors)} tensors do not match the header")
        snapshot = _snapshot(header.get("ledger"), where) or {"seq": 0, "state": None}
        return FragmentRecord(
            fragment=int(header["fragment"]),
            version=int(header["version"]),
            next_round_id=int(header["next_round_id"]),
            global_step=int(header["global_step"]),
            tokens=int(header["tokens"]),
            values=tensors[:count],
            outer=_join_outer(meta, tensors[count:]),
            applied=[(a[0], a[1], a[2]) for a in header["applied"]],
            merged_base={(a[0], a[1]): a[2] for a in header["merged_base"]},
            ledger=snapshot["state"],
        ), snapshot["seq"]
    except StoreError:
        raise
    except Exception as exc:
        raise StoreError(where, type(exc).__name__, f"malformed header: {exc}") from None


def _split_outer(state: dict[str, Any]) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """An outer state_dict as msgpack-able metadata plus its tensors in order."""
    meta: dict[str, Any] = {}
    tensors: list[torch.Tensor] = []
    for name, value in sorted(state.items()):
        if isinstance(value, list):
            meta[name] = {"tensors": len(value)}
            tensors.extend(value)
        else:
            meta[name] = {"value": value}
    return meta, tensors


def _join_outer(meta: dict[str, Any], tensors: list[torch.Tensor]) -> dict[str, Any]:
    state: dict[str, Any] = {}
    pos = 0
    for name, item in sorted(meta.items()):
        if "tensors" in item:
            state[name] = tensors[pos : pos + item["tensors"]]
            pos += item["tensors"]
        else:
            state[name] = item["value"]
    return state


def _journal_body(body: bytes, n: int) -> tuple[dict[str, Any] | None, list[bytes]]:
    """A journal record's body, or the prefix of one a kill left: (header, payloads), the
    header None while incomplete. Raises _Damaged if no prefix of a record looks like it."""
    if len(body) < _HEAD.size:
        if len(body) >= n:
            raise _Damaged(f"a {n}-byte record, too short for a header")
        return None, []
    magic, head_len = _HEAD.unpack_from(body, 0)
    if magic != JOURNAL_MAGIC:
        raise _Damaged(f"bad magic {bytes(magic)!r}")
    if _HEAD.size + head_len > n:
        raise _Damaged(f"a {head_len}-byte header in a {n}-byte record")
    if len(body) < _HEAD.size + head_len:
        return None, []
    try:
        header = msgpack.unpackb(body[_HEAD.size : _HEAD.size + head_len], raw=False)
        sizes = [int(s) for s in header["payloads"]]
    except Exception as exc:
        raise _Damaged(f"an undecodable header ({exc})") from None
    if _HEAD.size + head_len + sum(sizes) != n:
        raise _Damaged(f"a length field of {n} bytes that its header contradicts")
    payloads, at = [], _HEAD.size + head_len
    for size in sizes:
        payloads.append(body[at : at + size])
        at += size
    return header, payloads


def _journal_record(data: bytes, pos: int) -> tuple[int, dict[str, Any], list[bytes]]:
    """The journal record at ``pos``: (end, header, payloads). Raises _Torn for what a kill
    mid-append leaves (a prefix of a record; a checksum failing on the record that ends at
    EOF), _Damaged for anything else."""
    left = len(data) - pos
    if left < _LEN.size:
        raise _Torn(f"an incomplete length field ({left} bytes)")
    (n,) = _LEN.unpack_from(data, pos)
    end = pos + _LEN.size + n + _CRC.size
    body = data[pos + _LEN.size : min(end - _CRC.size, len(data))]
    try:
        header, payloads = _journal_body(body, n)
    except _Damaged:
        if not data[pos:].strip(b"\0"):  # a crash after the size grew, before the data
            raise _Torn("a zero-filled tail") from None
        raise
    if end > len(data):
        raise _Torn(f"a record cut short ({left} of {end - pos} bytes)")
    (crc,) = _CRC.unpack_from(data, end - _CRC.size)
    if zlib.crc32(body) != crc:
        if end == len(data):
            raise _Torn("a checksum mismatch on the last record")
        raise _Damaged("checksum mismatch")
    if header is None:
        raise _Damaged("a record without a header")
    return end, header, payloads


def _canonical(body: dict[str, Any]) -> bytes:
    return json.dumps(body, sort_keys=True).encode()


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
            ok = crc == zlib.crc32(_canonical(body)) and isinstance(body, dict)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise _os_error(self.manifest_path, exc, "reading it") from exc
        except Exception as exc:
            raise StoreError(where, type(exc).__name__, f"undecodable: {exc}") from None
        if not ok:
            raise StoreError(where, crc, "checksum mismatch: the manifest is damaged")
        if body.get("format") != MANIFEST_FORMAT:
            raise StoreError(where, body.get("format"), f"this build reads format "
                             f"{MANIFEST_FORMAT}")  # fmt: skip
        names = body.get("files")
        pending = body.get("pending")
        if not (isinstance(names, list) and (pending is None or isinstance(pending, str))
                and all(isinstance(n, str) and _NAME.fullmatch(n) for n in [*names, pending or
                                                                           "fragment-0000.bin"])
                and isinstance(body.get("journal"), bool)):  # fmt: skip
            raise StoreError(where, sorted(body), "malformed manifest")
        theirs, count = body.get("fingerprint"), body.get("fragments")
        if self.fingerprint is not None and theirs != self.fingerprint:
            raise StoreError(str(self.dir), theirs, f"store {self.dir} was written by another "
                             f"model/plan/run: its fingerprint is {theirs!r}, this run's is "
                             f"{self.fingerprint!r}")  # fmt: skip
        if self.fragments is not None and count not in (None, self.fragments):
            raise StoreError(str(self.dir), count, f"store {self.dir} was written by another "
                             f"plan: {count} fragments, this run has {self.fragments}")  # fmt: skip
        return body

    def _write_manifest(self, body: dict[str, Any]) -> None:
        manifest = {"crc32": zlib.crc32(_canonical(body)), "manifest": body}
        write_atomic(self.manifest_path, json.dumps(manifest, sort_keys=True, indent=1).encode())
        self._manifest = body

    def _refuse_strays(self) -> None:
        """Store files without a manifest: an older build's, or the manifest was deleted."""
        strays = sorted(e.name for e in os.scandir(self.dir) if _NAME.fullmatch(e.name)
                        or e.name in (self.ledger_path.name, self.journal_path.name))  # fmt: skip
        if strays:
            raise StoreError(str(self.manifest_path), strays, f"missing, but store {self.dir} "
                             f"holds {', '.join(strays)}: refusing to guess whose they are "
                             "(an older build's store, or its manifest was deleted)")  # fmt: skip

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
                body = {"format": MANIFEST_FORMAT, "fingerprint": self.fingerprint,
                        "fragments": self.fragments, "journal": self.journal_enabled,
                        "files": [], "pending": None}  # fmt: skip
                self._write_manifest(body)
            self._manifest = body
        if self._manifest["journal"] != self.journal_enabled:
            raise StoreError(str(self.journal_path), self.journal_enabled, f"store {self.dir} "
                             f"was begun with journal={self._manifest['journal']}: a journal "
                             "covers a whole run or none of it")  # fmt: skip
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
        outer_meta, outer_tensors = _split_outer(record.outer)
        header = {
            "fragment": p,
            "version": record.version,
            "next_round_id": record.next_round_id,
            "global_step": record.global_step,
            "tokens": record.tokens,
            "count": len(record.values),
            "outer": outer_meta,
            "applied": [list(k) for k in record.applied],
            "merged_base": [[lrn, inc, b] for (lrn, inc), b in sorted(record.merged_base.items())],
        }
        seq = self.seq + (record.ledger is not None)
        if record.ledger is not None:
            header["ledger"] = {"seq": seq, "state": record.ledger}
        tensors = [t.detach().float() for t in record.values] + outer_tensors
        write_atomic(path, _pack(header, tensors))
        self.seq = seq
        self.writes += 1
        if first:
            self._write_manifest(self._settled(self._opened()))

    def save_ledger(self, state: dict[str, Any]) -> None:
        """A ledger snapshot between merges (every merge it counts is already durable)."""
        self._opened()
        write_atomic(self.ledger_path, _pack({"ledger": {"seq": self.seq + 1, "state": state}}, []))
        self.seq += 1

    def append_journal(self, header: dict[str, Any], payloads: list[bytes]) -> None:
        """One merge's inputs: a length-prefixed, checksummed record, fsynced. A failed
        append (a full disk) is cut back, so it is not mistaken for damage later."""
        self._opened()
        head = msgpack.packb({**header, "payloads": [len(p) for p in payloads]}, use_bin_type=True)
        body = _HEAD.pack(JOURNAL_MAGIC, len(head)) + head + b"".join(payloads)
        record = _LEN.pack(len(body)) + body + _CRC.pack(zlib.crc32(body))
        path, created = self.journal_path, not self.journal_path.exists()
        try:
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        except OSError as exc:
            raise _os_error(path, exc, "opening it to append") from exc
        try:
            size = os.fstat(fd).st_size
            view = memoryview(record)
            while view:
                view = view[os.write(fd, view) :]
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
            raise StoreError(str(self.journal_path), True, f"store {self.dir} was begun without "
                             "a journal: one started now would miss its first merges")  # fmt: skip
        records, latest, problems = self._fragments(settled)
        if self.ledger_path.exists():
            try:
                snap = _snapshot(_read(self.ledger_path)[0].get("ledger"), str(self.ledger_path))
                if snap is None:
                    raise StoreError(str(self.ledger_path), None, "no ledger snapshot in it")
                if snap["seq"] > latest[0]:
                    latest = (snap["seq"], snap["state"])
            except StoreError as exc:
                problems.append(str(exc))
        if problems:
            raise StoreError(str(self.dir), len(problems), f"refusing to start from store "
                             f"{self.dir}: " + "; ".join(problems))  # fmt: skip
        self.seq, self.ledger_state = latest
        versions = {p: r.version for p, r in records.items()}
        if self.journal_path.exists():
            self._trim_journal(versions, complete=settled["journal"])
        elif settled["journal"] and any(versions.values()):
            raise StoreError(str(self.journal_path), "missing", f"store {self.dir} keeps a "
                             f"journal and has durable merges {versions}")  # fmt: skip
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
            match = _NAME.fullmatch(name)
            p = int(match[1]) if match else -1
            if match is None or self.fragment_path(p).name != name:
                problems.append(f"{path}: not a fragment file name this store writes")
                continue
            if name not in present:
                problems.append(f"{path}: missing (listed in {MANIFEST}: its fragment merged, "
                                "and restarting it from Theta_0 would lose that)")  # fmt: skip
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
        records: Journal = []
        pos = 0
        while pos < len(data):
            try:
                end, header, payloads = _journal_record(data, pos)
            except _Torn as torn:
                return records, str(torn)
            except _Damaged as exc:
                why = f"record {len(records)} at byte {pos} is damaged ({exc}); only the last "
                raise StoreError(str(self.journal_path), pos, why + "record may be torn") from None
            records.append((pos, end, header, payloads))
            pos = end
        return records, None

    def _trim_journal(self, versions: dict[int, int], complete: bool) -> None:
        """Cut a torn tail, and merges whose fragment file was not written before a crash
        (they were never broadcast, so they never happened); with ``complete`` (the store
        keeps a journal) every durable merge must be in it, in order."""
        data = self.journal_path.read_bytes()
        records, torn = self._scan(data)
        keep = records[-1][1] if records else 0
        if torn is not None:
            self._note(f"{self.journal_path}: cut {len(data) - keep} bytes at byte {keep} after "
                       f"record {len(records) - 1}: {torn}")  # fmt: skip
        seen: dict[int, int] = {}
        cut: int | None = None  # the first merge never written
        for i, (start, _, header, _) in enumerate(records):
            p, v = header.get("fragment"), header.get("version")
            where = f"record {i} at byte {start}"
            if type(p) is not int or type(v) is not int:
                raise StoreError(str(self.journal_path), start, f"{where} names no merge")
            if v > versions.get(p, 0):
                cut = i if cut is None else cut
            elif cut is not None:
                raise StoreError(str(self.journal_path), start, f"{where} is durable but "
                                 f"follows record {cut}, a merge never written")  # fmt: skip
            elif v != seen.get(p, 0) + 1:
                raise StoreError(str(self.journal_path), start, f"{where}: fragment {p} version "
                                 f"{v} follows version {seen.get(p, 0)}")  # fmt: skip
            else:
                seen[p] = v
        if cut is not None:
            start = records[cut][0]
            self._note(f"{self.journal_path}: cut {keep - start} bytes at byte {start}: "
                       f"{len(records) - cut} merges from record {cut} on, never written to "
                       "their fragment files, so never broadcast")  # fmt: skip
            keep = start
        lost = {p: (seen.get(p, 0), v) for p, v in versions.items() if seen.get(p, 0) != v}
        if complete and lost:
            raise StoreError(str(self.journal_path), lost, "merges are missing from the journal "
                             "(fragment: (journal's last version, durable version))")  # fmt: skip
        if keep != len(data):
            try:
                with self.journal_path.open("r+b") as f:
                    f.truncate(keep)
                    f.flush()
                    os.fsync(f.fileno())
            except OSError as exc:
                raise _os_error(self.journal_path, exc, "cutting it") from exc


# -- the bridge between SyncerState and its durable record -----------------------------------
def record_of(
    syncer: SyncerState,
    p: int,
    tokens: int,
    applied: list[Key],
    ledger: dict[str, Any] | None = None,
) -> FragmentRecord:
    """Fragment ``p``'s durable record, right after a merge. ``applied`` is every answer key
    merged into it so far (the service keeps that list: the core forgets merged ids);
    ``ledger`` the ledger's state counting this merge and no later one."""
    policy = syncer.policy
    return FragmentRecord(
        fragment=p,
        version=policy.versions[p],
        next_round_id=policy.next_round_id[p],
        global_step=policy.global_step,
        tokens=tokens,
        values=syncer.fragments[p],
        outer=syncer.outer[p].state_dict(),
        applied=applied,
        merged_base={(lrn, inc): b for (lrn, inc, q), b in policy.merged_base.items() if q == p},
        ledger=ledger,
    )


@torch.no_grad()
def restore(syncer: SyncerState, records: dict[int, FragmentRecord]) -> tuple[int, int]:
    """Load durable records into a freshly built syncer; returns (global step, tokens)."""
    policy = syncer.policy
    step, tokens = 0, 0
    for p, rec in sorted(records.items()):
        if not 0 <= p < len(syncer.fragments):
            raise StoreError("fragment", p, f"the plan has {len(syncer.fragments)} fragments")
        try:
            syncer.restore_fragment(p, rec.values, rec.outer, rec.version, rec.next_round_id,
                                    rec.applied, rec.merged_base)  # fmt: skip
        except ConfigError as exc:
            raise StoreError(exc.field, exc.value, exc.why) from None
        step = max(step, rec.global_step)
        tokens = max(tokens, rec.tokens)
    policy.global_step = step
    return step, tokens


def journal_header(result: MergeResult) -> dict[str, Any]:
    """What the journal keeps about one merge besides the payloads."""
    rnd = result.round
    return {
        "fragment": result.fragment,
        "version": result.version,
        "answers": [
            [a.learner, a.incarnation, a.seq, a.base_version, a.c_steps, a.c_tokens]
            for a in rnd.answers
        ],
    }


def replay_journal(
    store: SyncerStore,
    initial: list[list[torch.Tensor]],
    config: SyncerConfig,
    plain_mask: list[list[bool]],
) -> tuple[list[list[torch.Tensor]], Counter[Key]]:
    """Audit: rebuild the global fragments from Theta_0 and the journal with the core's merge
    and outer optimizer, checking every version appears once and in order; also return how
    often each answer key was merged (a doubled update shows up as a count of 2)."""
    fragments = [[t.detach().to(torch.float32, copy=True) for t in f] for f in initial]
    outers = [make_outer_optimizer(config.outer) for _ in fragments]
    workspace = torch.empty(max(sum(t.numel() for t in f) for f in fragments))
    merged: Counter[Key] = Counter()
    versions = [0] * len(fragments)
    for header, payloads in store.journal():
        p = header["fragment"]
        if header["version"] != versions[p] + 1:
            raise StoreError("journal", header["version"], f"fragment {p} was at {versions[p]}")
        versions[p] = header["version"]
        answers = header["answers"]  # learner, incarnation, seq, base, c_steps, c_tokens
        merged.update((a[0], a[1], a[2]) for a in answers)
        weights = [token_weight(a[5], a[4]) for a in answers]
        deltas = [decode_tensors(payload) for payload in payloads]
        norms = [tensor_norms(d) for d in deltas]
        merge_step(fragments[p], outers[p], deltas, weights, norms, config.merge_rule,
                   plain_mask[p], workspace)  # fmt: skip
    return fragments, merged


def recompute(
    config: RunConfig, store: SyncerStore
) -> tuple[list[list[torch.Tensor]], Counter[Key]]:
    """Audit a run: its global fragments rebuilt from Theta_0 and ``store``'s journal, and how
    often each answer was merged. Merges on one torch thread, as the syncer does, so a faithful
    store matches bit for bit (a reduction's rounding depends on the thread count)."""
    setup = RunSetup(config)
    initial = [gather(setup.plan, p, setup.initial) for p in range(setup.plan.num_fragments)]
    masks = [[s.name in setup.plain for s in f.slices] for f in setup.plan.fragments]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return replay_journal(store, initial, setup.settings.sync.syncer_config(), masks)
    finally:
        torch.set_num_threads(threads)
