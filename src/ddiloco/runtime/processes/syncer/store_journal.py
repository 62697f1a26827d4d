"""The syncer's merge journal: its record format, how it is read back, and the audits on it.

The journal is append-only and optional (:class:`.store.SyncerStore` appends to it and
cuts it); what a kill can leave in it, and what a restart may cut, is subtle
enough to live apart from the store's other files. This module tells a record a kill left
torn (only the last one, cut) from damage (refused), finds the merges no fragment file
recorded (never broadcast, cut) and checks that a complete journal holds every durable merge
in order. The audits rebuild the global fragments from Theta_0 and the journal
(:func:`replay_journal`, :func:`recompute`) to check that a store is faithful.

Record: u64 n | n-byte body (b"DDSJ" | u32 header length | msgpack header | payloads) | u32
crc32 of the body. The header lists the payloads' sizes besides :func:`journal_header`.
"""

from __future__ import annotations

import struct
import zlib
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import msgpack
import torch

from ddiloco.config import RunConfig
from ddiloco.core.codec import decode_tensors
from ddiloco.core.fragment_state import Key
from ddiloco.core.fragments import gather
from ddiloco.core.merge import tensor_norms
from ddiloco.core.outer import make_outer_optimizer
from ddiloco.core.robust import scaled
from ddiloco.core.stale import UpdateHistory, anchor_answers, answer_weights
from ddiloco.core.syncer_state import MergeResult, SyncerConfig, merge_step
from ddiloco.runtime.processes.syncer.store_format import CRC, HEAD, StoreError
from ddiloco.runtime.run import RunSetup


class Journaled(Protocol):
    """What an audit reads: a store's journal records, in order (``SyncerStore`` is one)."""

    def journal(self) -> Iterator[tuple[dict[str, Any], list[bytes]]]: ...


JOURNAL_MAGIC = b"DDSJ"
_LEN = struct.Struct("<Q")

Journal = list[tuple[int, int, dict[str, Any], list[bytes]]]  # (start, end, header, payloads)


class _Torn(Exception):
    """What is left of the journal could be a record cut short by a kill."""


class _Damaged(Exception):
    """A journal record no kill could have produced."""


def journal_chunks(header: dict[str, Any], payloads: list[bytes]) -> list[bytes]:
    """One merge's record: its header (with the payloads' sizes) and payloads, checksummed;
    as chunks, the payloads themselves among them (joined, they were one more copy of a
    round's answers)."""
    sizes = [len(p) for p in payloads]
    head: bytes = msgpack.packb({**header, "payloads": sizes}, use_bin_type=True)
    first = HEAD.pack(JOURNAL_MAGIC, len(head)) + head
    crc = zlib.crc32(first)
    for p in payloads:
        crc = zlib.crc32(p, crc)
    length = len(first) + sum(sizes)
    return [_LEN.pack(length) + first, *payloads, CRC.pack(crc)]


def _journal_body(body: bytes, n: int) -> tuple[dict[str, Any] | None, list[bytes]]:
    """A journal record's body, or the prefix of one a kill left: (header, payloads), the
    header None while incomplete. Raises _Damaged if no prefix of a record looks like it."""
    if len(body) < HEAD.size:
        if len(body) >= n:
            raise _Damaged(f"a {n}-byte record, too short for a header")
        return None, []
    magic, head_len = HEAD.unpack_from(body, 0)
    if magic != JOURNAL_MAGIC:
        raise _Damaged(f"bad magic {bytes(magic)!r}")
    if HEAD.size + head_len > n:
        raise _Damaged(f"a {head_len}-byte header in a {n}-byte record")
    if len(body) < HEAD.size + head_len:
        return None, []
    try:
        header = msgpack.unpackb(body[HEAD.size : HEAD.size + head_len], raw=False)
        sizes = [int(s) for s in header["payloads"]]
    except Exception as exc:
        raise _Damaged(f"an undecodable header ({exc})") from None
    if HEAD.size + head_len + sum(sizes) != n:
        raise _Damaged(f"a length field of {n} bytes that its header contradicts")
    payloads, at = [], HEAD.size + head_len
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
    end = pos + _LEN.size + n + CRC.size
    body = data[pos + _LEN.size : min(end - CRC.size, len(data))]
    try:
        header, payloads = _journal_body(body, n)
    except _Damaged:
        if not data[pos:].strip(b"\0"):  # a crash after the size grew, before the data
            raise _Torn("a zero-filled tail") from None
        raise
    if end > len(data):
        raise _Torn(f"a record cut short ({left} of {end - pos} bytes)")
    (crc,) = CRC.unpack_from(data, end - CRC.size)
    if zlib.crc32(body) != crc:
        if end == len(data):
            raise _Torn("a checksum mismatch on the last record")
        raise _Damaged("checksum mismatch")
    if header is None:
        raise _Damaged("a record without a header")
    return end, header, payloads


def scan_journal(data: bytes, where: str) -> tuple[Journal, str | None]:
    """The journal's records and, if it ends in a torn one, why; damage elsewhere raises
    StoreError naming ``where`` (the journal file)."""
    records: Journal = []
    pos = 0
    while pos < len(data):
        try:
            end, header, payloads = _journal_record(data, pos)
        except _Torn as torn:
            return records, str(torn)
        except _Damaged as exc:
            why = f"record {len(records)} at byte {pos} is damaged ({exc}); only the last "
            raise StoreError(where, pos, why + "record may be torn") from None
        records.append((pos, end, header, payloads))
        pos = end
    return records, None


