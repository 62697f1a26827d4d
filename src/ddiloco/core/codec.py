"""Outer-gradient codecs: one tensor <-> self-describing bytes, and lists of them.

Owns the wire format of a learner's outer gradient (the delta of one parameter fragment):
fp32, bf16 (default), absmax-block int8/int4, and int2/int1 for the quantization ablation
(the paper found int4 nearly lossless, 2- and 1-bit badly lossy). The quantization loops
live in :mod:`ddiloco.core.quantize`. Pure: no I/O, no clock, no global RNG, never pickle.

Which loops run is an argument: ``CodecSpec.backend`` for encoding and ``backend=`` for
decoding, "auto" (the numba kernels where usable), "jit" or "eager". Every backend gives the
same bytes and values; only :func:`_kernels` reaches outside the core, lazily, to
:func:`ddiloco.kernels.load`, which owns numba, its cache and ``DDILOCO_NO_JIT``.

Payload of one tensor (little-endian, ``struct``)::

    magic   4s  b"DDQ1"
    version u8  1
    codec   u8  index into CODECS (fp32=0, bf16=1, int8=2, int4=3, int2=4, int1=5)
    flags   u8  bit0: stochastic rounding was used (int codecs only); other bits zero
    ndim    u8  <= 8
    block   u32 values per scale block (int codecs; 0 for fp32/bf16)
    dims    u64 * ndim
    length  u64 payload bytes that follow, exactly
    payload fp32: float32 values; bf16: bfloat16 bits (round to nearest even);
            intB: nb float32 scales, then nb * block * B / 8 bytes of packed codes
            (nb = ceil(numel / block); the last block is zero-padded)

:func:`decode` checks every header field, the exact lengths and the scales before it
allocates anything, and refuses with :class:`CodecError` naming the field. A flipped bit
inside the values cannot be detected here: the wire layer's checksum covers that.

A list of tensors (:func:`encode_tensors`) is b"DDQB", u32 count, then per tensor a u64
length and its payload. :func:`encode_into` and ``decode(..., out=...)`` reuse the caller's
memory: fresh multi-MB buffers cost a page fault per 4 KiB, often more than the codec.
"""

from __future__ import annotations

import io
import math
import struct
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ddiloco.core.quantize import (
    BACKENDS,
    BITS,
    MAX_SCALE,
    QMAX,
    TINY,
    Backend,
    ByteArray,
    Kernels,
    decode_float_into,
    dequantize_into,
    encode_float_into,
    packed_bytes_per_block,
    quantize_into,
)
from ddiloco.errors import CodecError, require

if sys.byteorder != "little":  # pragma: no cover - the raw fp32/bf16 payloads assume it
    raise ImportError("ddiloco.core.codec needs a little-endian host")

CODECS = ("fp32", "bf16", "int8", "int4", "int2", "int1")
MAGIC = b"DDQ1"
VERSION = 1
MAX_NDIM = 8
MAX_NUMEL = 2**34
MAX_BLOCK_SIZE = 2**20
FLAG_STOCHASTIC = 1
BUNDLE_MAGIC = b"DDQB"

_FIXED = struct.Struct("<4sBBBBI")  # magic, version, codec, flags, ndim, block_size
_U64 = struct.Struct("<Q")
_BUNDLE = struct.Struct("<4sI")  # magic, count


@dataclass(frozen=True)
class CodecSpec:
    """Which codec, its block size for the int codecs, stochastic rounding, and which loops
    encode (``backend``: not part of the format, every backend writes the same bytes)."""

    name: str = "bf16"
    block_size: int = 128
    stochastic: bool = False
    backend: Backend = "auto"

    def __post_init__(self) -> None:
        require(self.name in CODECS, "codec", self.name, f"must be one of {CODECS}")
        bs = self.block_size
        require(
            isinstance(bs, int) and not isinstance(bs, bool) and 0 < bs <= MAX_BLOCK_SIZE,
            "block_size",
            bs,
            f"must be an int in [8, {MAX_BLOCK_SIZE}]",
        )
        require(bs % 8 == 0, "block_size", bs, "must be a multiple of 8")
        require(isinstance(self.stochastic, bool), "stochastic", self.stochastic, "bool")
        require(
            not self.stochastic or self.name in BITS,
            "stochastic",
            self.stochastic,
            f"only the int codecs round stochastically, not {self.name!r}",
        )
        require(self.backend in BACKENDS, "backend", self.backend, f"must be one of {BACKENDS}")


