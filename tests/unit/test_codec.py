"""Outer-gradient codecs: round trips within their error bounds, and every malformed payload
refused with the field that is wrong."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import struct
import subprocess
import sys
import threading

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ddiloco.core.quantize as quantize
import ddiloco.kernels as kernels
from ddiloco.core.codec import (
    CODECS,
    CodecSpec,
    PackedTensors,
    decode,
    decode_tensors,
    encode,
    encode_into,
    encode_tensors,
    encode_tensors_chunks,
    encoded_size,
    max_abs_error_bound,
)
from ddiloco.errors import CodecError, ConfigError

INT_CODECS = ("int8", "int4", "int2", "int1")
FIXED = struct.Struct("<4sBBBBI")  # the documented header: magic, version, codec, flags, ...

shapes_st = st.one_of(
    st.just(()),
    st.lists(st.integers(0, 7), min_size=1, max_size=4).map(tuple),
    st.integers(0, 700).map(lambda n: (n,)),
    st.tuples(st.integers(1, 40), st.integers(1, 40)),
)
block_st = st.sampled_from([8, 16, 24, 40, 128])


def _tensor(shape: tuple[int, ...], seed: int, log_scale: float) -> torch.Tensor:
    """Normal values at 10**log_scale, with some exact zeros and an all-zero stretch."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=torch.float64) * 10.0**log_scale
    flat = x.view(-1)
    if flat.numel() > 20:
        flat[3:11] = 0.0
        flat[-3:] *= 1e-3
    return x.float()


def _assert_within_bound(x: torch.Tensor, y: torch.Tensor, spec: CodecSpec) -> None:
    """Per block of ``spec.block_size`` values (int codecs) or per tensor (float codecs)."""
    xf, yf = x.reshape(-1).double(), y.reshape(-1).double()
    step = spec.block_size if spec.name in INT_CODECS else max(1, xf.numel())
    for a in range(0, xf.numel(), step):
        block = x.reshape(-1)[a : a + step]
        bound = max_abs_error_bound(block, spec)
        err = float((xf[a : a + step] - yf[a : a + step]).abs().max())
        # Float slack: scale, inverse scale and x * inverse are float32 roundings, each off
        # by 2**-24 relative: about 4 * qmax * 2**-24 of the scale (5e-5 of it for int8).
        assert err <= bound * (1 + 1e-4) + 1e-44, (spec, a, err, bound)


def _payload(spec: CodecSpec, shape: tuple[int, ...] = (3, 5)) -> bytes:
    return encode(_tensor(shape, 0, 0.0), spec)


TENSORS = {"shape": shapes_st, "block": block_st, "seed": st.integers(0, 2**16)}  # any tensor

# ---------------------------------------------------------------- round trips


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(name=st.sampled_from(CODECS), **TENSORS, log_scale=st.floats(-30, 30))
def test_round_trip_within_bound(name, shape, block, seed, log_scale):
    spec = CodecSpec(name, block)
    x = _tensor(shape, seed, log_scale)
    payload = encode(x, spec)
    assert len(payload) == encoded_size(shape, spec)
    y = decode(payload, expected_shape=shape)
    assert y.shape == x.shape and y.dtype == torch.float32 and y.device.type == "cpu"
    if name == "fp32":
        assert torch.equal(y.view(torch.int32), x.view(torch.int32))  # bit exact, -0.0 too
    elif name == "bf16":
        assert torch.equal(y, x.to(torch.bfloat16).float())
    _assert_within_bound(x, y, spec)
    assert encode(x, spec) == payload  # deterministic


@settings(max_examples=40, deadline=None)
@given(
    name=st.sampled_from(CODECS),
    shapes=st.lists(shapes_st, min_size=0, max_size=4),
    block=block_st,
    seed=st.integers(0, 2**16),
)
def test_a_bundle_streamed_tensor_by_tensor_is_the_same_bytes(name, shapes, block, seed):
    spec = CodecSpec(name, block)
    xs = [_tensor(shape, seed + i, 0.0) for i, shape in enumerate(shapes)]
    assert b"".join(encode_tensors_chunks(xs, spec)) == encode_tensors(xs, spec)