def journal_keep(
    data: bytes, versions: dict[int, int], complete: bool, where: str, note: Callable[[str], None]
) -> int:
    """How many bytes of the journal ``data`` (file ``where``) to keep: a torn tail is cut,
    and so are merges newer than the durable ``versions`` (their fragment file was not written
    before a crash: never broadcast, so they never happened); each cut is ``note``d. With
    ``complete`` (the store keeps a journal) every durable merge must be in it, in order."""
    records, torn = scan_journal(data, where)
    keep = records[-1][1] if records else 0
    if torn is not None:
        note(
            f"{where}: cut {len(data) - keep} bytes at byte {keep} after "
            f"record {len(records) - 1}: {torn}"
        )
    seen: dict[int, int] = {}
    cut: int | None = None  # the first merge never written
    for i, (start, _, header, _) in enumerate(records):
        p, v = header.get("fragment"), header.get("version")
        at = f"record {i} at byte {start}"
        if type(p) is not int or type(v) is not int:
            raise StoreError(where, start, f"{at} names no merge")
        if v > versions.get(p, 0):
            cut = i if cut is None else cut
        elif cut is not None:
            raise StoreError(
                where, start, f"{at} is durable but follows record {cut}, a merge never written"
            )
        elif v != seen.get(p, 0) + 1:
            raise StoreError(
                where, start, f"{at}: fragment {p} version {v} follows version {seen.get(p, 0)}"
            )
        else:
            seen[p] = v
    if cut is not None:
        start = records[cut][0]
        note(
            f"{where}: cut {keep - start} bytes at byte {start}: "
            f"{len(records) - cut} merges from record {cut} on, never written to "
            "their fragment files, so never broadcast"
        )
        keep = start
    lost = {p: (seen.get(p, 0), v) for p, v in versions.items() if seen.get(p, 0) != v}
    if complete and lost:
        raise StoreError(
            where,
            lost,
            "merges are missing from the journal "
            "(fragment: (journal's last version, durable version))",
        )
    return keep


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
        "scales": list(result.scales),  # robust merging's clip factor of each answer
        "schedule_scale": result.schedule_scale,  # the outer step's inner-lr factor
        "fraction": result.fraction,  # ... and the share of a sync period it covers
        "anchored": list(result.anchored),  # late answers re-taken against the current value
    }


# -- audits -----------------------------------------------------------------------------------
def replay_journal(
    store: Journaled,
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
    rounds = config.rounds
    depth = rounds.max_staleness if rounds.anchor == "current" else 0
    history = UpdateHistory(len(fragments), depth)  # (depth 0: keeps nothing)
    for header, payloads in store.journal():
        p = header["fragment"]
        if header["version"] != versions[p] + 1:
            raise StoreError("journal", header["version"], f"fragment {p} was at {versions[p]}")
        versions[p] = header["version"]
        answers = header["answers"]  # learner, incarnation, seq, base, c_steps, c_tokens
        merged.update((a[0], a[1], a[2]) for a in answers)
        stale = [header["version"] - 1 - a[3] for a in answers]
        weights = answer_weights([(a[5], a[4]) for a in answers], stale, rounds.stale_weight)
        deltas: list[Sequence[torch.Tensor]] = [decode_tensors(payload) for payload in payloads]
        norms = [tensor_norms(d) for d in deltas]
        marked = header.get("anchored", [])
        if marked and len(marked) != len(answers):
            why = f"fragment {p}: {len(marked)} anchored flags for {len(answers)} answers"
            raise StoreError("journal", header["version"], why)
        if marked:  # re-taken against the current value, as the syncer did
            bases = [a[3] for a in answers]
            anchor_answers(history, p, versions[p] - 1, bases, deltas, norms, marked)
        for i, s in enumerate(header.get("scales", [])):  # answers the merge clipped
            if s < 1.0:
                deltas[i] = scaled(deltas[i], s)
                norms[i] = tensor_norms(deltas[i])
        before = history.before(fragments[p])
        merge_step(
            fragments[p],
            outers[p],
            deltas,
            weights,
            norms,
            config.merge_rule,
            plain_mask[p],
            workspace,
            float(header.get("schedule_scale", 1.0)),
            float(header.get("fraction", 1.0)),
        )
        history.after(p, versions[p], before, fragments[p])
    return fragments, merged


def recompute(config: RunConfig, store: Journaled) -> tuple[list[list[torch.Tensor]], Counter[Key]]:
    """Audit a run: its global fragments rebuilt from Theta_0 and ``store``'s journal, and how
    often each answer was merged. Merges on one torch thread, as the syncer does, so a faithful
    store matches bit for bit (a reduction's rounding depends on the thread count)."""
    setup = RunSetup(config)
    initial = [gather(setup.plan, p, setup.initial) for p in range(setup.plan.num_fragments)]
    masks = [[s.name in setup.plain for s in f.slices] for f in setup.plan.fragments]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return replay_journal(store, initial, setup.method.sync.syncer_config(), masks)
    finally:
        torch.set_num_threads(threads)
