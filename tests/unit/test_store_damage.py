"""Attacks on the syncer's store: each is refused naming the file, or cut and said so.

A restart must never quietly restart a fragment from Theta_0, cut a damaged journal, or
crash on a full disk with a half-written file left behind.
"""

from __future__ import annotations

import errno
import os
import stat
import zlib
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from ddiloco.config import load_config
from ddiloco.runtime.processes.syncer import store as store_mod
from ddiloco.runtime.processes.syncer import store_format
from ddiloco.runtime.processes.syncer.store import (
    FragmentRecord,
    StoreError,
    SyncerStore,
    fingerprint_of,
)
from ddiloco.runtime.run import RunSetup

FP = "model=test seed=0 plan=A"
N = 4
MERGES = ((0, 1), (1, 1), (0, 2), (2, 1), (1, 2))  # fragment 3 never merges: it has no file


def record(p: int, v: int) -> FragmentRecord:
    values = [torch.full((3, 2), float(10 * p + v)), torch.arange(4.0) + v]
    outer = {"steps": v, "buffers": [t * 2 for t in values]}
    return FragmentRecord(
        v, v + 1, values, outer, [(0, 1, v)], {(0, 1): v},
        fragment=p, global_step=v, tokens=64 * v, ledger={"merges": v},
    )  # fmt: skip


def entry(p: int, v: int) -> tuple[dict[str, int | list[int]], list[bytes]]:
    return {"fragment": p, "version": v, "answers": []}, [bytes([p, v]) * 40, b"x" * v]


def open_store(path: Path, fingerprint: str | None = FP, fragments: int | None = N) -> SyncerStore:
    return SyncerStore(path, journal=True, fingerprint=fingerprint, fragments=fragments)


def build(path: Path) -> SyncerStore:
    store = open_store(path)
    for p, v in MERGES:
        store.append_journal(*entry(p, v))
        store.save(record(p, v))
    store.save_ledger({"beat": 1})
    return store


def flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x10
    path.write_bytes(bytes(data))


def refused(path: Path, *match: str) -> str:
    """Loading the store at ``path`` raises StoreError; its message, which names each match."""
    with pytest.raises(StoreError) as info:
        open_store(path).load()
    message = str(info.value)
    for text in match:
        assert text in message, message
    return message


def record_offsets(store: SyncerStore) -> list[int]:
    return [start for start, *_ in store._scan(store.journal_path.read_bytes())[0]]


def test_an_intact_store_loads_everything(tmp_path):
    build(tmp_path)
    store = open_store(tmp_path)
    records = store.load()
    assert {p: r.version for p, r in records.items()} == {0: 2, 1: 2, 2: 1}
    assert torch.equal(records[1].values[0], torch.full((3, 2), 12.0))
    assert store.ledger_state == {"beat": 1} and store.notes == []
    assert [h["version"] for h, _ in store.journal()] == [1, 1, 2, 1, 2]


def test_a_deleted_fragment_file_is_refused_not_reset(tmp_path):
    build(tmp_path)
    (tmp_path / "fragment-0001.bin").unlink()
    refused(tmp_path, f"{tmp_path / 'fragment-0001.bin'}: missing")
    assert len(list(open_store(tmp_path).journal())) == 5  # the journal was not cut


@pytest.mark.parametrize("to", ["fragment-0003.bin", "fragment-0007.bin"])
def test_a_renamed_fragment_file_is_refused(tmp_path, to):
    build(tmp_path)
    (tmp_path / "fragment-0002.bin").rename(tmp_path / to)
    refused(
        tmp_path,
        f"{tmp_path / 'fragment-0002.bin'}: missing",
        f"{tmp_path / to}: mislabelled: its header says fragment 2",
    )


def test_a_file_whose_header_names_another_fragment_is_refused(tmp_path):
    build(tmp_path)
    (tmp_path / "fragment-0000.bin").write_bytes((tmp_path / "fragment-0001.bin").read_bytes())
    refused(tmp_path, f"{tmp_path / 'fragment-0000.bin'}: mislabelled")


