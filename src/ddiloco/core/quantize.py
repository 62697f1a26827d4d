"""The codecs' hot loops: per-block absmax int quantization, and the fp32/bf16 copies.

Owns turning float values into per-block float32 scales plus packed 8/4/2/1-bit codes and
back, and the chunked fp32/bf16 conversions with their NaN/Inf checks (the wire framing and
validation live in :mod:`ddiloco.core.codec`). A fragment of a large model is
hundreds of MB and the codec must keep up with the network, so the loops run in eager torch
over cache-sized chunks with preallocated buffers and as few passes as possible; see
``benchmarks/bench_codec.py``. Pure: no I/O, no clock, randomness only from the caller's
generator.

Fast path. Given a :class:`Kernels` module (``kernels=``, from :func:`ddiloco.kernels.load`;
None is the eager torch loops), deterministic int quantization and all int decoding run as
fused kernels instead, one pass over the values each (about twice the eager speed). They
give the same bytes and the same decoded values bit for bit where torch's own rounding was
checked to match them (:func:`eager_rounds_exactly`, which ``load`` checks); every check and
the scale arithmetic stay here, shared. Stochastic rounding stays eager. The choice is an
argument, never state here: the core imports no backend.

Scheme. Values are cut into blocks of ``block_size`` (the last one zero-padded). A block's
scale is ``s = max(absmax, TINY) / qmax`` (exactly 0 for an all-zero block) and a value ``x``
becomes the integer ``q = round(x / s)`` in ``[-qmax, qmax]`` and decodes to ``q * s``.
Rounding is half to even on ``x / s + offset``, so for int2 (offset 1) ties at ``x = ±s/2``
go away from zero, to ±1. Codes as stored: int8 ``q`` in two's complement (qmax 127); int4
``q + 8`` (qmax 7); int2 ``q + 1`` (qmax 1); int1 one bit, 1 for ``x >= 0`` (zero of
either sign counts as +1) and 0 for negative, decoding to ``+s`` / ``-s``, ``s = absmax``.

Layout. With ``k = 8 // bits`` codes per byte, byte ``j`` of a block holds the codes of
values ``j + i * block_size // k`` at bit offset ``bits * i`` (i = 0..k-1): "planar within
a block", so packing and unpacking touch contiguous runs instead of interleaved pairs.
"""

from __future__ import annotations

import math
import threading
from typing import Any, Literal, Protocol

import numpy as np
import numpy.typing as npt
import torch

from ddiloco.errors import CodecError

BITS = {"int8": 8, "int4": 4, "int2": 2, "int1": 1}
QMAX = {8: 127, 4: 7, 2: 1, 1: 1}
# Stored code = q + OFFSET (int1 is handled on its own: one bit per sign).
OFFSET = {8: 0, 4: 8, 2: 1, 1: 0}
# Largest |q| any code decodes to (int8 -128, int4 nibble 0, int2 code 3 are never written
# but can be received), and so the largest scale that keeps every decoded value finite.
QDEC = {8: 128, 4: 8, 2: 2, 1: 1}
MAX_SCALE = {b: float(np.finfo(np.float32).max) / q for b, q in QDEC.items()}
# Smallest absmax used for the scale: keeps 1/scale finite and scales normal, so a block
# of denormals still quantizes consistently with its stored scale.
TINY = 2.0**-100
# Adding 1.5 * 2**23 to a float32 of magnitude < 2**22 rounds it to an integer (round half
# to even) and leaves that integer, two's complement, in the low mantissa bits.
_ROUND_MAGIC = 12582912.0
# Values per chunk: 4 MiB of float32, so a chunk and its temporaries stay in L3 while
# torch's per-op cost (tens of us with threads) stays small against the work.
CHUNK_VALUES = 1 << 20

FloatArray = npt.NDArray[np.float32]
ByteArray = npt.NDArray[np.uint8]

# Which loops a codec call runs (resolved by ddiloco.kernels.load): "auto" the numba kernels
# where usable, "jit" those or ImportError, "eager" the torch loops here.
Backend = Literal["auto", "jit", "eager"]
BACKENDS: tuple[Backend, ...] = ("auto", "jit", "eager")