@settings(max_examples=40, deadline=None)
@given(
    name=st.sampled_from(CODECS),
    shapes=st.lists(shapes_st, min_size=0, max_size=4),
    block=block_st,
    seed=st.integers(0, 2**16),
)
def test_a_packed_bundle_reads_each_tensor_as_decode_tensors_gives_it(name, shapes, block, seed):
    payload = encode_tensors([_tensor(s, seed + i, 0.0) for i, s in enumerate(shapes)],
                             CodecSpec(name, block))  # fmt: skip
    packed = PackedTensors(payload, expected_shapes=[tuple(s) for s in shapes])
    whole = decode_tensors(payload)
    assert len(packed) == len(whole) and packed.shapes == [tuple(s) for s in shapes]
    for i, t in enumerate(whole):  # the same bits, a fresh tensor at every read
        assert torch.equal(packed[i], t) and packed[i] is not packed[i]
    assert all(torch.equal(a, b) for a, b in zip(packed[1:], whole[1:], strict=True))
    assert packed.nbytes == len(payload)


def test_a_packed_bundle_is_checked_whole_when_it_is_made():
    payload = encode_tensors([torch.ones(4, 3), torch.ones(5)], CodecSpec("bf16"))
    with pytest.raises(CodecError, match="shape"):
        PackedTensors(payload, expected_shapes=[(4, 3), (6,)])
    with pytest.raises(CodecError, match="count"):
        PackedTensors(payload, expected_shapes=[(4, 3)])
    with pytest.raises(CodecError, match="length"):
        PackedTensors(payload[:-1])
    with pytest.raises(CodecError, match="magic"):
        PackedTensors(b"XXXX" + payload[4:])


@settings(max_examples=60, deadline=None)
@given(
    name=st.sampled_from(INT_CODECS),
    n=st.integers(1, 300),
    block=block_st,
    seed=st.integers(0, 2**16),
)
def test_stochastic_round_trip_within_bound_and_reproducible(name, n, block, seed):
    spec = CodecSpec(name, block, stochastic=True)
    x = _tensor((n,), seed, 0.0)
    payload = encode(x, spec, torch.Generator().manual_seed(seed))
    assert len(payload) == encoded_size((n,), spec)
    assert encode(x, spec, torch.Generator().manual_seed(seed)) == payload
    _assert_within_bound(x, decode(payload), spec)


@pytest.mark.parametrize("name", INT_CODECS)
def test_stochastic_rounding_is_unbiased(name):
    block = 64
    x = _tensor((256,), 7, 0.0)
    spec = CodecSpec(name, block, stochastic=True)
    g = torch.Generator().manual_seed(1)
    samples = 400
    mean = sum(decode(encode(x, spec, g)) for _ in range(samples)) / samples
    for a in range(0, 256, block):
        blk = x[a : a + block]
        step = max_abs_error_bound(blk, spec)  # one quantization step (two for int1)
        # Each sample's error has std <= step / 2: allow 5 standard errors of the mean.
        tol = 5 * (step / 2) / math.sqrt(samples)
        assert float((mean[a : a + block] - blk).abs().max()) <= tol
    # ... while round-to-nearest is biased for the same values.
    det = decode(encode(x, CodecSpec(name, block)))
    assert float((det - x).abs().max()) > float((mean - x).abs().max())


def test_stochastic_different_seeds_differ():
    x = _tensor((512,), 3, 0.0)
    spec = CodecSpec("int4", stochastic=True)
    a = encode(x, spec, torch.Generator().manual_seed(1))
    b = encode(x, spec, torch.Generator().manual_seed(2))
    assert a != b


@pytest.mark.parametrize("name", INT_CODECS)
def test_zero_blocks_have_zero_scale_and_decode_exactly(name):
    x = torch.zeros(300)
    x[200:] = torch.linspace(-1, 1, 100)
    spec = CodecSpec(name, 64)
    payload = encode(x, spec)
    header = FIXED.size + 8 + 8
    scales = struct.unpack_from("<5f", payload, header)
    assert scales[:3] == (0.0, 0.0, 0.0) and scales[3] > 0
    y = decode(payload)
    assert torch.equal(y[:192], torch.zeros(192))


def test_int1_encodes_zero_as_plus_scale():
    x = torch.tensor([0.0, -0.0, -2.0, 0.5, 1.0, -1.0, 2.0, 0.0])
    y = decode(encode(x, CodecSpec("int1", 8)))
    assert y.tolist() == [2.0, 2.0, -2.0, 2.0, 2.0, -2.0, 2.0, 2.0]


