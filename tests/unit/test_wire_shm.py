"""The same-host fast path: payloads through /dev/shm, checked exactly like inline ones."""

from __future__ import annotations

import os
import uuid

import pytest

from ddiloco.runtime.processes.transport import shm
from ddiloco.runtime.processes.transport.wire import FLAG_SHM, PREFIX, Wire, WireError, payload_size

SECRET = b"s" * 32
BIG = shm.MIN_BYTES * 2

pytestmark = pytest.mark.skipif(not shm.SHM_ROOT.is_dir(), reason="no /dev/shm on this host")


@pytest.fixture
def run():
    name = f"test-{uuid.uuid4().hex}"
    yield name
    shm.remove_run_directory(name)


def sender(run: str, session: int = 7) -> Wire:
    return Wire(run, SECRET, "L0", session, shm=shm.ShmWriter(run, "L0", session))


def receiver(run: str) -> Wire:
    return Wire(run, SECRET, "S", 1)


def refused(rx: Wire, parts, reason: str) -> WireError:
    with pytest.raises(WireError) as info:
        rx.decode(parts)
    assert info.value.reason == reason and rx.refused[reason] == 1
    return info.value


def test_a_large_payload_travels_by_reference_and_round_trips(run):
    tx, rx = sender(run), receiver(run)
    payload = os.urandom(BIG)
    head, ref, _ = parts = tx.encode("answer", fragment=2, payload=payload)
    assert PREFIX.unpack_from(head)[2] == FLAG_SHM and len(ref) < 200
    assert payload_size(parts) == BIG  # what the byte counters report: the payload, not ref
    msg = rx.decode(parts)
    assert bytes(msg.payload) == payload and msg.header.fragment == 2


def test_a_frame_for_a_receiver_that_cannot_see_our_slots_goes_inline(run):
    tx, rx = sender(run), receiver(run)
    payload = os.urandom(BIG)
    head, body, _ = parts = tx.encode("fragment", payload=payload, inline=True)
    assert PREFIX.unpack_from(head)[2] == 0 and bytes(body) == payload
    shm.remove_run_directory(run)
    assert bytes(rx.decode(parts).payload) == payload


def test_a_small_payload_stays_inline(run):
    tx, rx = sender(run), receiver(run)
    head, body, _ = parts = tx.encode("answer", payload=b"x" * 100)
    assert PREFIX.unpack_from(head)[2] == 0 and bytes(body) == b"x" * 100
    assert bytes(rx.decode(parts).payload) == b"x" * 100


def test_a_broadcast_is_written_once(run):
    tx = sender(run)
    payload = os.urandom(BIG)
    frames = [tx.encode("fragment", learner=m, fragment=0, payload=payload) for m in range(3)]
    assert len(os.listdir(shm.run_directory(run))) == 1
    for m, parts in enumerate(frames):
        assert receiver(run).decode(parts).header.learner == m


def test_a_slot_rewritten_under_a_slow_reader_is_refused_as_expired(run):
    tx, rx = sender(run), receiver(run)
    payloads = [os.urandom(BIG) for _ in range(3)]
    frames = [tx.encode("answer", fragment=1, payload=p) for p in payloads]
    refused(rx, frames[0], "expired")  # its slot now holds the third payload
    assert bytes(rx.decode(frames[1]).payload) == payloads[1]
    assert bytes(rx.decode(frames[2]).payload) == payloads[2]


def test_bytes_damaged_in_the_slot_are_refused_as_corrupted(run):
    tx, rx = sender(run), receiver(run)
    parts = tx.encode("answer", payload=os.urandom(BIG))
    (path,) = shm.run_directory(run).iterdir()
    with open(path, "r+b") as f:
        f.seek(shm.STAMP.size + 1000)
        byte = f.read(1)
        f.seek(shm.STAMP.size + 1000)
        f.write(bytes([byte[0] ^ 1]))
    refused(rx, parts, "checksum")


def test_a_deleted_slot_or_a_reference_outside_the_run_is_refused(run):
    tx, rx = sender(run), receiver(run)
    head, ref, trailer = tx.encode("answer", payload=os.urandom(BIG))
    bad = bytes(ref[: shm.REF.size]) + b"../../etc/passwd"
    assert "malformed" in str(refused(rx, [head, bad, trailer], "expired"))
    shm.remove_run_directory(run)  # as a receiver seeing another /dev/shm would find it
    refused(receiver(run), [head, ref, trailer], "shm_missing")


def test_a_directory_others_can_open_is_not_trusted(run):
    tx = sender(run)
    parts = tx.encode("answer", payload=os.urandom(BIG))
    shm.run_directory(run).chmod(0o755)
    refused(receiver(run), parts, "shm_missing")
    with pytest.raises(OSError, match="private"):
        shm.ShmWriter(run, "L1", 1)


def test_a_restarted_sender_reuses_its_files_and_its_old_frames_expire(run):
    old = sender(run, session=7)
    stale = old.encode("answer", payload=os.urandom(BIG))
    new = sender(run, session=8)
    fresh = [new.encode("answer", payload=os.urandom(BIG)) for _ in range(2)]
    assert len(os.listdir(shm.run_directory(run))) == 2
    rx = receiver(run)
    rx.decode(fresh[1])
    refused(rx, stale, "expired")


def test_close_removes_the_senders_slots(run):
    tx = sender(run)
    tx.encode("answer", payload=os.urandom(BIG))
    tx.close()
    assert not shm.run_directory(run).exists()  # the last sender out removed it


def test_only_loopback_peers_get_a_writer(run):
    assert shm.writer_for(run, "S", 1, "127.0.0.1", enabled=True) is not None
    assert shm.writer_for(run, "S", 1, "10.0.0.5", enabled=True) is None
    assert shm.writer_for(run, "S", 1, "127.0.0.1", enabled=False) is None


def test_a_slot_holding_an_unacknowledged_message_is_not_overwritten(run):
    tx, rx = sender(run), receiver(run)
    payloads = [os.urandom(BIG) for _ in range(4)]
    first = tx.encode("answer", fragment=1, payload=payloads[0])
    second = tx.encode("answer", fragment=1, payload=payloads[1])
    busy = frozenset({bytes(first[1]), bytes(second[1])})  # neither acknowledged yet
    third = tx.encode("answer", fragment=1, payload=payloads[2], busy=busy)
    assert PREFIX.unpack_from(third[0])[2] == 0  # both slots taken: inline
    fourth = tx.encode("answer", fragment=1, payload=payloads[3], busy=frozenset({second[1]}))
    assert PREFIX.unpack_from(fourth[0])[2] == FLAG_SHM  # the first was acknowledged: reused
    for parts, payload in ((second, payloads[1]), (third, payloads[2]), (fourth, payloads[3])):
        assert bytes(rx.decode(parts).payload) == payload