def test_an_unlisted_fragment_file_is_refused(tmp_path):
    build(tmp_path / "a")
    other = open_store(tmp_path / "b")
    other.save(record(3, 1))
    (tmp_path / "b" / "fragment-0003.bin").rename(tmp_path / "a" / "fragment-0003.bin")
    refused(tmp_path / "a", f"{tmp_path / 'a' / 'fragment-0003.bin'}: not listed")


@pytest.mark.parametrize("where", [9, 60, -40, -2])  # header, tensors, near the end, crc
def test_a_flipped_bit_in_a_fragment_file_is_refused(tmp_path, where):
    build(tmp_path)
    path = tmp_path / "fragment-0002.bin"
    flip(path, where % path.stat().st_size)
    refused(tmp_path, str(path), "checksum mismatch")


def test_a_truncated_or_undecodable_fragment_file_is_refused(tmp_path):
    build(tmp_path)
    path = tmp_path / "fragment-0002.bin"
    path.write_bytes(path.read_bytes()[:5])
    refused(tmp_path, str(path), "too short")
    body = store_format.HEAD.pack(store_format.MAGIC, 3) + b"\xc1\xc1\xc1"  # 0xc1: never msgpack
    path.write_bytes(body + store_format.CRC.pack(zlib.crc32(body)))
    refused(tmp_path, str(path), "undecodable")


def test_a_damaged_ledger_file_is_refused(tmp_path):
    build(tmp_path)
    flip(tmp_path / "ledger.bin", 12)
    refused(tmp_path, str(tmp_path / "ledger.bin"), "checksum mismatch")


@pytest.mark.parametrize("at", [0, 3, 20, 60])  # length field (low, high byte), header, payload
def test_a_flipped_bit_in_the_middle_of_the_journal_is_refused_not_cut(tmp_path, at):
    store = build(tmp_path)
    size = store.journal_path.stat().st_size
    start = record_offsets(store)[2]
    flip(store.journal_path, start + at)
    refused(tmp_path, str(store.journal_path), f"record 2 at byte {start} is damaged")
    assert store.journal_path.stat().st_size == size


def _short_length(data: bytes, record: bytes) -> bytes:
    return data + record[:5]


