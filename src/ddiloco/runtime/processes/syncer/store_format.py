"""The byte formats of the syncer's durable state, apart from the files that hold them.

:mod:`~ddiloco.runtime.processes.syncer.store` decides when and where a file is written and what a
restart may trust; this module only says what the bytes are and checks them, so a format
(or a check of one) can be read and tested without the store's crash-safety and bookkeeping.
It owns the error every store module raises, a fragment file's record, the fragment and
ledger files' layout, the manifest's body and the run fingerprint the manifest carries.

Fragment and ledger file (never pickle): b"DDSF" | u32 header length | msgpack header | codec
bundle of the fragment's tensors then the outer state's tensors | u32 crc32 of everything
before it. ``ledger.bin`` is such a file with no tensors and only a ledger snapshot.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import re
import struct
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import msgpack
import torch

from ddiloco.core.codec import CodecSpec, decode_tensors, encode_tensors_chunks
from ddiloco.core.fragment_state import FragmentState
from ddiloco.errors import DDiLoCoError
from ddiloco.runtime.run import RunSetup

MAGIC = b"DDSF"
MANIFEST = "manifest.json"
TICKETS_FILE = "tickets.bin"  # the connection tickets admitted (transport/tickets.py)
MANIFEST_FORMAT = 1
HEAD = struct.Struct("<4sI")
CRC = struct.Struct("<I")
_FP32 = CodecSpec("fp32")
FRAGMENT_FILE = re.compile(r"fragment-(\d{4,})\.bin")


class StoreError(DDiLoCoError):
    """A durable file is missing, damaged, foreign or could not be written: the syncer must
    not start (or go on) from it. A torn write cannot happen; a torn journal tail is cut."""


@dataclass(kw_only=True)
class FragmentRecord(FragmentState):
    """Everything the syncer must not lose about one fragment: its state (the core's
    :class:`FragmentState`, what the simulated clock's checkpoints hold too) and where the run
    stood when it was merged."""

    fragment: int
    global_step: int
    tokens: int
    ledger: dict[str, Any] | None = None  # the token ledger's plain state, with this merge
    ema: tuple[float | None, float | None] = (None, None)  # step-time, sync-time EMAs


def fingerprint_of(setup: RunSetup) -> str:
    """The run's identity for the manifest: a store written for another model, seed, method,
    plan or outer optimizer holds state this run cannot continue from."""
    plan, cfg = setup.plan, setup.method.sync.syncer_config()
    layout = [
        [plan.partition, plan.sync_every, cfg.merge_rule, repr(cfg.outer)],
        [[s.name, list(s.shape)] for s in plan.specs],
        [[f.offset, [[s.name, s.rows] for s in f.slices]] for f in plan.fragments],
    ]
    digest = hashlib.sha256(json.dumps(layout).encode()).hexdigest()[:16]
    c = setup.config
    return (
        f"model={c.model} seed={c.seed} method={setup.method.name} "
        f"fragments={plan.num_fragments} plan={digest}"
    )


# -- fragment and ledger files ----------------------------------------------------------------
def pack_state(header: dict[str, Any], tensors: list[torch.Tensor]) -> bytes:
    return b"".join(pack_state_chunks(header, tensors))


def pack_state_chunks(header: dict[str, Any], tensors: list[torch.Tensor]) -> Iterator[bytes]:
    """A state file's bytes, one tensor at a time (the writer streams them: a fragment file
    was three fragment-sized copies in memory while written), its checksum last."""
    head: bytes = msgpack.packb(header, use_bin_type=True)
    crc = 0
    for chunk in itertools.chain(
        [HEAD.pack(MAGIC, len(head)) + head], encode_tensors_chunks(tensors, _FP32)
    ):
        crc = zlib.crc32(chunk, crc)
        yield chunk
    yield CRC.pack(crc)


def unpack_state(data: bytes, where: str) -> tuple[dict[str, Any], list[torch.Tensor]]:
    if len(data) < HEAD.size + CRC.size:
        raise StoreError(where, len(data), "too short to be a syncer state file")
    (crc,) = CRC.unpack_from(data, len(data) - CRC.size)
    body = memoryview(data)[: len(data) - CRC.size]
    if zlib.crc32(body) != crc:
        raise StoreError(where, crc, "checksum mismatch: the file is damaged")
    magic, head_len = HEAD.unpack_from(body, 0)
    if magic != MAGIC:
        raise StoreError(where, bytes(magic), f"expected {MAGIC!r}")
    try:
        header = msgpack.unpackb(body[HEAD.size : HEAD.size + head_len], raw=False)
        tensors = decode_tensors(body[HEAD.size + head_len :])
    except Exception as exc:  # msgpack's, the codec's: any of them means a damaged file
        raise StoreError(where, type(exc).__name__, f"undecodable: {exc}") from None
    if not isinstance(header, dict):
        raise StoreError(where, type(header).__name__, "the header is not a map")
    return header, tensors


def ledger_snapshot(value: Any, where: str) -> dict[str, Any] | None:
    if value is not None and not (isinstance(value, dict) and type(value.get("seq")) is int):
        raise StoreError(where, "ledger", "malformed ledger snapshot")
    return value


def fragment_chunks(record: FragmentRecord, seq: int) -> Iterator[bytes]:
    """Fragment ``record.fragment``'s file; its ledger snapshot, if any, numbered ``seq``."""
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
        "norm_window": [float(v) for v in record.norm_window],
        "merged_opened": record.merged_opened,
        "ema": list(record.ema),
    }
    if record.ledger is not None:
        header["ledger"] = {"seq": seq, "state": record.ledger}
    tensors = [t.detach().float() for t in record.values] + outer_tensors
    return pack_state_chunks(header, tensors)


