"""The process runtime's wire format refuses every bad frame, naming why, and counts it."""

from __future__ import annotations

import struct

import msgpack
import pytest
import torch
from blake3 import blake3

from ddiloco.core.codec import CodecSpec, encode_tensors
from ddiloco.runtime.processes.transport.wire import (
    PREFIX,
    VERSION,
    Limits,
    Wire,
    WireError,
    decode_update,
    peek_kind,
)

SECRET = b"s" * 32


def pair(**kw) -> tuple[Wire, Wire]:
    return Wire("run-1", SECRET, "L0", 7, **kw), Wire("run-1", SECRET, "S", 1, **kw)


def joined(parts) -> bytearray:
    return bytearray(b"".join(bytes(p) for p in parts))


def refused(receiver: Wire, frame, reason: str) -> WireError:
    with pytest.raises(WireError) as info:
        receiver.decode(frame if isinstance(frame, list) else [frame])
    assert info.value.reason == reason
    assert receiver.refused[reason] >= 1
    return info.value


def test_a_frame_round_trips_with_every_bound_field():
    tx, rx = pair()
    payload = encode_tensors([torch.randn(3, 4)], CodecSpec("fp32"))
    msg = rx.decode(
        tx.encode("answer", learner=2, fragment=1, round=5, meta={"a": 1}, payload=payload)
    )
    h = msg.header
    assert (h.run, h.sender, h.session, h.kind) == ("run-1", "L0", 7, "answer")
    assert (h.learner, h.fragment, h.round, h.seq, h.meta) == (2, 1, 5, 0, {"a": 1})
    assert bytes(msg.payload) == payload
    assert not rx.refused


def test_a_joined_blob_decodes_like_its_parts():
    tx, rx = pair()
    msg = rx.decode([bytes(joined(tx.encode("progress", payload=b"xyz")))])
    assert bytes(msg.payload) == b"xyz"


def test_the_proxys_peek_reads_the_claimed_kind_and_never_raises():
    tx, _ = pair()
    head = bytes(tx.encode("answer_part", learner=1, payload=b"rows")[0])
    assert peek_kind(head) == "answer_part"
    for bad in (b"", head[:5], b"XXXX" + head[4:], head[: PREFIX.size] + b"\xc1junk"):
        assert peek_kind(bad) is None  # not a head: nothing claimed


@pytest.mark.parametrize("where", ["header", "payload", "trailer-digest"])
def test_a_flipped_bit_is_refused_as_corrupted(where):
    tx, rx = pair()
    parts = tx.encode("answer", payload=b"\x01" * 100)
    blob = joined(parts)
    index = {
        "header": PREFIX.size + 3,
        "payload": len(parts[0]) + 50,
        "trailer-digest": len(blob) - 60,
    }[where]
    blob[index] ^= 0x10
    err = refused(rx, blob, "checksum")
    assert "digest" in str(err)


def test_a_truncated_frame_is_refused():
    tx, rx = pair()
    blob = joined(tx.encode("answer", payload=b"\x02" * 64))
    for cut in (3, PREFIX.size + 2, len(blob) - 1):
        refused(rx, blob[:cut], "truncated")
    head, body, trailer = tx.encode("answer", payload=b"\x02" * 64)
    refused(rx, [head, bytes(body)[:-1], trailer], "truncated")
    refused(rx, [head, body], "truncated")


def test_an_oversized_frame_is_refused_before_allocating():
    tx, _ = pair()
    rx = Wire("run-1", SECRET, "S", 1, limits=Limits(max_header=1024, max_payload=100))
    err = refused(rx, joined(tx.encode("answer", payload=b"\0" * 101)), "oversized")
    assert err.field == "payload_len"
    # a forged length of 2**60 is refused from the 20-byte prefix alone
    prefix = PREFIX.pack(b"DDWF", VERSION, 0, 0, 10, 2**60)
    assert refused(rx, bytearray(prefix), "oversized").field == "payload_len"
    prefix = PREFIX.pack(b"DDWF", VERSION, 0, 0, 10**9, 0)
    assert refused(rx, bytearray(prefix), "oversized").field == "header_len"


