"""The weights file: a model's state as safetensors, streamed to disk while it is hashed.

The bytes are the safetensors format (an 8-byte little-endian header length, a JSON header
of dtypes, shapes and data offsets padded with spaces to 8 bytes, then every tensor's raw
bytes back to back), read back by safetensors' own loader (``load_model``) and by
transformers. Writing it here rather than through ``save_file`` lets the checkpoint's cost
stay near a plain write: each chunk is hashed (BLAKE3) on a second thread while this one
writes it, and the kernel is told to write back as it goes (``fdatasync`` on that thread),
so the digest needs no second pass and the final fsync little waiting. Every call here
releases the GIL (os.write, BLAKE3, fdatasync): a syncer writing a checkpoint on a thread
keeps merging. Tensors sharing storage (tied weights) are written once, as ``save_model``
does, and ``load_model`` ties them again.
"""

from __future__ import annotations

import json
import os
import struct
import sys
from collections.abc import Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import blake3
import torch

CHUNK = 8 << 20  # bytes written (and hashed) at a time
FLUSH = 32 << 20  # bytes between two write-back requests
HASH_THREADS = 1  # BLAKE3 threads (blake3.blake3.AUTO: every core)

DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


def unique(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """One name per storage (tied weights once: the first name in sorted order), each on
    the CPU and contiguous."""
    seen: set[tuple[object, ...]] = set()
    out: dict[str, torch.Tensor] = {}
    for name in sorted(state):
        t = state[name].detach()
        key = (str(t.device), t.data_ptr(), t.dtype, tuple(t.shape), t.stride())
        if t.numel() and key in seen:  # the same tensor under another name: tied
            continue
        seen.add(key)
        if t.dtype not in DTYPES:
            raise ValueError(f"tensor {name}: dtype {t.dtype} has no safetensors name")
        out[name] = t.cpu().contiguous()
    return out


def _pieces(
    prefix: bytes, tensors: Mapping[str, torch.Tensor], order: list[str]
) -> Iterator[memoryview]:
    yield memoryview(prefix)
    for name in order:
        raw = tensors[name].reshape(-1).view(torch.uint8).numpy().data  # no copy
        for start in range(0, len(raw), CHUNK):
            yield raw[start : start + CHUNK]


def write_weights(path: Path, state: Mapping[str, torch.Tensor], metadata: dict[str, str]) -> str:
    """Write ``state`` to ``path`` (a new file) as safetensors, fsynced; returns its BLAKE3
    digest (hex). An OSError (a full disk) leaves a partial file for the caller to remove."""
    if sys.byteorder != "little":
        raise OSError("safetensors is little-endian; this host is not")
    tensors = unique(state)
    order = sorted(tensors, key=lambda n: (-tensors[n].element_size(), n))
    header: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    for name in order:
        t = tensors[name]
        size = t.numel() * t.element_size()
        header[name] = {
            "dtype": DTYPES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-(8 + len(head)) % 8)
    hasher = blake3.blake3(max_threads=HASH_THREADS)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        with ThreadPoolExecutor(2, thread_name_prefix="checkpoint-io") as pool:
            hashing: Future[object] | None = None
            flushing: Future[None] | None = None
            unflushed = 0
            for piece in _pieces(struct.pack("<Q", len(head)) + head, tensors, order):
                if hashing is not None:
                    hashing.result()  # in order: one chunk hashed at a time
                hashing = pool.submit(hasher.update, piece)
                while piece:
                    piece = piece[os.write(fd, piece) :]
                unflushed += CHUNK
                if unflushed >= FLUSH and (flushing is None or flushing.done()):
                    flushing = pool.submit(os.fdatasync, fd)
                    unflushed = 0
            for future in (hashing, flushing):
                if future is not None:
                    future.result()
        os.fsync(fd)
    finally:
        os.close(fd)
    return str(hasher.hexdigest())