def test_int4_wire_layout_is_planar_offset_binary():
    """Block of 8: byte j = code(x[j]) | code(x[j + 4]) << 4, code = q + 8."""
    x = torch.tensor([7.0, -7.0, 0.0, 1.0, 3.0, -1.0, 2.0, -3.0])  # absmax 7 -> scale 1
    payload = encode(x, CodecSpec("int4", 8))
    assert payload[:4] == b"DDQ1"
    _, version, codec, flags, ndim, block = FIXED.unpack_from(payload)
    assert (version, codec, flags, ndim, block) == (1, CODECS.index("int4"), 0, 1, 8)
    dims, plen = struct.unpack_from("<QQ", payload, FIXED.size)
    assert (dims, plen) == (8, 4 + 4)
    body = payload[FIXED.size + 16 :]
    assert struct.unpack_from("<f", body)[0] == 1.0
    codes = [q + 8 for q in (7, -7, 0, 1, 3, -1, 2, -3)]
    assert list(body[4:]) == [codes[j] | codes[j + 4] << 4 for j in range(4)]


def test_int8_and_int2_wire_codes():
    x = torch.tensor([127.0, -127.0, 0.0, 1.0, -1.0, 64.0, -5.0, 3.0])
    body = encode(x, CodecSpec("int8", 8))[FIXED.size + 16 :]
    assert list(body[4:]) == [q & 0xFF for q in (127, -127, 0, 1, -1, 64, -5, 3)]
    x2 = torch.tensor([1.0, -1.0, 0.0, 1.0, 0.2, -0.9, 1.0, -1.0])
    body2 = encode(x2, CodecSpec("int2", 8))[FIXED.size + 16 :]
    codes = [q + 1 for q in (1, -1, 0, 1, 0, -1, 1, -1)]
    packed = [sum(codes[j + 2 * i] << (2 * i) for i in range(4)) for j in range(2)]
    assert list(body2[4:]) == packed


@pytest.mark.parametrize("name", CODECS)
def test_extreme_magnitudes(name):
    big = 1.7e38  # half of float32's max: every codec's range
    x = torch.tensor([big, -big, 1.0, 0.0] + [1e-45, -3e-45, 1e-40, 0.0] * 2)
    spec = CodecSpec(name, 8)
    y = decode(encode(x, spec))
    assert bool(torch.isfinite(y).all())
    _assert_within_bound(x, y, spec)


@pytest.mark.parametrize(
    "name,limit", [("int8", 3.4e38 * 127 / 128), ("int4", 3.4e38 * 7 / 8), ("int2", 1.7e38)]
)
def test_int_ranges_keep_every_code_finite(name, limit):
    """A scale must stay small enough that even codes the encoder never writes decode finite."""
    ok = torch.tensor([limit * 0.999] + [0.0] * 7)
    assert bool(torch.isfinite(decode(encode(ok, CodecSpec(name, 8)))).all())
    with pytest.raises(CodecError) as err:
        encode(torch.tensor([limit * 1.002] + [0.0] * 7), CodecSpec(name, 8))
    assert err.value.field == "tensor"


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", CODECS)
def test_other_input_dtypes(dtype, name):
    x = _tensor((5, 70), 11, 0.0).to(dtype)
    spec = CodecSpec(name, 32)
    y = decode(encode(x, spec))
    assert y.dtype == torch.float32
    _assert_within_bound(x.float(), y, spec)


@pytest.mark.parametrize("name", CODECS)
def test_non_contiguous_and_requires_grad_inputs(name):
    base = _tensor((30, 40), 5, -3.0)
    x = base.t()[::2]
    assert not x.is_contiguous()
    spec = CodecSpec(name, 16)
    assert encode(x, spec) == encode(x.contiguous(), spec)
    w = base.clone().requires_grad_(True)
    assert encode(w, spec) == encode(base, spec)


