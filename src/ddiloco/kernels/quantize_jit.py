"""Fused numba kernels for the int codecs: one pass per block to quantize+pack, one to decode.

Owns nothing but inner loops: :mod:`ddiloco.core.quantize` calls them when it is handed
this module (:func:`ddiloco.kernels.load`) and keeps every check (NaN/Inf refusal, the scale
arithmetic and its range check) shared with the eager torch path. Importing this module
imports numba (about half a second) and raises ``ImportError`` without it; the kernels
compile on first use (0.5-2 s each, 14 s for all 16) and are cached on disk next to this
file (``__pycache__``), or in numba's user-wide cache when that is read-only, or nowhere
(then each process compiles what it uses).

Bit for bit the eager path's results:

* Block absmax on the float32 bits: ``bits & 0x7FFFFFFF`` orders like ``|x|`` (and maps
  -0.0 to 0), NaN/Inf are exactly the values ``>= 0x7F800000``, and an integer max
  vectorizes where a float max with NaN semantics does not. The absmax, NaN/Inf included,
  goes to ``am`` like the eager path's; the caller turns it into the scale (or refuses).
* ``inv = float32(qmax) / max(absmax, TINY)`` in float32, as numpy does it there.
* ``code = rint(float64(x) * float64(inv) + offset)``: the product of two float32 is exact
  in float64, so this rounds (half to even) the exact ``x * inv + offset``, which is what
  torch's fused multiply-add ``(MAGIC + offset) + x * inv`` gives where its kernels
  contract to an FMA (x86 AVX2 builds; :func:`ddiloco.kernels.load` checks, see
  ``core.quantize.eager_rounds_exactly``). |q| <= qmax always, so no clamp.
* Decoding multiplies ``float32(q * 2**(8 - bits))`` (int8/int4/int2; int1 ``+-1``) by the
  caller's ``sf = scale * 2**(bits - 8)`` in float32, as the eager path does, including its
  int8 wrap of the int2 code 3 (never written) to ``q = -2`` (see ``_d2``).

Layout of the code, for speed. Each codec has a serial kernel over rows of blocks (made
for its width by ``_enc_rows``/``_dec_rows``) and a parallel one (made by
``_encoder``/``_decoder``) that hands chunks of rows to it over ``prange``; small tensors
and one-thread runs call the serial one, skipping the thread pool.
Indices inside the rows are uint64: numba wraps negative signed indices, and that check
(which LLVM cannot drop for an offset it cannot prove non-negative) turns every vector load
into a gather, 2-3x slower. Slicing happens once per chunk, not per block: each slice
increments an atomic reference count that two threads would otherwise fight over. The
kernels release the GIL. Only full blocks go through them: the caller pads the last,
partial block into a scratch block.
"""

from __future__ import annotations

import os
import threading
import warnings
from collections.abc import Callable
from typing import Any

import numba  # raises ImportError without it: the caller falls back to the eager path
import numpy as np
from numba import prange

# The kernels are compiled for this process: a cache directory that cannot be written only
# costs the compile next time. Numba says so with a warning; that is expected, not news.
warnings.filterwarnings("ignore", category=numba.NumbaWarning, message=r"(?is).*cach")

_U = np.uint64
_TINY = np.float32(2.0**-100)
_NONFINITE = 0x7F800000  # float32 bits of +Inf: |x| bits at or above it are Inf or NaN
_POW2 = np.array([2.0 ** (e - 150) for e in range(256)])  # 2**(exponent field - 150)
_Q8, _Q4, _Q1 = np.float32(127.0), np.float32(7.0), np.float32(1.0)
# Values per chunk of rows handed to one thread: big enough that the per-chunk slicing is
# noise, small enough that two threads share the work evenly.
CHUNK_VALUES = 1 << 16
# Below this many values one thread does the whole tensor. Measured (int4, 2 cores): even
# at 128K values, from 256K on the parallel kernels win (1M: 0.58 vs 0.85 ms round trip).
PARALLEL_MIN_VALUES = 1 << 18


def _njit(fn: Callable[..., Any], parallel: bool) -> Any:
    """``numba.njit``, GIL-free, cached on disk where some cache directory is writable."""
    opts: dict[str, Any] = {"nogil": True, "parallel": parallel, "error_model": "numpy"}
    try:
        return numba.njit(cache=True, **opts)(fn)
    except RuntimeError:  # no cache directory is writable: compile in every process
        return numba.njit(**opts)(fn)


def _serial(fn: Callable[..., Any]) -> Any:
    return _njit(fn, parallel=False)


