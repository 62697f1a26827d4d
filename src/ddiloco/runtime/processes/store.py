"""The syncer's durable state: what a syncer killed at any moment restarts from.

Owns the on-disk record of the global fragments, their outer-optimizer state, versions,
next round ids and the applied-update ids (the answer keys merged into each fragment, and
the highest base merged per learner life), and how that record is read back into a fresh
:class:`~ddiloco.core.syncer_state.SyncerState`. One file per fragment, rewritten after each
of its merges *before* the merged fragment is broadcast, so every acknowledged merge is on
disk; a write is crash-safe (temp file, fsync, rename, fsync of the directory), so a file is
always either the old or the new version, never a torn mix. An optional append-only journal
keeps every merge's inputs (answer metadata and payloads) so a test or an audit can recompute
the merged state from Theta_0; a torn journal tail is cut off on load.

The token ledger is durable too (docs/decisions.md 33): its plain-data snapshot rides in the
header of every fragment file, so a merge and the ledger that counts it are written by one
rename, and ``ledger.bin`` takes a fresher snapshot between merges. Every snapshot carries a
sequence number; the highest one on disk is the ledger a restarted syncer loads, and it
counts exactly the merges that are durable (each merge is written before any later one).

Format (never pickle): b"DDSF" | u32 header length | msgpack header | codec bundle of the
fragment's tensors then the outer state's tensors | u32 crc32 of everything before it.
"""

from __future__ import annotations

import os
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
_HEAD = struct.Struct("<4sI")
_CRC = struct.Struct("<I")
_FP32 = CodecSpec("fp32")

Key = tuple[int, int, int]


class StoreError(DDiLoCoError):
    """A durable file is damaged (not a torn write: those cannot happen)."""


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


def write_atomic(path: Path, data: bytes | bytearray) -> None:
    """Write ``data`` so that ``path`` holds either its old content or all of ``data``."""
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    dfd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


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
    header = msgpack.unpackb(body[_HEAD.size : _HEAD.size + head_len], raw=False)
    tensors = decode_tensors(body[_HEAD.size + head_len :])
    return header, tensors


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