@pytest.mark.parametrize("name", CODECS)
def test_chunking_does_not_change_the_bytes(name, monkeypatch):
    x = _tensor((1000,), 9, 0.0)
    spec = CodecSpec(name, 24, backend="eager")  # the torch loops are the chunked ones
    expected = encode(x, spec)
    monkeypatch.setattr(quantize, "CHUNK_VALUES", 48)  # 2 blocks per chunk, ragged end
    assert encode(x, spec) == expected
    assert torch.equal(decode(expected), decode(encode(x, spec), backend="eager"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_input():
    x = _tensor((100,), 1, 0.0)
    for name in CODECS:
        assert encode(x.cuda(), CodecSpec(name)) == encode(x, CodecSpec(name))


def test_decode_into_out_and_payload_types():
    x = _tensor((6, 50), 2, 0.0)
    payload = encode(x, CodecSpec("int4"))
    out = torch.full((6, 50), 9.0)
    assert decode(payload, out=out) is out
    assert torch.equal(out, decode(payload))
    ba = bytearray(payload)
    y = decode(memoryview(ba))
    ba[FIXED.size + 16 + 100 :] = bytes(len(ba) - FIXED.size - 16 - 100)  # mutate the source
    assert torch.equal(y, out)  # the result never aliases the payload
    assert torch.equal(decode(bytes(payload)), out)
    with pytest.raises(ConfigError) as err:
        decode(payload, out=torch.empty(300))
    assert err.value.field == "out"


@pytest.mark.parametrize("name", CODECS)
def test_encode_into_writes_the_same_bytes(name):
    x = _tensor((7, 30), 8, 0.0)
    spec = CodecSpec(name, 16)
    expected = encode(x, spec)
    buf = bytearray(b"\xaa" * (len(expected) + 9))
    assert encode_into(x, spec, buf) == len(expected)
    assert bytes(buf[: len(expected)]) == expected
    assert buf[len(expected) :] == b"\xaa" * 9  # nothing written past the payload
    view = memoryview(bytearray(len(expected) + 3))[3:]  # an unaligned window
    encode_into(x, spec, view)
    assert bytes(view[: len(expected)]) == expected
    for bad in (bytearray(len(expected) - 1), memoryview(expected)):
        with pytest.raises(ConfigError) as err:
            encode_into(x, spec, bad)
        assert err.value.field == "out"


def test_bundle_round_trip():
    tensors = [_tensor((4, 33), 1, 0.0), _tensor((), 2, 0.0), torch.zeros(0, 3)]
    for name in CODECS:
        spec = CodecSpec(name, 16)
        payload = encode_tensors(tensors, spec)
        out = decode_tensors(payload, expected_shapes=[(4, 33), (), (0, 3)])
        assert [t.shape for t in out] == [t.shape for t in tensors]
        for x, y in zip(tensors, out, strict=True):
            assert torch.equal(y, decode(encode(x, spec)))
    assert decode_tensors(encode_tensors([], CodecSpec())) == []


def test_max_abs_error_bound_values():
    block = torch.tensor([-3.5, 1.0, 0.0])
    assert max_abs_error_bound(block, CodecSpec("fp32")) == 0.0
    assert max_abs_error_bound(block, CodecSpec("int4")) == pytest.approx(3.5 / 7 / 2)
    assert max_abs_error_bound(block, CodecSpec("int8")) == pytest.approx(3.5 / 127 / 2)
    assert max_abs_error_bound(block, CodecSpec("int4", stochastic=True)) == pytest.approx(0.5)
    assert max_abs_error_bound(block, CodecSpec("int1")) == pytest.approx(3.5)
    assert max_abs_error_bound(torch.zeros(4), CodecSpec("int2")) == 0.0


# ---------------------------------------------------------------- refusals


@pytest.mark.parametrize("name", CODECS)
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("where", [0, 130, 299])
def test_nan_and_inf_inputs_are_refused(name, bad, where):
    x = _tensor((300,), 4, 0.0)
    x[where] = bad
    with pytest.raises(CodecError) as err:
        encode(x, CodecSpec(name, 128))
    assert err.value.field == "tensor"
    with pytest.raises(CodecError):
        encode_tensors([torch.ones(3), x], CodecSpec(name, 128))


def test_values_beyond_the_wire_range_are_refused():
    with pytest.raises(CodecError, match="tensor"):
        encode(torch.tensor([3.4e38]), CodecSpec("bf16"))  # rounds to bf16 Inf
    with pytest.raises(CodecError, match="tensor"):
        encode(torch.tensor([1e300], dtype=torch.float64), CodecSpec("int4"))


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"name": "int3"}, "codec"),
        ({"name": "BF16"}, "codec"),
        ({"block_size": 0}, "block_size"),
        ({"block_size": -8}, "block_size"),
        ({"block_size": 12}, "block_size"),
        ({"block_size": 2**21}, "block_size"),
        ({"block_size": True}, "block_size"),
        ({"name": "bf16", "stochastic": True}, "stochastic"),
    ],
)
def test_bad_spec_is_refused(kwargs, field):
    with pytest.raises(ConfigError) as err:
        CodecSpec(**kwargs)
    assert err.value.field == field
    assert field in str(err.value)