def test_a_replayed_or_duplicated_frame_is_refused():
    tx, rx = pair()
    first = tx.encode("answer", payload=b"a")
    second = tx.encode("answer", payload=b"b")
    rx.decode(second)
    rx.decode(first)  # reordered inside the window: fine
    assert refused(rx, first, "replay").field == "seq"
    assert refused(rx, second, "replay").field == "seq"


def test_a_frame_from_an_earlier_session_is_refused_whatever_the_numbers():
    old = Wire("run-1", SECRET, "L0", 8)
    new = Wire("run-1", SECRET, "L0", 7)  # sessions are random: a new one may be smaller
    rx = Wire("run-1", SECRET, "S", 1)
    rx.decode(old.encode("hello"))
    stale = old.encode("answer")
    rx.decode(new.encode("hello"))  # the sender's next life
    assert refused(rx, stale, "replay").field == "session"
    rx.decode(new.encode("answer"))


def test_a_huge_sequence_number_or_a_deep_meta_is_refused_before_use():
    tx, rx = pair()
    deep: list = []
    node = deep
    for _ in range(900):
        node.append([])
        node = node[0]
    err = refused(rx, tx.encode("hello", meta={"x": deep}), "header")
    assert err.field == "header.meta" and len(str(err)) < 300
    tx._seq = 1 << 63
    assert refused(rx, tx.encode("hello"), "header").field == "header.seq"


def test_every_frame_names_its_receivers_session():
    tx, rx = pair()
    assert rx.decode(tx.encode("progress", to=42)).header.to == 42
    assert rx.decode(tx.encode("hello")).header.to == 0


def test_an_unauthenticated_frame_is_refused():
    rx = Wire("run-1", SECRET, "S", 1)
    forger = Wire("run-1", b"x" * 32, "L0", 7)
    err = refused(rx, forger.encode("answer", payload=b"evil"), "auth")
    assert err.field == "hmac"


def test_a_forged_header_with_a_recomputed_checksum_still_fails_the_hmac():
    tx, rx = pair()
    head, body, trailer = tx.encode("answer", learner=1, payload=b"p")
    header = msgpack.unpackb(bytes(head[PREFIX.size :]))
    header["l"] = 3  # claim to be another learner
    packed = msgpack.packb(header, use_bin_type=True)
    new_head = PREFIX.pack(b"DDWF", VERSION, 0, 0, len(packed), 1) + packed
    digest = blake3(new_head + blake3(b"p").digest()).digest()  # anyone can compute this
    forged_trailer = digest + bytes(trailer)[32:]
    refused(rx, [new_head, body, forged_trailer], "auth")


def test_a_frame_of_another_run_is_refused():
    other = Wire("run-2", SECRET, "L0", 7)
    _, rx = pair()
    assert refused(rx, other.encode("answer"), "run").field == "run"


def test_a_short_secret_is_refused():
    with pytest.raises(WireError, match="secret"):
        Wire("r", b"short", "S", 1)


def test_nan_and_inf_updates_are_refused_after_authentication():
    good = encode_tensors([torch.ones(4)], CodecSpec("fp32"))
    assert decode_update(good, [(4,)])[0].tolist() == [1.0] * 4
    bf16 = encode_tensors([torch.ones(4)], CodecSpec("bf16"))
    for bad, raw in [(v, bytearray(good)) for v in ("nan", "inf", "-inf")] + [
        ("nan", bytearray(bf16))
    ]:
        if len(raw) == len(good):
            raw[-4:] = struct.pack("<f", float(bad))  # the last fp32 value
        else:
            raw[-2:] = struct.pack("<f", float(bad))[2:]  # its bf16 bits
        tx, rx = pair()
        msg = rx.decode(tx.encode("answer", payload=raw))  # the frame itself is sound
        with pytest.raises(WireError) as info:
            decode_update(msg.payload, [(4,)])
        assert info.value.reason == "nonfinite"


def test_an_update_of_the_wrong_shape_is_refused():
    payload = encode_tensors([torch.ones(4)], CodecSpec("bf16"))
    with pytest.raises(WireError) as info:
        decode_update(payload, [(5,)])
    assert info.value.reason == "codec" and "shape" in info.value.field