def _parallel(fn: Callable[..., Any]) -> Any:
    return _njit(fn, parallel=True)


def _inline(fn: Callable[..., Any]) -> Any:
    """For the small helpers: inlined into the kernels before LLVM sees them."""
    return numba.njit(inline="always", error_model="numpy")(fn)


@_inline
def _absmax_bits(xi: Any, base: Any, n: Any) -> Any:
    """Largest ``bits & 0x7FFFFFFF`` over ``xi[base:base + n]``: |x| as int32 bits."""
    m = np.int32(0)
    for i in range(n):
        m = max(m, np.int32(xi[base + i] & np.int32(0x7FFFFFFF)))
    return m


@_inline
def _inv(m: Any, qmax: Any) -> Any:
    """float64(float32(qmax) / max(absmax, TINY)), the absmax given by its bits ``m``."""
    e = m >> 23
    mant = (m & 0x7FFFFF) | (0x800000 if e else 0)
    absmax = np.float32(np.float64(mant) * _POW2[max(e, 1)])  # exact: 24 bits, power of 2
    return np.float64(qmax / max(absmax, _TINY))


@_inline
def _code(v: Any, inv: Any, offset: Any) -> Any:
    """round-half-even(v * inv + offset) as int32: the stored code, q + offset.

    ``v * inv`` is exact in float64 (two 24-bit significands). The sum with the offset
    (0, 8 or 1) is exact too unless ``|v * inv|`` is tiny (below 1/8), and then it is far
    from any tie, so the result is the exact value rounded once, as torch's FMA does.
    Rounding after the offset matters for int2's odd one: a tie +-0.5 rounds to q = +-1.
    """
    return np.int32(np.rint(np.float64(v) * inv + offset))


# Encoders. ``x`` (nb * bs,) float32, whole blocks only, and ``xi`` the same memory as
# int32; ``am`` (nb,) int32 gets the bits of each block's absmax (the caller reads them as
# float32); ``packed`` (nb, bs * bits / 8) uint8. Row ``b`` reads block ``b`` only. The
# layout is planar: byte ``j`` of a row holds the codes of values ``j, p + j, 2p + j...``
# (``p`` bytes a row), value ``k * p + j`` at bit ``bits * k``.


@_inline
def _sign_bit(v: Any, inv: Any, offset: Any) -> Any:
    """int1's code: the sign bit (-0.0 gives 1, as torch.ge(x, 0.0)); no scale needed."""
    return np.int32(v >= np.float32(0.0))


def _enc_rows(bits: int, code: Any, qmax: Any, offset: float) -> Any:
    """The serial encoder of one width: ``code(v, inv, offset)`` per value, ``8 // bits``
    codes a byte. ``bits``, ``code`` and the loop count are constants to numba, so LLVM
    unrolls the loop over the codes of a byte and vectorizes over the bytes."""
    per = 8 // bits

    @_serial
    def rows(x: Any, xi: Any, bs: int, am: Any, packed: Any) -> None:
        n = _U(bs)
        p = n // _U(per)
        for b in range(am.shape[0]):
            row, base = _U(b), _U(b) * n
            m = _absmax_bits(xi, base, n)
            am[row] = m
            if m >= _NONFINITE:
                continue  # refused by the caller; the codes are never used
            inv = _inv(m, qmax)
            for j in range(p):
                byte = 0
                for k in range(per):
                    byte |= code(x[base + _U(k) * p + j], inv, offset) << (bits * k)
                packed[row, j] = np.uint8(byte & 0xFF)

    return rows


# Decoders. ``packed`` (nb, bs * bits / 8) uint8 (int8 for int8), ``sf`` (nb,) float32
# scale * 2**(bits - 8), ``out`` (nb * bs,) float32. ``value(t)`` reads the code in the
# low bits of ``t`` as the eager path's float32(q * 2**(8 - bits)).


@_inline
def _d8(t: Any) -> Any:
    """The int8 code itself (``t`` holds it sign-extended)."""
    return np.float32(t)


@_inline
def _d4(t: Any) -> Any:
    """Nibble ``t & 15`` = q + 8 -> float32(q * 16), as the eager int8 of ``nibble ^ 8 << 4``."""
    return np.float32(np.int32(((t & 15) - 8) * 16))


@_inline
def _d2(t: Any) -> Any:
    """Code ``t & 3`` -> float32 of the eager path's int8 ``(code << 6) - 64``: codes 0, 1, 2,
    3 give -64, 0, 64 and -128 (3 is never written; int8 wraps 128 to -128)."""
    return np.float32(np.int32(((((t & 3) << 6) + 64) & 0xFF) - 128))