def test_bad_arguments_are_refused():
    with pytest.raises(ConfigError) as err:
        encode(torch.ones(3), CodecSpec("int4", stochastic=True))
    assert err.value.field == "generator"
    with pytest.raises(ConfigError) as err:
        encode(torch.ones(3, dtype=torch.int32), CodecSpec())
    assert err.value.field == "tensor"
    with pytest.raises(ConfigError) as err:
        encode(torch.ones([1] * 9), CodecSpec())
    assert err.value.field == "ndim"
    with pytest.raises(ConfigError) as err:
        decode("not bytes")  # type: ignore[arg-type]
    assert err.value.field == "payload"


@pytest.mark.parametrize("name", CODECS)
def test_every_truncation_and_extra_byte_is_refused(name):
    payload = _payload(CodecSpec(name, 8))
    for cut in range(len(payload)):
        with pytest.raises(CodecError) as err:
            decode(payload[:cut])
        assert err.value.field == "length", cut
    with pytest.raises(CodecError) as err:
        decode(payload + b"\0")
    assert err.value.field == "length"


def _patched(payload: bytes, offset: int, fmt: str, value: int | float) -> bytes:
    buf = bytearray(payload)
    struct.pack_into(fmt, buf, offset, value)
    return bytes(buf)


@pytest.mark.parametrize(
    "name,offset,fmt,value,field",
    [
        ("int4", 0, "<B", ord("X"), "magic"),
        ("int4", 4, "<B", 2, "version"),
        ("int4", 5, "<B", 6, "codec"),
        ("fp32", 5, "<B", 255, "codec"),
        ("int4", 6, "<B", 2, "flags"),
        ("fp32", 6, "<B", 1, "flags"),
        ("int4", 7, "<B", 9, "ndim"),
        ("int4", 8, "<I", 0, "block_size"),
        ("int4", 8, "<I", 12, "block_size"),
        ("int4", 8, "<I", 2**21, "block_size"),
        ("bf16", 8, "<I", 8, "block_size"),
        ("int4", 12, "<Q", 2**40, "shape"),
        ("int4", 12, "<Q", 4, "payload_length"),  # shape (4, 5) needs another size
        ("int4", 28, "<Q", 17, "payload_length"),
        ("fp32", 28, "<Q", 61, "payload_length"),
        ("int4", 36, "<f", math.nan, "scale"),
        ("int4", 36, "<f", math.inf, "scale"),
        ("int4", 36, "<f", -1.0, "scale"),
        ("int8", 40, "<f", math.nan, "scale"),
        ("int4", 36, "<f", 3.0e38, "scale"),  # a nibble 0 (q = -8) would decode to -Inf
        ("int2", 40, "<f", 2.0e38, "scale"),
        ("fp32", 36, "<f", math.nan, "values"),
        ("bf16", 36, "<H", 0x7F80, "values"),
    ],
)
def test_corrupt_header_fields_are_refused(name, offset, fmt, value, field):
    payload = _payload(CodecSpec(name, 8))  # shape (3, 5): header is 12 + 16 + 8 bytes
    with pytest.raises(CodecError) as err:
        decode(_patched(payload, offset, fmt, value))
    assert err.value.field == field


def test_shape_mismatch_is_refused():
    payload = _payload(CodecSpec("int4"))
    with pytest.raises(CodecError) as err:
        decode(payload, expected_shape=(5, 3))
    assert err.value.field == "shape"
    with pytest.raises(CodecError) as err:
        decode_tensors(encode_tensors([torch.ones(2)], CodecSpec()), expected_shapes=[(3,)])
    assert err.value.field == "shape"


@settings(max_examples=300, deadline=None)
@given(
    name=st.sampled_from(CODECS),
    flips=st.lists(st.tuples(st.integers(0, 10_000), st.integers(1, 255)), max_size=4),
    cut=st.integers(0, 4),
)
def test_mutated_payloads_raise_only_codec_errors(name, flips, cut):
    buf = bytearray(_payload(CodecSpec(name, 8)))
    for pos, xor in flips:
        buf[pos % len(buf)] ^= xor
    data = bytes(buf[: len(buf) - cut])
    try:
        y = decode(data)
    except CodecError:
        return
    assert y.dtype == torch.float32 and bool(torch.isfinite(y).all())