class SyncerStore:
    """A directory holding one syncer's durable state (and, optionally, its journal)."""

    def __init__(self, directory: str | Path, journal: bool = False) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.journal_enabled = journal
        self.journal_path = self.dir / "journal.bin"
        self.ledger_path = self.dir / "ledger.bin"
        self.writes = 0
        self.seq = 0  # of the latest ledger snapshot written or loaded
        self.ledger_state: dict[str, Any] | None = None  # the latest one on disk, after load()

    def fragment_path(self, p: int) -> Path:
        return self.dir / f"fragment-{p:04d}.bin"

    # -- writing ----------------------------------------------------------------------------
    def save(self, record: FragmentRecord) -> None:
        outer_meta, outer_tensors = _split_outer(record.outer)
        header = {
            "fragment": record.fragment,
            "version": record.version,
            "next_round_id": record.next_round_id,
            "global_step": record.global_step,
            "tokens": record.tokens,
            "count": len(record.values),
            "outer": outer_meta,
            "applied": [list(k) for k in record.applied],
            "merged_base": [[lrn, inc, b] for (lrn, inc), b in sorted(record.merged_base.items())],
        }
        if record.ledger is not None:
            self.seq += 1
            header["ledger"] = {"seq": self.seq, "state": record.ledger}
        tensors = [t.detach().float() for t in record.values] + outer_tensors
        write_atomic(self.fragment_path(record.fragment), _pack(header, tensors))
        self.writes += 1

    def save_ledger(self, state: dict[str, Any]) -> None:
        """A ledger snapshot between merges (every merge it counts is already durable)."""
        self.seq += 1
        write_atomic(self.ledger_path, _pack({"ledger": {"seq": self.seq, "state": state}}, []))

    def append_journal(self, header: dict[str, Any], payloads: list[bytes]) -> None:
        """One merge's inputs: a length-prefixed, checksummed record, fsynced."""
        head = msgpack.packb({**header, "payloads": [len(p) for p in payloads]}, use_bin_type=True)
        body = _HEAD.pack(JOURNAL_MAGIC, len(head)) + head + b"".join(payloads)
        record = struct.pack("<Q", len(body)) + body + _CRC.pack(zlib.crc32(body))
        with self.journal_path.open("ab") as f:
            f.write(record)
            f.flush()
            os.fsync(f.fileno())

    # -- reading ----------------------------------------------------------------------------
    def load(self) -> dict[int, FragmentRecord]:
        """Every fragment file present (an empty dict for a fresh start); left-over temp
        files from a crash mid-write are removed, and the journal is cut to match."""
        for tmp in self.dir.glob(".*.tmp"):
            tmp.unlink()
        records: dict[int, FragmentRecord] = {}
        latest: dict[str, Any] = {"seq": 0, "state": None}
        if self.ledger_path.exists():
            latest = _unpack(self.ledger_path.read_bytes(), str(self.ledger_path))[0]["ledger"]
        for path in sorted(self.dir.glob("fragment-*.bin")):
            header, tensors = _unpack(path.read_bytes(), str(path))
            snapshot = header.get("ledger")
            if snapshot is not None and snapshot["seq"] > latest["seq"]:
                latest = snapshot
            count = header["count"]
            records[header["fragment"]] = FragmentRecord(
                fragment=header["fragment"],
                version=header["version"],
                next_round_id=header["next_round_id"],
                global_step=header["global_step"],
                tokens=header["tokens"],
                values=tensors[:count],
                outer=_join_outer(header["outer"], tensors[count:]),
                applied=[(a[0], a[1], a[2]) for a in header["applied"]],
                merged_base={(a[0], a[1]): a[2] for a in header["merged_base"]},
                ledger=None if snapshot is None else snapshot["state"],
            )
        self.seq, self.ledger_state = latest["seq"], latest["state"]
        if self.journal_path.exists():
            self._trim_journal({p: r.version for p, r in records.items()})
        return records

    def journal(self) -> Iterator[tuple[dict[str, Any], list[bytes]]]:
        """The journal's intact records, in order: (header, payloads)."""
        if not self.journal_path.exists():
            return
        for _, header, payloads in self._records(self.journal_path.read_bytes()):
            yield header, payloads

    def _records(self, data: bytes) -> Iterator[tuple[int, dict[str, Any], list[bytes]]]:
        """(end offset, header, payloads) of each intact record; stops at a torn tail."""
        pos = 0
        while pos + 8 <= len(data):
            (n,) = struct.unpack_from("<Q", data, pos)
            end = pos + 8 + n + _CRC.size
            if end > len(data):
                return
            body = data[pos + 8 : pos + 8 + n]
            (crc,) = _CRC.unpack_from(data, pos + 8 + n)
            if zlib.crc32(body) != crc:
                return
            _, head_len = _HEAD.unpack_from(body, 0)
            header = msgpack.unpackb(body[_HEAD.size : _HEAD.size + head_len], raw=False)
            payloads, at = [], _HEAD.size + head_len
            for size in header["payloads"]:
                payloads.append(body[at : at + size])
                at += size
            yield end, header, payloads
            pos = end

    def _trim_journal(self, versions: dict[int, int]) -> None:
        """Cut a torn tail, and merges whose fragment file was not written before a crash
        (they were never broadcast, so they never happened)."""
        data = self.journal_path.read_bytes()
        keep = 0
        for end, header, _ in self._records(data):
            if header["version"] > versions.get(header["fragment"], 0):
                break
            keep = end
        if keep != len(data):
            with self.journal_path.open("r+b") as f:
                f.truncate(keep)
                f.flush()
                os.fsync(f.fileno())


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