@_inline
def _d1(t: Any) -> Any:
    """Bit ``t & 1`` -> +1.0 or -1.0 (times a zero scale, -1 gives -0.0 as in eager)."""
    return np.float32(np.int32(((t & 1) << 1) - 1))


def _dec_rows(bits: int, value: Any) -> Any:
    """The serial decoder of one width, the encoder's layout read back."""
    per = 8 // bits

    @_serial
    def rows(packed: Any, sf: Any, bs: int, out: Any) -> None:
        n = _U(bs)
        p = n // _U(per)
        for b in range(sf.shape[0]):
            row, base = _U(b), _U(b) * n
            s = sf[row]
            for j in range(p):
                t = np.int32(packed[row, j])
                for k in range(per):
                    out[base + _U(k) * p + j] = value(t >> (bits * k)) * s

    return rows


# Parallel drivers: chunks of ``step`` rows over the thread pool, one slice per chunk. Each
# is compiled for the one row kernel it closes over (numba freezes it as a constant).


def _encoder(rows: Any) -> Any:
    @_parallel
    def encode(x: Any, xi: Any, bs: int, am: Any, packed: Any, step: int) -> None:
        nb = am.shape[0]
        for c in prange((nb + step - 1) // step):
            b0, b1 = c * step, min(nb, c * step + step)
            rows(x[b0 * bs : b1 * bs], xi[b0 * bs : b1 * bs], bs, am[b0:b1], packed[b0:b1])

    return encode


def _decoder(rows: Any) -> Any:
    @_parallel
    def decode(packed: Any, sf: Any, bs: int, out: Any, step: int) -> None:
        nb = sf.shape[0]
        for c in prange((nb + step - 1) // step):
            b0, b1 = c * step, min(nb, c * step + step)
            rows(packed[b0:b1], sf[b0:b1], bs, out[b0 * bs : b1 * bs])

    return decode


_ENC_ROWS = {
    8: _enc_rows(8, _code, _Q8, 0.0),
    4: _enc_rows(4, _code, _Q4, 8.0),
    2: _enc_rows(2, _code, _Q1, 1.0),
    1: _enc_rows(1, _sign_bit, _Q1, 0.0),
}
_DEC_ROWS = {8: _dec_rows(8, _d8), 4: _dec_rows(4, _d4), 2: _dec_rows(2, _d2), 1: _dec_rows(1, _d1)}
_ENC: dict[int, tuple[Any, Any]] = {b: (r, _encoder(r)) for b, r in _ENC_ROWS.items()}
_DEC: dict[int, tuple[Any, Any]] = {b: (r, _decoder(r)) for b, r in _DEC_ROWS.items()}


# One parallel launch at a time: numba's "workqueue" threading layer (its fallback without
# OpenMP or TBB) aborts the process on concurrent launches, and with the others two
# launches would only oversubscribe the cores. A caller that finds it taken runs serially.
_LAUNCH = threading.Lock()
# GNU OpenMP's pool does not survive fork(): a forked child that launches on it aborts.
# Children of the importing process run serially.
_PID = os.getpid()


def _run(serial: Any, parallel: Any, values: int, threads: int, bs: int, *args: Any) -> None:
    """``parallel`` on ``threads`` threads (torch's count) where worth it and safe, else
    ``serial``; both on ``args``."""
    wide = threads > 1 and values >= PARALLEL_MIN_VALUES and os.getpid() == _PID
    if not (wide and _LAUNCH.acquire(blocking=False)):
        serial(*args)
        return
    try:
        pool = numba.config.NUMBA_NUM_THREADS  # type: ignore[attr-defined]
        numba.set_num_threads(min(threads, pool))
        parallel(*args, max(1, CHUNK_VALUES // bs))
    finally:
        _LAUNCH.release()


def quantize(bits: int, x: Any, bs: int, am: Any, packed: Any, threads: int) -> None:
    """Codes of the whole blocks ``x`` (float32) into ``packed``, absmax bits into ``am``
    (int32), on up to ``threads`` threads."""
    serial, parallel = _ENC[bits]
    _run(serial, parallel, x.shape[0], threads, bs, x, x.view(np.int32), bs, am, packed)


def dequantize(bits: int, packed: Any, sf: Any, bs: int, out: Any, threads: int) -> None:
    """Values of whole blocks into ``out`` (float32) from ``packed`` (read-only uint8; int8
    for int8) and ``sf`` (float32 scale * 2**(bits - 8)), on up to ``threads`` threads."""
    serial, parallel = _DEC[bits]
    _run(serial, parallel, out.shape[0], threads, bs, packed, sf, bs, out)