def fragment_of(
    header: dict[str, Any], tensors: list[torch.Tensor], where: str
) -> tuple[FragmentRecord, int]:
    """A fragment file's unpacked content as its record and its ledger snapshot's seq, every
    field checked."""
    try:
        count, meta = header["count"], header["outer"]
        if count + sum(item.get("tensors", 0) for item in meta.values()) != len(tensors):
            raise ValueError(f"{len(tensors)} tensors do not match the header")
        snapshot = ledger_snapshot(header.get("ledger"), where) or {"seq": 0, "state": None}
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
            norm_window=[float(v) for v in header.get("norm_window", [])],
            merged_opened=optional_int(header.get("merged_opened")),  # (None: an older file)
            ema=ema_of(header.get("ema", [None, None])),
        ), snapshot["seq"]
    except StoreError:
        raise
    except Exception as exc:
        raise StoreError(where, type(exc).__name__, f"malformed header: {exc}") from None


def optional_int(value: Any) -> int | None:
    return None if value is None else int(value)


def ema_of(value: Any) -> tuple[float | None, float | None]:
    step, sync = value  # (a malformed one raises: the header is refused)
    return (None if step is None else float(step)), (None if sync is None else float(sync))


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


# -- the manifest -----------------------------------------------------------------------------
def canonical(body: dict[str, Any]) -> bytes:
    """The bytes the manifest's crc32 covers."""
    return json.dumps(body, sort_keys=True).encode()


def check_manifest(body: dict[str, Any], where: str) -> None:
    """A checksummed manifest body's format and fields, before it is compared with the run."""
    if body.get("format") != MANIFEST_FORMAT:
        raise StoreError(where, body.get("format"), f"this build reads format {MANIFEST_FORMAT}")
    names = body.get("files")
    pending = body.get("pending")
    if not (
        isinstance(names, list)
        and (pending is None or isinstance(pending, str))
        and all(
            isinstance(n, str) and FRAGMENT_FILE.fullmatch(n)
            for n in [*names, pending or "fragment-0000.bin"]
        )
        and isinstance(body.get("journal"), bool)
    ):
        raise StoreError(where, sorted(body), "malformed manifest")