class Kernels(Protocol):
    """What the loops here call on a kernels module (``ddiloco.kernels.quantize_jit``):
    whole blocks only, numpy arrays in and out, the same results as the eager loops."""

    def quantize(self, bits: int, x: Any, bs: int, am: Any, packed: Any, threads: int) -> None:
        """Codes of float32 blocks ``x`` into ``packed``, the absmax bits into int32 ``am``."""

    def dequantize(self, bits: int, packed: Any, sf: Any, bs: int, out: Any, threads: int) -> None:
        """Values of the blocks into float32 ``out``, ``sf`` = scale * 2**(bits - 8)."""


# Per-thread scratch buffers, reused across calls: a fresh multi-MB buffer costs a page
# fault per 4 KiB on first touch, which is as slow as the quantization itself. Holds a few
# chunks' worth (about 10 MiB, 15 with stochastic rounding) per thread that ever ran a
# codec; the contents never reach a result.
_LOCAL = threading.local()


def scratch(key: str, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """This thread's reusable buffer named ``key``, viewed as ``shape`` (contents undefined)."""
    pool: dict[str, torch.Tensor] = _LOCAL.__dict__.setdefault("pool", {})
    numel = math.prod(shape)
    buf = pool.get(key)
    if buf is None or buf.dtype != dtype or buf.numel() < numel:
        buf = torch.empty(numel, dtype=dtype)
        pool[key] = buf
    return buf[:numel].view(shape)


# A block whose value x has x * inv (inv = float32(127) / absmax) so close to a half-integer
# that rounding the float32 product first lands on the other integer: -112 instead of the
# exact product's -113.
_WITNESS = (float.fromhex("0x1.448a1cp+0"), float.fromhex("-0x1.1f7c5cp+0"), -113)


def eager_rounds_exactly() -> bool:
    """Whether torch's ``MAGIC + x * inv`` rounds the exact product, as the numba kernels do.

    It does where its kernels compile to a fused multiply-add (x86 AVX2 builds, in the
    vectorized body and the scalar tail of a row alike); it does not under
    ``ATEN_CPU_CAPABILITY=default``, which rounds ``x * inv`` to float32 first. Where it
    does not, :func:`ddiloco.kernels.load` hands out no kernels, so the bytes stay the same.
    """
    absmax, x, q = _WITNESS
    block = torch.full((40,), x)
    block[0] = absmax
    scales, packed = torch.empty(1), torch.empty((1, 40), dtype=torch.uint8)
    _quantize_eager(block, 8, 40, scales, packed, None)
    return bool((packed[0, 1:].view(torch.int8) == q).all())


def packed_bytes_per_block(bits: int, block_size: int) -> int:
    """Bytes of packed codes for one block."""
    return block_size * bits // 8


def _blocks_per_chunk(block_size: int, nblocks: int) -> int:
    return max(1, min(nblocks, CHUNK_VALUES // block_size))


class _Encoder:
    """Quantizes chunks of up to ``mb`` blocks with this thread's scratch buffers.

    Per chunk: |x| and its block max (the block's absmax goes straight into the scales
    output), the inverse scale on the tiny per-block array, then one fused pass
    ``y = x * inv + (offset + MAGIC)`` that rounds, and two passes that take each float's
    low byte (the code) and pack the codes. Views are built once per chunk height.
    """

    def __init__(
        self, mb: int, bits: int, block_size: int, generator: torch.Generator | None
    ) -> None:
        self.bits, self.bs, self.qmax, self.generator = bits, block_size, QMAX[bits], generator
        self.k = 8 // bits
        self.y = scratch("q.y", (mb, block_size))
        self.codes = scratch("q.codes", (mb, block_size), torch.uint8)
        self.inv = scratch("q.inv", (mb,))
        self.rand = scratch("q.rand", (mb, block_size)) if generator is not None else None
        self.magic = torch.full((1, block_size), _ROUND_MAGIC + OFFSET[bits])
        self._views: dict[int, tuple[torch.Tensor, ...]] = {}

    def _at(self, mm: int) -> tuple[torch.Tensor, ...]:
        """(y, inv column, codes, plane 0, ..., plane k-1) for a chunk of ``mm`` blocks."""
        views = self._views.get(mm)
        if views is None:
            codes = self.codes[:mm]
            planes = codes.view(mm, self.k, self.bs // self.k)
            views = (self.y[:mm], self.inv[:mm].view(mm, 1), codes)
            views += tuple(planes[:, i] for i in range(self.k))
            self._views[mm] = views
        return views

    def run(self, x: torch.Tensor, am: torch.Tensor, packed: torch.Tensor) -> None:
        """Quantize ``x`` (mm, bs) into ``packed`` (mm, bytes/block); block absmax -> ``am``."""
        mm, qmax = x.shape[0], self.qmax
        y, inv, codes, *planes = self._at(mm)
        if x.dtype != torch.float32:
            x = scratch("q.x", self.y.shape)[:mm].copy_(x)
        torch.abs(x, out=y)
        torch.amax(y, dim=1, out=am)
        inv_np: FloatArray = inv.numpy()  # NaN/Inf blocks are refused after the loop
        np.maximum(am.numpy(), TINY, out=inv_np.ravel())
        np.divide(qmax, inv_np, out=inv_np)
        rand = None
        if self.rand is not None:
            rand = torch.rand((mm, self.bs), generator=self.generator, out=self.rand[:mm])
        if self.bits == 1:  # bit 1 for +1; deterministic x >= 0, stochastic P(+1) = (1+x/s)/2
            sign = codes.view(torch.bool)
            if rand is None:
                torch.ge(x, 0.0, out=sign)
            else:
                torch.mul(x, inv, out=y)
                torch.lt(rand, y.add_(1.0).mul_(0.5), out=sign)
            self._pack(planes, packed)
            return
        if rand is None:
            torch.addcmul(self.magic, x, inv, out=y)  # round(x / s) + offset, in the low byte
        else:
            torch.mul(x, inv, out=y)
            y.add_(rand).floor_().clamp_(-qmax, qmax).add_(self.magic)
        if self.bits == 8:
            packed.copy_(y.view(torch.int32))  # int32 -> uint8 keeps the low byte
            return
        codes.copy_(y.view(torch.int32))
        self._pack(planes, packed)

    def _pack(self, planes: list[torch.Tensor], packed: torch.Tensor) -> None:
        """Byte j = sum_i plane_i[j] << (bits * i); codes < 2**bits, so the sum never carries."""
        bits = self.bits
        torch.add(planes[0], planes[1], alpha=1 << bits, out=packed)
        for i in range(2, self.k):
            packed.add_(planes[i], alpha=1 << (bits * i))


def quantize_into(
    flat: torch.Tensor,
    bits: int,
    block_size: int,
    scales: torch.Tensor,
    packed: torch.Tensor,
    generator: torch.Generator | None,
    kernels: Kernels | None = None,
) -> None:
    """Quantize 1-D CPU ``flat`` into ``scales`` (nb,) float32 and ``packed`` (nb, bpb) uint8.

    ``generator`` set means stochastic rounding (always eager); ``kernels`` None the eager
    loops. Raises :class:`CodecError` on NaN/Inf.
    """
    if scales.numel() == 0:
        return
    if kernels is not None and generator is None:
        _quantize_jit(kernels, flat, bits, block_size, scales, packed)
    else:
        _quantize_eager(flat, bits, block_size, scales, packed, generator)
    # ``scales`` holds each block's absmax: check it, then turn it into the scale in place.
    sc: FloatArray = scales.numpy()
    if not math.isfinite(float(sc.max())):
        bad = int(np.argmax(~np.isfinite(sc)))
        raise CodecError("tensor", f"block {bad}", "holds NaN or Inf (as float32)")
    zero = sc == 0.0 if float(sc.min()) == 0.0 else None
    np.maximum(sc, TINY, out=sc)
    np.divide(sc, QMAX[bits], out=sc)
    if zero is not None:
        sc[zero] = 0.0
    if float(sc.max()) > MAX_SCALE[bits]:  # only |x| within a few % of float32's max
        bad = int(np.argmax(sc > MAX_SCALE[bits]))
        why = f"absmax beyond the int{bits} range ({MAX_SCALE[bits] * QMAX[bits]:.4g})"
        raise CodecError("tensor", f"block {bad}", why)


def _quantize_eager(
    flat: torch.Tensor,
    bits: int,
    bs: int,
    scales: torch.Tensor,
    packed: torch.Tensor,
    generator: torch.Generator | None,
) -> None:
    """The torch loops: codes into ``packed``, each block's absmax (NaN/Inf too) into ``scales``."""
    n, nb = flat.numel(), scales.numel()
    mb = _blocks_per_chunk(bs, nb)
    enc = _Encoder(mb, bits, bs, generator)
    for b0 in range(0, nb, mb):
        b1 = min(nb, b0 + mb)
        if b1 * bs <= n:
            x = flat[b0 * bs : b1 * bs].view(b1 - b0, bs)
        else:  # the chunk that ends in the partial block: zero-pad a copy of it
            x = scratch("q.x", (mb, bs))[: b1 - b0]
            x.view(-1)[n - b0 * bs :].zero_()
            x.view(-1)[: n - b0 * bs].copy_(flat[b0 * bs :])
        enc.run(x, scales[b0:b1], packed[b0:b1])


def _quantize_jit(
    kernels: Kernels,
    flat: torch.Tensor,
    bits: int,
    bs: int,
    scales: torch.Tensor,
    packed: torch.Tensor,
) -> None:
    """:func:`_quantize_eager` with the numba kernel: the same codes and absmax, bit for bit.

    float32 input goes in whole; other dtypes are converted chunk by chunk (torch's
    conversion, as the eager path). The partial last block is zero-padded in scratch.
    """
    n, nb = flat.numel(), scales.numel()
    nfull, threads = n // bs, torch.get_num_threads()
    am = scales.numpy().view(np.int32)
    codes: ByteArray = packed.numpy()
    step = max(1, nfull) if flat.dtype == torch.float32 else _blocks_per_chunk(bs, nb)
    for b0 in range(0, nfull, step):
        b1 = min(nfull, b0 + step)
        x = flat[b0 * bs : b1 * bs]
        if x.dtype != torch.float32:
            x = scratch("q.x", (step * bs,))[: (b1 - b0) * bs].copy_(x)
        kernels.quantize(bits, x.numpy(), bs, am[b0:b1], codes[b0:b1], threads)
    if nfull < nb:
        pad = scratch("q.pad", (bs,)).zero_()
        pad[: n - nfull * bs].copy_(flat[nfull * bs :])
        kernels.quantize(bits, pad.numpy(), bs, am[nfull:], codes[nfull:], 1)


def dequantize_into(
    packed: ByteArray,
    scales: torch.Tensor,
    bits: int,
    block_size: int,
    out: torch.Tensor,
    kernels: Kernels | None = None,
) -> None:
    """Decode ``packed`` (nb, bpb) uint8 codes with ``scales`` (nb,) into 1-D float32 ``out``,
    with ``kernels`` (None: the eager loops).

    ``packed`` may be a read-only numpy view of the payload; it is only read. Codes are
    unpacked into int8 as ``q * 2**(8 - bits)`` for int4/int2 (the nibble shifted to the
    top of the byte, which sign-extends for free) and the power of two is folded into the
    scale, exactly. Codes the encoder never produces decode within ``QDEC`` x the scale:
    int8 -128 to -128 s, int4 nibble 0 to -8 s, int2 code 3 to -2 s (the 2-bit field wraps).
    """
    nb, bs, n = scales.numel(), block_size, out.numel()
    if nb == 0:
        return
    factor = {8: 1.0, 4: 1.0 / 16, 2: 1.0 / 64, 1: 1.0}[bits]
    sf = torch.mul(scales, factor).view(nb, 1)
    if kernels is not None:
        _dequantize_jit(kernels, packed, sf.view(nb), bits, bs, out)
        return
    nfull, k = n // bs, 8 // bits
    mb = _blocks_per_chunk(bs, nb)
    src = scratch("d.src", (mb, bs // k), torch.uint8)
    q = scratch("d.q", (mb, bs), torch.uint8)
    src_np: ByteArray = src.numpy()
    for b0 in range(0, nb, mb):
        b1 = min(nb, b0 + mb)
        mm = b1 - b0
        t, qq = src[:mm], q[:mm]
        planes = qq.view(mm, k, bs // k)
        if bits == 4:
            # Offset-binary nibble n = q + 8; n ^ 8 is q in 4-bit two's complement.
            np.bitwise_xor(packed[b0:b1], 0x88, out=src_np[:mm])
            torch.bitwise_left_shift(t, 4, out=planes[:, 0])
            torch.bitwise_and(t, 0xF0, out=planes[:, 1])
        elif bits == 8:
            np.copyto(q.numpy()[:mm], packed[b0:b1])
        elif bits == 2:
            np.copyto(src_np[:mm], packed[b0:b1])
            for i in range(4):
                torch.bitwise_left_shift(t, 6 - 2 * i, out=planes[:, i])
            qq.bitwise_and_(0xC0).sub_(64)  # (q + 1) * 64 - 64 wraps to q * 64 as int8
        else:
            np.copyto(src_np[:mm], packed[b0:b1])
            for i in range(8):
                torch.bitwise_right_shift(t, i, out=planes[:, i])
            qq.bitwise_and_(1).mul_(2).sub_(1)  # 1 -> 1, 0 -> 255 = -1 as int8
        full = min(b1, nfull) - b0
        if full > 0:
            dst = out[b0 * bs : (b0 + full) * bs].view(full, bs)
            dst.copy_(qq[:full].view(torch.int8)).mul_(sf[b0 : b0 + full])
        if b1 > nfull:  # the zero-padded last block
            tail = qq[full:].view(torch.int8).to(torch.float32).mul_(sf[nfull:])
            out[nfull * bs :].copy_(tail[0, : n - nfull * bs])


def _dequantize_jit(
    kernels: Kernels,
    packed: ByteArray,
    sf: torch.Tensor,
    bits: int,
    bs: int,
    out: torch.Tensor,
) -> None:
    """:func:`dequantize_into`'s loops as one numba kernel, the same values bit for bit."""
    n, nb = out.numel(), sf.numel()
    nfull, threads = n // bs, torch.get_num_threads()
    src = packed.view(np.int8) if bits == 8 else packed.view()
    src.flags.writeable = False  # one compiled signature for bytes and bytearray payloads
    sfa: FloatArray = sf.numpy()
    outa: FloatArray = out.numpy()
    if nfull:
        kernels.dequantize(bits, src[:nfull], sfa[:nfull], bs, outa[: nfull * bs], threads)
    if nfull < nb:
        tail: FloatArray = scratch("d.tail", (bs,)).numpy()
        kernels.dequantize(bits, src[nfull:], sfa[nfull:], bs, tail, 1)
        outa[nfull * bs :] = tail[: n - nfull * bs]


def _finite(chunk: torch.Tensor, zeros: torch.Tensor) -> bool:
    """NaN/Inf check in one BLAS pass: 0 * x is NaN exactly when x is NaN or Inf."""
    return math.isfinite(float(torch.dot(chunk, zeros[: chunk.numel()])))


def encode_float_into(flat: torch.Tensor, name: str, body: torch.Tensor) -> None:
    """fp32/bf16: convert 1-D ``flat`` chunk by chunk into the uint8 tensor ``body``.

    bf16 rounds to nearest even (torch's conversion). Raises :class:`CodecError` on NaN/Inf,
    including finite float32 values that overflow bf16.
    """
    numel = flat.numel()
    dtype, width = (torch.float32, 4) if name == "fp32" else (torch.bfloat16, 2)
    step = min(CHUNK_VALUES, numel)
    aligned = body.data_ptr() % width == 0
    # Aligned: write straight into the payload; else convert into a scratch chunk first.
    target = body.view(dtype) if aligned else torch.empty(step, dtype=dtype)
    zeros = torch.zeros(step) if name == "fp32" else None
    exps = scratch("f.exps", (step,), torch.int16)
    for a in range(0, numel, step):
        b = min(numel, a + step)
        part = target[a:b] if aligned else target[: b - a]
        part.copy_(flat[a:b])
        if zeros is not None:
            ok = _finite(part, zeros)
        else:  # bf16: an all-ones exponent is Inf/NaN, also after overflow
            e = torch.bitwise_and(part.view(torch.int16), 0x7F80, out=exps[: b - a])
            ok = int(e.max()) != 0x7F80
        if not ok:
            raise CodecError("tensor", f"values from {a}", f"NaN or Inf (as {name})")
        if not aligned:
            body[width * a : width * b].copy_(part.view(torch.uint8))


def decode_float_into(raw: ByteArray, codec: str, flat: torch.Tensor) -> None:
    """fp32/bf16 payload bytes ``raw`` (may be read-only) into float32 ``flat``; refuses NaN/Inf."""
    numel = flat.numel()
    step = min(CHUNK_VALUES, numel)
    zeros = torch.zeros(step)
    flat_np: FloatArray = flat.numpy()
    if codec == "bf16":
        src16 = raw.view("<i2")
        bits = scratch("f.bits", (step,), torch.int16)
        bits_np = bits.numpy()
    for a in range(0, numel, step):
        b = min(numel, a + step)
        if codec == "fp32":
            np.copyto(flat_np[a:b], raw[4 * a : 4 * b].view("<f4"))
        else:
            np.copyto(bits_np[: b - a], src16[a:b])
            flat[a:b].copy_(bits[: b - a].view(torch.bfloat16))
        if not _finite(flat[a:b], zeros):
            raise CodecError("values", f"from {a}", f"NaN or Inf in a {codec} payload")
