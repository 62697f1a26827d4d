"""Give freed memory back to the system (glibc), for a process whose big buffers come and go.

glibc serves an allocation of at least its mmap threshold from a mapping of its own, given
back when freed; below it, from heaps that shrink only at their top. The threshold starts at
128 KiB and rises to the size of each mapped block freed (up to 32 MiB): after its first
merges, a syncer's fragment-sized answers, payloads and temporaries came from the heaps, and
the memory they left stayed in its resident set (a gpt-50m syncer ended a run at 952 MiB
where 680 MiB were in use, issue 28). A fixed threshold keeps them mapped, so each is given
back when freed, at the cost of fresh pages (page faults) for each new one: right for the
syncer, whose buffers are a fragment or more (1 MiB). A learner's many activations would
pay that cost every step (1 MiB: steps +11% DDP, +32% FSDP at a 201M GPT on CPU), so a
learner fixes it higher (``processes.learner_mmap_threshold``, 8 MiB): its all-gather,
attention and MLP buffers are mapped and given back, its small activations reuse the heap
(the same run: ranks' peaks -400 MiB DDP, -560 MiB FSDP, steps unchanged; BENCHMARKS.md).
"""

from __future__ import annotations

import ctypes
import logging

log = logging.getLogger(__name__)

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter (malloc.h)
SYNCER_THRESHOLD = 1 << 20  # blocks of 1 MiB or more: their own mapping, returned when freed
# (a learner's: processes.learner_mmap_threshold, config.py)


def _libc() -> ctypes.CDLL | None:
    """The C library this process runs on: its own symbols (``find_library`` would run
    ``ldconfig``, a process the pre-flight must not start)."""
    try:
        return ctypes.CDLL(None)
    except OSError:
        return None


def give_back_freed_memory(threshold: int = SYNCER_THRESHOLD) -> bool:
    """Fix glibc's mmap threshold at ``threshold`` bytes; False where that is not glibc
    (musl, macOS: nothing to do, nothing changes)."""
    libc = _libc()
    mallopt = getattr(libc, "mallopt", None)
    if mallopt is None:
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    done = bool(mallopt(M_MMAP_THRESHOLD, threshold))
    log.debug("mmap threshold fixed at %d bytes: %s", threshold, done)
    return done


def trim_heap() -> bool:
    """Give the heap's free pages back now (glibc's ``malloc_trim``); False where that is not
    glibc. For a process done with a big transient job that lives on: the launcher after its
    pre-flight step of the model kept 655 of its 950 MiB peak for the whole run (gpt-50m),
    260 MiB once trimmed (issue 28)."""
    trim = getattr(_libc(), "malloc_trim", None)
    if trim is None:
        return False
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    trim(0)
    return True