def _short_record(data: bytes, record: bytes) -> bytes:
    return data + record[: len(record) // 2]


def _bad_last_crc(data: bytes, record: bytes) -> bytes:
    return data + record[:-30] + bytes([record[-30] ^ 1]) + record[-29:]


def _zero_filled(data: bytes, record: bytes) -> bytes:
    return data + bytes(len(record))


@pytest.mark.parametrize("tear", [_short_length, _short_record, _bad_last_crc, _zero_filled])
def test_a_torn_last_journal_record_is_cut_and_said_so(tmp_path, tear: Callable[..., bytes]):
    store = build(tmp_path)
    data = store.journal_path.read_bytes()
    store.append_journal(*entry(3, 1))  # killed mid-append, before its fragment was saved
    record = store.journal_path.read_bytes()[len(data) :]
    store.journal_path.write_bytes(tear(data, record))
    again = open_store(tmp_path)
    again.load()
    assert store.journal_path.read_bytes() == data
    assert len(again.notes) == 1 and str(again.journal_path) in again.notes[0]
    assert f"cut {len(tear(data, record)) - len(data)} bytes at byte {len(data)}" in again.notes[0]


def test_merges_never_written_to_a_fragment_file_are_cut_and_said_so(tmp_path, caplog):
    store = build(tmp_path)
    data = store.journal_path.read_bytes()
    store.append_journal(*entry(3, 1))  # killed between the journal and the fragment file
    again = open_store(tmp_path)
    again.load()
    assert store.journal_path.read_bytes() == data
    assert "never broadcast" in again.notes[0] and "never broadcast" in caplog.text


def test_a_journal_missing_durable_merges_is_refused(tmp_path):
    store = build(tmp_path)
    data = store.journal_path.read_bytes()
    store.journal_path.write_bytes(data[: record_offsets(store)[-1]])  # cut at a boundary
    refused(tmp_path, str(store.journal_path), "missing from the journal")
    store.journal_path.write_bytes(data[: record_offsets(store)[-1]] + data[-7:])  # torn
    refused(tmp_path, str(store.journal_path), "missing from the journal")
    store.journal_path.unlink()
    refused(tmp_path, str(store.journal_path), "missing")


def test_a_store_written_for_another_run_or_plan_is_refused(tmp_path):
    build(tmp_path)
    with pytest.raises(StoreError, match="was written by another model/plan/run") as info:
        open_store(tmp_path, fingerprint="model=other").load()
    assert f"store {tmp_path}" in str(info.value)
    with pytest.raises(StoreError, match="another plan: 4 fragments, this run has 5"):
        open_store(tmp_path, fragments=5).load()
    with pytest.raises(StoreError, match="another model"):  # before writing anything
        open_store(tmp_path, fingerprint="model=other").save_ledger({})
    assert len(open_store(tmp_path, fingerprint=None, fragments=None).load()) == 3  # an audit


def test_store_files_without_a_manifest_are_refused(tmp_path):
    build(tmp_path)
    (tmp_path / "manifest.json").unlink()
    refused(tmp_path, str(tmp_path / "manifest.json"), "fragment-0000.bin")
    with pytest.raises(StoreError, match=r"manifest\.json"):
        open_store(tmp_path).save(record(0, 3))  # nor is one begun over them


def test_a_manifest_whose_files_are_gone_is_refused(tmp_path):
    build(tmp_path)
    for path in tmp_path.glob("fragment-*.bin"):
        path.unlink()
    refused(tmp_path, "fragment-0000.bin: missing", "fragment-0001.bin: missing")


def test_a_damaged_manifest_is_refused(tmp_path):
    build(tmp_path)
    path = tmp_path / "manifest.json"
    path.write_text(path.read_text().replace('"fragment-0001.bin"', '"fragment-0005.bin"'))
    refused(tmp_path, str(path), "checksum mismatch")


def test_an_empty_or_missing_directory_is_a_fresh_start(tmp_path):
    assert open_store(tmp_path).load() == {}
    assert open_store(tmp_path / "new" / "store").load() == {}
    assert open_store(tmp_path / "new" / "store").load() == {}


class Killed(BaseException):
    """The syncer killed between two writes."""


@pytest.mark.parametrize("kill_before", ["fragment-0003.bin", "manifest.json"])
def test_a_kill_around_a_fragments_first_file_leaves_a_store_that_loads(
    tmp_path, monkeypatch, kill_before
):
    build(tmp_path)
    real = store_mod.write_atomic
    writes: list[str] = []

    def write(path: Path, data: bytes | bytearray) -> None:
        if path.name == kill_before and (path.name != "manifest.json" or writes):
            raise Killed  # before the fragment file, or before the manifest lists it
        writes.extend([path.name] if path.name == "fragment-0003.bin" else [])
        real(path, data)

    store = open_store(tmp_path)
    store.append_journal(*entry(3, 1))
    monkeypatch.setattr(store_mod, "write_atomic", write)
    with pytest.raises(Killed):
        store.save(record(3, 1))
    monkeypatch.undo()
    records = open_store(tmp_path).load()
    assert (3 in records) == (kill_before == "manifest.json")
    manifest = store_mod.json.loads((tmp_path / "manifest.json").read_text())["manifest"]
    assert manifest["pending"] is None


def full_disk(after: int, code: int = errno.ENOSPC, only: str = "") -> Callable[[int, bytes], int]:
    """An ``os.write`` that writes ``after`` bytes to a file named ``only``, then fails as a
    full disk does."""
    real = os.write
    left = [after]

    def write(fd: int, data: bytes) -> int:
        if only not in os.readlink(f"/proc/self/fd/{fd}"):
            return real(fd, data)
        if left[0] <= 0:
            raise OSError(code, os.strerror(code))
        n = real(fd, bytes(data[: left[0]]))
        left[0] -= n
        return n

    return write


@pytest.mark.parametrize("p", [1, 3])  # a fragment's next file, and its first one
def test_a_full_disk_on_a_fragment_save_leaves_the_previous_file(tmp_path, monkeypatch, p):
    store = build(tmp_path)
    with monkeypatch.context() as m:
        m.setattr(os, "write", full_disk(100, only=f"fragment-000{p}.bin"))
        with pytest.raises(StoreError, match="disk full") as info:
            store.save(record(p, 3 if p == 1 else 1))
    assert f"fragment-000{p}.bin" in str(info.value)
    assert not list(tmp_path.glob(".*.tmp"))
    again = open_store(tmp_path)
    assert {q: r.version for q, r in again.load().items()} == {0: 2, 1: 2, 2: 1}
    assert again.notes == []


def test_a_full_disk_on_a_journal_append_cuts_the_partial_record(tmp_path, monkeypatch):
    store = build(tmp_path)
    size = store.journal_path.stat().st_size
    with monkeypatch.context() as m:
        m.setattr(os, "write", full_disk(50, only="journal.bin"))
        with pytest.raises(StoreError, match="disk full") as info:
            store.append_journal(*entry(3, 1))
    assert str(store.journal_path) in str(info.value)
    assert store.journal_path.stat().st_size == size
    store.append_journal(*entry(3, 1))  # the disk has room again
    store.save(record(3, 1))
    again = open_store(tmp_path)
    assert again.load()[3].version == 1 and again.notes == []
    assert len(list(again.journal())) == 6


def test_a_full_disk_on_a_ledger_save_keeps_the_previous_snapshot(tmp_path, monkeypatch):
    store = build(tmp_path)
    with monkeypatch.context() as m:
        m.setattr(os, "fsync", lambda fd: (_ for _ in ()).throw(OSError(errno.ENOSPC, "full")))
        with pytest.raises(StoreError, match="disk full") as info:
            store.save_ledger({"beat": 2})
    assert str(store.ledger_path) in str(info.value)
    again = open_store(tmp_path)
    again.load()
    assert again.ledger_state == {"beat": 1}


def test_another_os_error_names_the_file_and_the_error(tmp_path, monkeypatch):
    with monkeypatch.context() as m:
        m.setattr(os, "write", full_disk(0, errno.EIO))
        with pytest.raises(StoreError, match="Input/output error") as info:
            open_store(tmp_path).save(record(0, 1))  # the manifest is the first write
    assert "manifest.json" in str(info.value) and "disk full" not in str(info.value)
    assert open_store(tmp_path).load() == {}


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_the_store_is_private_even_under_an_open_umask(tmp_path):
    old = os.umask(0)
    try:
        build(tmp_path / "store")
    finally:
        os.umask(old)
    assert mode(tmp_path / "store") == 0o700
    names = {p.name for p in (tmp_path / "store").iterdir()}
    assert {"manifest.json", "ledger.bin", "journal.bin", "fragment-0000.bin"} <= names
    assert all(mode(p) == 0o600 for p in (tmp_path / "store").iterdir())


def test_loose_permissions_are_tightened_and_said_so(tmp_path):
    build(tmp_path / "store")
    (tmp_path / "store").chmod(0o755)
    (tmp_path / "store" / "journal.bin").chmod(0o644)
    store = open_store(tmp_path / "store")
    assert mode(tmp_path / "store") == 0o700 and mode(store.journal_path) == 0o600
    assert len(store.notes) == 2 and "0644 to 0600" in store.notes[1]
    assert len(store.load()) == 3


def test_the_fingerprint_tells_runs_apart_and_refuses_a_store_of_another_plan(tmp_path):
    four, two = (
        RunSetup(load_config(None, ["model='gpt-tiny'", f"sync.fragments={n}"])) for n in (4, 2)
    )
    again = RunSetup(load_config(None, ["model='gpt-tiny'", "sync.fragments=4"]))
    reseeded = RunSetup(load_config(None, ["model='gpt-tiny'", "sync.fragments=4", "seed=3"]))
    assert fingerprint_of(four) == fingerprint_of(again)
    assert len({fingerprint_of(s) for s in (four, two, reseeded)}) == 3
    SyncerStore(tmp_path, fingerprint=fingerprint_of(four), fragments=4).save(record(0, 1))
    with pytest.raises(StoreError, match="another model/plan/run: its fingerprint is 'model="):
        SyncerStore(tmp_path, fingerprint=fingerprint_of(two), fragments=2).load()