@settings(max_examples=200, deadline=None)
@given(data=st.binary(max_size=200))
def test_random_bytes_raise_only_codec_errors(data):
    for fn in (decode, decode_tensors):
        with contextlib.suppress(CodecError):
            fn(data)


def test_bundle_corruptions_are_refused():
    good = encode_tensors([torch.ones(3), torch.ones(2, 2)], CodecSpec("int8", 8))
    for cut in range(len(good)):
        with pytest.raises(CodecError):
            decode_tensors(good[:cut])
    cases = [
        (good + b"\0", "length"),
        (b"XXXX" + good[4:], "magic"),
        (_patched(good, 4, "<I", 3), "length"),  # a third entry would start past the end
        (_patched(good, 4, "<I", 2**31), "count"),
        (_patched(good, 8, "<Q", 2**60), "length"),
    ]
    for data, field in cases:
        with pytest.raises(CodecError) as err:
            decode_tensors(data)
        assert err.value.field == field
    with pytest.raises(CodecError) as err:
        decode_tensors(good, expected_shapes=[(3,)])
    assert err.value.field == "count"


# ---------------------------------------------------------------- numba fast path

JIT_KERNELS = kernels.load("auto")
needs_jit = pytest.mark.skipif(JIT_KERNELS is None, reason=f"{kernels.unavailable_reason()}")
# How the kernels run: the serial kernel, and the parallel driver with tiny chunks (forced on
# small tensors by lowering its threshold) so that rows are split over threads.
JIT_MODES = ("serial", "parallel")


@contextlib.contextmanager
def _mode(mode):
    """Run the kernels "serial" or "parallel" (tiny chunks, at least 2 threads) meanwhile."""
    k = JIT_KERNELS
    saved = (k.PARALLEL_MIN_VALUES, k.CHUNK_VALUES) if k is not None else None
    threads = torch.get_num_threads()
    if k is not None and mode == "parallel":
        k.PARALLEL_MIN_VALUES, k.CHUNK_VALUES = 0, 16
        torch.set_num_threads(max(2, threads))
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        if k is not None:
            k.PARALLEL_MIN_VALUES, k.CHUNK_VALUES = saved


def _both(fn, mode="serial"):
    """``fn(backend)`` on the eager path and on the numba path (in ``mode``)."""
    a = fn("eager")
    with _mode(mode):
        b = fn("jit")
    return a, b


def _on(spec: CodecSpec, backend: str) -> CodecSpec:
    return dataclasses.replace(spec, backend=backend)