def _kernels(backend: Backend) -> Kernels | None:
    """The loops for ``backend`` (None: eager torch). The import is lazy and the only one
    out of the core: resolving a backend reads the environment and imports numba."""
    if backend == "eager":
        return None
    from ddiloco.kernels import load  # lazy: see the docstring

    return load(backend)


def _header_size(ndim: int) -> int:
    return _FIXED.size + 8 * ndim + 8


def _payload_size(codec: str, numel: int, block_size: int) -> int:
    if codec == "fp32":
        return 4 * numel
    if codec == "bf16":
        return 2 * numel
    nb = -(-numel // block_size)
    return nb * (4 + packed_bytes_per_block(BITS[codec], block_size))


def _checked_shape(shape: Sequence[int]) -> tuple[int, ...]:
    dims = tuple(shape)
    require(len(dims) <= MAX_NDIM, "ndim", len(dims), f"at most {MAX_NDIM} dimensions")
    require(all(isinstance(d, int) and d >= 0 for d in dims), "shape", dims, "dims >= 0")
    too_big = max(dims, default=0) > MAX_NUMEL or math.prod(dims) > MAX_NUMEL
    require(not too_big, "shape", dims, f"more than {MAX_NUMEL} values")
    return dims


def encoded_size(shape: tuple[int, ...], spec: CodecSpec) -> int:
    """Exact byte length :func:`encode` produces for a tensor of ``shape``."""
    dims = _checked_shape(shape)
    return _header_size(len(dims)) + _payload_size(spec.name, math.prod(dims), spec.block_size)


def max_abs_error_bound(block: torch.Tensor, spec: CodecSpec) -> float:
    """Largest |x - decode(encode(x))| for the values of one block.

    In exact arithmetic; the float32 roundings of the scale, its inverse and ``x * inverse``
    add up to about ``4 * qmax * 2**-24`` of the scale on top.

    fp32: 0. bf16: half an ulp, 2**-8 * absmax (+ half the smallest subnormal step).
    int8/4/2: half a step, scale / 2; with stochastic rounding less than a step, scale.
    int1: scale (= absmax); stochastic int1 can land on the far sign, 2 * scale.
    """
    peak = float(block.detach().abs().max()) if block.numel() else 0.0
    if spec.name == "fp32":
        return 0.0
    if spec.name == "bf16":
        return peak * 2.0**-8 + 2.0**-134
    bits = BITS[spec.name]
    scale = max(peak, TINY) / QMAX[bits] if peak > 0 else 0.0
    if bits == 1:
        return 2 * scale if spec.stochastic else scale
    return scale if spec.stochastic else scale / 2


def _encode_into(
    tensor: torch.Tensor, spec: CodecSpec, generator: torch.Generator | None, buf: torch.Tensor
) -> None:
    """Write the payload of ``tensor`` into the uint8 tensor ``buf`` of the exact size."""
    t = tensor.detach()
    dims = tuple(t.shape)
    name, bs = spec.name, spec.block_size if spec.name in BITS else 0
    flags = FLAG_STOCHASTIC if spec.stochastic else 0
    head = _FIXED.pack(MAGIC, VERSION, CODECS.index(name), flags, len(dims), bs)
    head += struct.pack(f"<{len(dims)}Q", *dims)
    numel = t.numel()
    plen = _payload_size(name, numel, spec.block_size)
    head += _U64.pack(plen)
    buf[: len(head)].numpy()[:] = np.frombuffer(head, np.uint8)
    body = buf[len(head) :]
    if numel == 0:
        return
    flat = t.to("cpu").reshape(-1).contiguous()
    if name in BITS:
        nb = -(-numel // spec.block_size)
        aligned = body.data_ptr() % 4 == 0  # else (inside a bundle) go through a copy
        scales = body[: 4 * nb].view(torch.float32) if aligned else torch.empty(nb)
        packed = body[4 * nb :].view(nb, -1)
        kernels = _kernels(spec.backend)
        quantize_into(flat, BITS[name], spec.block_size, scales, packed, generator, kernels)
        if not aligned:
            body[: 4 * nb].copy_(scales.view(torch.uint8))
        return
    encode_float_into(flat, name, body)


def _check_tensor(tensor: torch.Tensor) -> None:
    require(isinstance(tensor, torch.Tensor), "tensor", type(tensor).__name__, "not a tensor")
    require(tensor.is_floating_point(), "tensor", tensor.dtype, "must be a floating dtype")
    _checked_shape(tuple(tensor.shape))


def _check_backend(backend: Backend) -> None:
    require(backend in BACKENDS, "backend", backend, f"must be one of {BACKENDS}")


def _check_generator(spec: CodecSpec, generator: torch.Generator | None) -> None:
    if spec.stochastic:
        require(generator is not None, "generator", None, "stochastic rounding needs one")
        assert generator is not None
        require(generator.device.type == "cpu", "generator", generator.device, "must be CPU")


def _build(size: int, fill: Callable[[torch.Tensor], None]) -> bytes:
    """Let ``fill`` write ``size`` bytes into a uint8 tensor and return them as ``bytes``.

    The tensor views the buffer of an ``io.BytesIO``, whose ``getvalue()`` hands that very
    buffer over once no view is left (CPython; elsewhere it copies, which is still correct).
    That saves a second multi-MB allocation and a copy per payload.
    """
    bio = io.BytesIO()
    bio.seek(size - 1)
    bio.write(b"\0")
    mv = bio.getbuffer()
    fill(torch.frombuffer(mv, dtype=torch.uint8))
    mv.release()
    return bio.getvalue()


def encode(
    tensor: torch.Tensor, spec: CodecSpec, generator: torch.Generator | None = None
) -> bytes:
    """Encode one floating tensor (any shape, dtype, device) into a self-describing payload.

    Raises :class:`CodecError` (field ``tensor``) on NaN/Inf, :class:`ConfigError` on bad
    arguments; stochastic rounding requires ``generator`` (results reproduce from its seed).
    """
    _check_tensor(tensor)
    _check_generator(spec, generator)
    size = encoded_size(tuple(tensor.shape), spec)
    return _build(size, lambda buf: _encode_into(tensor, spec, generator, buf))


def encode_into(
    tensor: torch.Tensor,
    spec: CodecSpec,
    out: bytearray | memoryview,
    generator: torch.Generator | None = None,
) -> int:
    """Write the bytes :func:`encode` would return into the start of ``out``; return their count.

    For callers that reuse a send buffer: a fresh multi-MB ``bytes`` costs a page fault per
    4 KiB, which can take longer than the encoding itself.
    """
    _check_tensor(tensor)
    _check_generator(spec, generator)
    size = encoded_size(tuple(tensor.shape), spec)
    mv = memoryview(out)
    require(
        not mv.readonly and mv.c_contiguous and mv.nbytes >= size,
        "out",
        f"{type(out).__name__} of {mv.nbytes} bytes",
        f"must be a writable contiguous buffer of at least {size} bytes",
    )
    target = mv.cast("B")[:size]
    _encode_into(tensor, spec, generator, torch.frombuffer(target, dtype=torch.uint8))
    target.release()
    return size


def _as_bytes(payload: bytes | bytearray | memoryview) -> memoryview:
    require(
        isinstance(payload, bytes | bytearray | memoryview),
        "payload",
        type(payload).__name__,
        "must be bytes, bytearray or memoryview",
    )
    mv = memoryview(payload)
    require(mv.c_contiguous, "payload", "memoryview", "must be contiguous")
    return mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv


@dataclass(frozen=True)
class _Parsed:
    """A payload whose header, lengths and scales passed every check."""

    mv: memoryview
    codec: str
    block_size: int
    dims: tuple[int, ...]
    header_size: int
    scales: torch.Tensor | None


def _parse(mv: memoryview, expected_shape: Sequence[int] | None) -> _Parsed:
    """Check everything about one payload before anything is allocated for its values."""
    if len(mv) < _FIXED.size:
        raise CodecError("length", len(mv), f"shorter than the {_FIXED.size}-byte header")
    magic, version, cid, flags, ndim, bs = _FIXED.unpack_from(mv, 0)
    if magic != MAGIC:
        raise CodecError("magic", bytes(magic), f"expected {MAGIC!r}")
    if version != VERSION:
        raise CodecError("version", version, f"only version {VERSION} is known")
    if cid >= len(CODECS):
        raise CodecError("codec", cid, f"unknown codec id (known: 0..{len(CODECS) - 1})")
    codec = CODECS[cid]
    if flags & ~FLAG_STOCHASTIC or (flags and codec not in BITS):
        raise CodecError("flags", flags, f"unknown flag bits for {codec}")
    if ndim > MAX_NDIM:
        raise CodecError("ndim", ndim, f"at most {MAX_NDIM} dimensions")
    if codec in BITS:
        if not (0 < bs <= MAX_BLOCK_SIZE and bs % 8 == 0):
            raise CodecError("block_size", bs, f"must be a multiple of 8 in [8, {MAX_BLOCK_SIZE}]")
    elif bs != 0:
        raise CodecError("block_size", bs, f"must be 0 for {codec}")
    hsize = _header_size(ndim)
    if len(mv) < hsize:
        raise CodecError("length", len(mv), f"shorter than the {hsize}-byte header")
    dims = struct.unpack_from(f"<{ndim}Q", mv, _FIXED.size)
    if any(d > MAX_NUMEL for d in dims) or math.prod(dims) > MAX_NUMEL:
        raise CodecError("shape", dims, f"more than {MAX_NUMEL} values")
    if expected_shape is not None and tuple(expected_shape) != dims:
        raise CodecError("shape", dims, f"expected {tuple(expected_shape)}")
    numel = math.prod(dims)
    (plen,) = _U64.unpack_from(mv, hsize - 8)
    need = _payload_size(codec, numel, bs)
    if plen != need:
        raise CodecError("payload_length", plen, f"{codec} of {numel} values needs {need}")
    if len(mv) != hsize + plen:
        raise CodecError("length", len(mv), f"header + payload is {hsize + plen} bytes")
    scales = None
    if codec in BITS and numel:
        nb = -(-numel // bs)
        arr = np.frombuffer(mv, "<f4", nb, hsize).astype(np.float32)  # aligned copy
        # NaN propagates through min/max, so two reductions cover NaN, Inf, < 0 and too big
        # (a scale above MAX_SCALE could decode some code to Inf).
        top = MAX_SCALE[BITS[codec]]
        if not (float(arr.min()) >= 0.0 and float(arr.max()) <= top):
            bad = [float(v) for v in arr if not 0.0 <= v <= top][:3]
            raise CodecError("scale", bad, f"block scales must be in [0, {top:.6g}]")
        scales = torch.from_numpy(arr)
    return _Parsed(mv, codec, bs, dims, hsize, scales)


def _check_out(out: torch.Tensor, dims: tuple[int, ...]) -> None:
    require(
        isinstance(out, torch.Tensor)
        and out.dtype == torch.float32
        and out.device.type == "cpu"
        and out.is_contiguous()
        and tuple(out.shape) == dims,
        "out",
        (tuple(out.shape), out.dtype) if isinstance(out, torch.Tensor) else type(out).__name__,
        f"must be a contiguous float32 CPU tensor of shape {dims}",
    )


def _decode_parsed(p: _Parsed, out: torch.Tensor | None, backend: Backend) -> torch.Tensor:
    if out is None:
        out = torch.empty(p.dims)
    else:
        _check_out(out, p.dims)
    flat = out.view(-1)
    if flat.numel() == 0:
        return out
    if p.scales is not None:
        nb = p.scales.numel()
        start = p.header_size + 4 * nb
        packed: ByteArray = np.frombuffer(p.mv, np.uint8, len(p.mv) - start, start)
        bits, kernels = BITS[p.codec], _kernels(backend)
        dequantize_into(packed.reshape(nb, -1), p.scales, bits, p.block_size, flat, kernels)
    else:
        width = 4 if p.codec == "fp32" else 2
        raw: ByteArray = np.frombuffer(p.mv, np.uint8, width * flat.numel(), p.header_size)
        decode_float_into(raw, p.codec, flat)
    return out


def decode(
    payload: bytes | bytearray | memoryview,
    *,
    expected_shape: tuple[int, ...] | None = None,
    out: torch.Tensor | None = None,
    backend: Backend = "auto",
) -> torch.Tensor:
    """Decode one payload into a new float32 CPU tensor (or into ``out``, which it returns).

    Every header field, length and scale is checked first (:class:`CodecError` naming the
    field). ``out``, if given, must be a contiguous float32 CPU tensor of the decoded shape.
    The result never aliases ``payload``. ``backend``: the loops, as ``CodecSpec.backend``.
    """
    _check_backend(backend)
    return _decode_parsed(_parse(_as_bytes(payload), expected_shape), out, backend)


def encode_tensors(
    tensors: Sequence[torch.Tensor], spec: CodecSpec, generator: torch.Generator | None = None
) -> bytes:
    """Encode a list of tensors: b"DDQB", u32 count, then per tensor u64 length + payload."""
    for t in tensors:
        _check_tensor(t)
    _check_generator(spec, generator)
    sizes = [encoded_size(tuple(t.shape), spec) for t in tensors]

    def fill(buf: torch.Tensor) -> None:
        view = buf.numpy().data
        _BUNDLE.pack_into(view, 0, BUNDLE_MAGIC, len(tensors))
        pos = _BUNDLE.size
        for t, size in zip(tensors, sizes, strict=True):
            _U64.pack_into(view, pos, size)
            _encode_into(t, spec, generator, buf[pos + 8 : pos + 8 + size])
            pos += 8 + size
        view.release()

    return _build(_BUNDLE.size + sum(8 + s for s in sizes), fill)


def encode_tensors_chunks(tensors: Sequence[torch.Tensor], spec: CodecSpec) -> Iterator[bytes]:
    """The bytes of :func:`encode_tensors` (deterministic codecs), one tensor at a time: a
    writer that streams them holds one encoded tensor, not the whole bundle (a syncer's
    fragment files were three fragment-sized copies each while being written)."""
    for t in tensors:
        _check_tensor(t)
    _check_generator(spec, None)
    yield _BUNDLE.pack(BUNDLE_MAGIC, len(tensors))
    for t in tensors:
        yield _U64.pack(encoded_size(tuple(t.shape), spec))
        yield encode(t, spec)


def decode_tensors(
    payload: bytes | bytearray | memoryview,
    *,
    expected_shapes: Sequence[tuple[int, ...]] | None = None,
    backend: Backend = "auto",
) -> list[torch.Tensor]:
    """Decode a bundle from :func:`encode_tensors`; every length and shape is checked."""
    _check_backend(backend)
    return [_decode_parsed(p, None, backend) for p in _parse_bundle(payload, expected_shapes)]


class PackedTensors(Sequence[torch.Tensor]):
    """A bundle of :func:`encode_tensors` kept encoded, each tensor decoded (a new fp32
    tensor, the values :func:`decode_tensors` gives) when it is read. An answer waiting for
    its round holds its bytes as they came, bf16 half and int4 an eighth of fp32, and the
    merge decodes one tensor of each answer at a time (issue 28). Checked as a whole here."""

    def __init__(
        self,
        payload: bytes,
        *,
        expected_shapes: Sequence[tuple[int, ...]] | None = None,
        backend: Backend = "auto",
    ) -> None:
        _check_backend(backend)
        self.nbytes = len(payload)
        self._parsed = _parse_bundle(payload, expected_shapes)
        self._backend = backend

    def __len__(self) -> int:
        return len(self._parsed)

    def __getitem__(self, i):  # type: ignore[no-untyped-def]  # (Sequence's two overloads)
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        return _decode_parsed(self._parsed[i], None, self._backend)

    @property
    def shapes(self) -> list[tuple[int, ...]]:
        return [p.dims for p in self._parsed]


def _parse_bundle(
    payload: bytes | bytearray | memoryview, expected_shapes: Sequence[tuple[int, ...]] | None
) -> list[_Parsed]:
    mv = _as_bytes(payload)
    if len(mv) < _BUNDLE.size:
        raise CodecError("length", len(mv), f"shorter than the {_BUNDLE.size}-byte header")
    magic, count = _BUNDLE.unpack_from(mv, 0)
    if magic != BUNDLE_MAGIC:
        raise CodecError("magic", bytes(magic), f"expected {BUNDLE_MAGIC!r}")
    if count > (len(mv) - _BUNDLE.size) // 8:
        raise CodecError("count", count, "more tensors than the bundle has room for")
    if expected_shapes is not None and len(expected_shapes) != count:
        raise CodecError("count", count, f"expected {len(expected_shapes)} tensors")
    parts: list[memoryview] = []
    pos = _BUNDLE.size
    for _ in range(count):
        if len(mv) - pos < 8:
            raise CodecError("length", len(mv), "bundle truncated inside a length field")
        (size,) = _U64.unpack_from(mv, pos)
        if size > len(mv) - pos - 8:
            raise CodecError("length", size, "tensor payload runs past the bundle")
        parts.append(mv[pos + 8 : pos + 8 + size])
        pos += 8 + size
    if pos != len(mv):
        raise CodecError("length", len(mv), f"{len(mv) - pos} trailing bytes after the bundle")
    shapes = expected_shapes if expected_shapes is not None else [None] * count
    return [_parse(p, s) for p, s in zip(parts, shapes, strict=True)]
