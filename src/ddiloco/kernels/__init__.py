"""Compiled backends for the core's hot loops, and the one place that picks them.

The core stays pure: :mod:`ddiloco.core.quantize` runs its loops in eager torch, or in the
kernels module its caller hands it. Everything that is not pure about the fast path lives
here: importing numba, numba's on-disk cache (:mod:`ddiloco.kernels.quantize_jit`) and the
``DDILOCO_NO_JIT`` switch. The codec resolves its backend choice through :func:`load`.

The numba kernels give the same bytes and the same decoded values as the eager loops, bit
for bit, and only run where torch's own rounding was checked to match them
(``core.quantize.eager_rounds_exactly``), so results never depend on whether numba is
installed. "auto" takes them at every size: on 2 cores an int4 ``encode_into`` +
``decode(out)`` round trip costs 170-280 us with them and 360-450 us eager from 64 to 64K
values (mostly per-call overhead, which the kernels cut). Their one-time cost is per
process: importing numba and loading the cached kernels (about 1 s), or compiling them
where no cache exists yet (0.5-2 s per codec, direction and serial/parallel variant; 14 s
for all 16).
"""

from __future__ import annotations

import functools
import importlib
import os
from typing import cast

from ddiloco.core.quantize import BACKENDS, Backend, Kernels, eager_rounds_exactly
from ddiloco.errors import require

__all__ = ["BACKENDS", "Backend", "Kernels", "load", "unavailable_reason"]

NO_JIT_ENV = "DDILOCO_NO_JIT"


def load(choice: Backend = "auto") -> Kernels | None:
    """The kernels for ``choice``, or None for the eager torch loops.

    "eager": None. "auto": the numba kernels where they are usable, else None, silently.
    "jit": the numba kernels, or ImportError saying why they are not usable. ``DDILOCO_NO_JIT=1``
    turns them off for both (a kill switch for a broken numba); it is read on every call.
    """
    require(choice in BACKENDS, "backend", choice, f"must be one of {BACKENDS}")
    if choice == "eager":
        return None
    why = unavailable_reason()
    if why is None:
        return _jit()[0]
    if choice == "jit":
        raise ImportError(f"backend 'jit' asked for, but the numba kernels are off: {why}")
    return None


def unavailable_reason() -> str | None:
    """Why the numba kernels cannot run in this process, or None if they can."""
    if os.environ.get(NO_JIT_ENV, "") not in ("", "0"):
        return f"{NO_JIT_ENV}={os.environ[NO_JIT_ENV]} is set"
    return _jit()[1]


@functools.cache
def _jit() -> tuple[Kernels | None, str | None]:
    """Import the kernels once per process: (module, None) or (None, why not)."""
    try:
        module = importlib.import_module("ddiloco.kernels.quantize_jit")
    except Exception as exc:  # numba missing, or broken against this numpy: stay eager
        return None, f"importing them failed ({type(exc).__name__}: {exc})"
    if not eager_rounds_exactly():
        return None, "torch rounds x * inv to float32 first here (no FMA), unlike the kernels"
    return cast(Kernels, module), None