def _same_floats(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit, -0.0 and every NaN payload included."""
    return a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


_F32_MAX = 3.4028234663852886e38
specials_st = st.lists(
    st.sampled_from(
        [
            0.0,
            -0.0,
            1e-45,
            -1e-45,
            2.0**-100,
            -(2.0**-101),
            1.1754942e-38,
            1e-40,
            0.5,
            -0.5,
            1.5,
            -2.5,
            3.5,
            1e30,
            -1e30,
            1.7e38,
            -1.7e38,
            2.9e38,
        ]
    ),
    max_size=12,
)


def _jit_tensor(shape, seed, log_scale, specials, dtype):
    x = _tensor(shape, seed, log_scale).view(-1)
    g = torch.Generator().manual_seed(seed + 1)
    for i, v in enumerate(specials):
        if x.numel():
            x[int(torch.randint(0, x.numel(), (1,), generator=g)) if i else 0] = v
    return x.view(shape).to(dtype)


@needs_jit
@pytest.mark.parametrize("mode", JIT_MODES)
@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    name=st.sampled_from(INT_CODECS),
    **TENSORS,
    log_scale=st.floats(-40, 37),
    specials=specials_st,
    dtype=st.sampled_from([torch.float32] * 4 + [torch.float64, torch.bfloat16, torch.float16]),
)
def test_jit_and_eager_paths_give_the_same_bytes_and_values(
    mode, name, shape, block, seed, log_scale, specials, dtype
):
    spec = CodecSpec(name, block)
    x = _jit_tensor(shape, seed, log_scale, specials, dtype)
    try:
        a, b = _both(lambda k: encode(x, _on(spec, k)), mode)
    except CodecError:  # beyond the int range (or Inf as float32): both refuse, same words
        with pytest.raises(CodecError) as ea:
            encode(x, _on(spec, "eager"))
        with _mode(mode), pytest.raises(CodecError) as eb:
            encode(x, _on(spec, "jit"))
        assert (ea.value.field, str(ea.value)) == (eb.value.field, str(eb.value))
        return
    assert a == b
    da, db = _both(lambda k: decode(a, backend=k), mode)
    assert _same_floats(da, db)


@needs_jit
@pytest.mark.parametrize("mode", JIT_MODES)
@settings(max_examples=120, deadline=None)
@given(
    name=st.sampled_from(INT_CODECS),
    n=st.integers(1, 300),
    block=block_st,
    data=st.data(),
)
def test_jit_and_eager_decode_any_codes_and_scales_alike(mode, name, n, block, data):
    """Every code, also those the encoder never writes, and any valid scale (subnormal too)."""
    spec = CodecSpec(name, block)
    payload = bytearray(encode(torch.zeros(n), spec))
    nb = -(-n // block)
    start = FIXED.size + 16
    bound = quantize.MAX_SCALE[quantize.BITS[name]]
    scale_st = st.one_of(
        st.floats(0, bound, width=32), st.sampled_from([0.0, 1e-45, 1e-40, 2.0**-107, bound])
    )
    scales = data.draw(st.lists(scale_st, min_size=nb, max_size=nb))
    struct.pack_into(f"<{nb}f", payload, start, *scales)
    size = len(payload) - start - 4 * nb
    payload[start + 4 * nb :] = data.draw(st.binary(min_size=size, max_size=size))
    da, db = _both(lambda k: decode(bytes(payload), backend=k), mode)
    assert _same_floats(da, db)
    ea, eb = _both(lambda k: decode(payload, backend=k), mode)  # writable: the same kernel
    assert _same_floats(ea, da) and _same_floats(eb, db)


@needs_jit
@pytest.mark.parametrize("mode", JIT_MODES)
@pytest.mark.parametrize("name", INT_CODECS)
def test_jit_path_edge_cases(mode, name):
    block = 16
    x = torch.zeros(5 * block + 3)  # a partial last block
    x[block : 2 * block] = -0.0  # a block of -0.0: absmax 0, scale 0
    x[2 * block : 3 * block] = torch.tensor([1e-45, -1e-45, 2.0**-100, -(2.0**-120)] * 4)
    x[3 * block : 4 * block] = torch.linspace(-1.7e38, 1.7e38, block)
    qmax = quantize.QMAX[quantize.BITS[name]]  # scale 1 below: x * inv = x, exact ties
    ties = [qmax, -0.5, 0.5] + [(k % qmax + 0.5) * (-1) ** k for k in range(block - 3)]
    x[4 * block : 5 * block] = torch.tensor(ties)
    x[-3:] = torch.tensor([-0.0, 3.0, -1.0])
    spec = CodecSpec(name, block)
    a, b = _both(lambda k: encode(x, _on(spec, k)), mode)
    assert a == b
    da, db = _both(lambda k: decode(a, backend=k), mode)
    assert _same_floats(da, db)
    a, b = _both(lambda k: encode(x[:7], _on(spec, k)), mode)  # only a partial block
    assert a == b


def test_eager_int2_rounds_ties_away_from_zero():
    """int2 rounds q + 1 half to even, so +-0.5 (scale units) lands on +-1, not 0; the
    kernels reproduce it (test_jit_path_edge_cases)."""
    y = decode(
        encode(torch.tensor([1.0, -0.5, 0.5, 0.25, -0.25, 0.0, 0.75, -1.0]), CodecSpec("int2", 8))
    )
    assert y.tolist() == [1.0, -1.0, 1.0, 0.0, 0.0, 0.0, 1.0, -1.0]


@needs_jit
@pytest.mark.parametrize("mode", JIT_MODES)
@pytest.mark.parametrize("name", INT_CODECS)
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_jit_path_refuses_nan_and_inf_like_eager(mode, name, bad):
    for where in (0, 130, 299, 300 + 17):
        x = _tensor((320,), 4, 0.0)
        x[where] = bad
        x[200] = math.inf if math.isnan(bad) else math.nan  # another bad block
        errors = []
        for path, m in (("eager", "serial"), ("jit", mode)):
            with _mode(m), pytest.raises(CodecError) as err:
                encode(x, CodecSpec(name, 128, backend=path))
            errors.append((err.value.field, str(err.value)))
        assert errors[0] == errors[1] and errors[0][0] == "tensor"


@needs_jit
@pytest.mark.skipif(
    torch.backends.cpu.get_cpu_capability() == "DEFAULT", reason="torch rounds x * inv first"
)
def test_jit_rounds_the_exact_product_like_torch():
    """A value whose x * inv rounds to a tie in float32: both paths round the exact product."""
    absmax, v, q = quantize._WITNESS
    assert quantize.eager_rounds_exactly()
    for block in (8, 24, 128):  # all vectorized, vectorized + scalar tail, all scalar in torch
        x = torch.full((block,), v)
        x[0] = absmax
        a, b = _both(lambda k, x=x, block=block: encode(x, CodecSpec("int8", block, backend=k)))
        assert a == b
        assert set(struct.unpack_from(f"<{block - 1}b", a, len(a) - block + 1)) == {q}


def test_auto_takes_the_kernels_where_usable_and_eager_never():
    assert kernels.load("eager") is None
    assert kernels.load("auto") is JIT_KERNELS
    if JIT_KERNELS is not None:
        assert kernels.load("jit") is JIT_KERNELS and kernels.unavailable_reason() is None
    with pytest.raises(ConfigError, match="backend"):
        kernels.load("fast")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="backend"):
        CodecSpec("int4", backend="numba")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="backend"):
        decode(encode(torch.ones(8), CodecSpec("int4")), backend="gpu")  # type: ignore[arg-type]


@pytest.fixture
def fresh_kernels():
    """Forget the process's kernel import before and after (the test hides numba)."""
    kernels._jit.cache_clear()
    yield
    kernels._jit.cache_clear()


@pytest.mark.parametrize("how", ["env", "no numba"])
def test_without_the_kernels_the_eager_path_runs_silently(how, monkeypatch, fresh_kernels):
    x = _tensor((5000,), 6, 0.0)
    expected = {n: encode(x, CodecSpec(n, backend="eager")) for n in INT_CODECS}
    if how == "env":
        monkeypatch.setenv("DDILOCO_NO_JIT", "1")
    else:
        monkeypatch.delenv("DDILOCO_NO_JIT", raising=False)
        monkeypatch.setitem(sys.modules, "numba", None)  # import numba raises ImportError
        monkeypatch.delitem(sys.modules, "ddiloco.kernels.quantize_jit", raising=False)
    assert kernels.load("auto") is None
    assert ("DDILOCO_NO_JIT" if how == "env" else "import") in str(kernels.unavailable_reason())
    for n in INT_CODECS:
        assert encode(x, CodecSpec(n)) == expected[n]
        assert torch.equal(decode(expected[n]), decode(expected[n], backend="eager"))
    with pytest.raises(ImportError, match="backend 'jit'"):
        encode(x, CodecSpec("int4", backend="jit"))
    with pytest.raises(ImportError, match="backend 'jit'"):
        decode(expected["int4"], backend="jit")


@needs_jit
def test_unwritable_numba_cache_only_costs_a_compile(tmp_path):
    """No writable cache directory at all: the kernels compile per process, silently."""
    script = (
        "import torch\n"
        "from ddiloco.core.codec import CodecSpec, encode, decode\n"
        "x = torch.randn(5000)\n"
        "a = encode(x, CodecSpec('int4', backend='eager'))\n"
        "b = encode(x, CodecSpec('int4', backend='jit'))\n"
        "assert a == b and torch.equal(decode(a), decode(b)), 'paths differ'\n"
        "print('ok')\n"
    )
    env = dict(os.environ, NUMBA_CACHE_DIR="/proc/ddiloco-no-such-dir")
    env["NUMBA_CACHE_LOCATOR_CLASSES"] = "UserProvidedCacheLocator"
    env.pop("DDILOCO_NO_JIT", None)
    done = subprocess.run(
        [sys.executable, "-W", "error", "-c", script],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]
    assert "Warning" not in done.stderr, done.stderr[-3000:]


@needs_jit
def test_jit_path_from_concurrent_threads():
    """Kernels release the GIL; concurrent callers get the same bytes (one launches the
    parallel kernel at a time, the others run serially)."""
    xs = [_tensor((3000,), s, 0.0) for s in range(4)]
    expected = [encode(x, CodecSpec("int4", 16, backend="eager")) for x in xs]
    bad = []

    def work(k):
        for r in range(30):
            i = (k + r) % len(xs)
            payload = encode(xs[i], CodecSpec("int4", 16, backend="jit"))
            got, want = decode(payload, backend="jit"), decode(expected[i], backend="eager")
            if payload != expected[i] or not _same_floats(got, want):
                bad.append((k, r))

    with _mode("parallel"):
        threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert not bad
