"""Token shards: what a batch stream reads windows from, in memory or on disk.

A shard is a 1-D sequence of token ids that hands out ``windows(starts, length)``: an int64
``(len(starts), length)`` tensor. Raw text is tokenized into memory (:class:`TensorShard`,
today's byte tokens, indexed exactly as before). A prepared token file is read in place
(:class:`FileShard`): a learner's shard is index arithmetic over ``train.bin`` (its dealt
chunks), never a copy, and each window is one positional read (``os.pread``), so a process's
data memory is O(batch) whatever the file's size (docs/data.md, "Memory").
"""

from __future__ import annotations

import bisect
import os
import threading
import weakref
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ddiloco.errors import ConfigError

PREAD = hasattr(os, "pread")


class TokenShard(ABC):
    """A read-only 1-D sequence of token ids."""

    @abstractmethod
    def numel(self) -> int:
        """How many tokens."""

    @abstractmethod
    def windows(self, starts: torch.Tensor, length: int) -> torch.Tensor:
        """Tokens ``[s, s + length)`` for each ``s`` in ``starts``: int64 ``(n, length)``."""

    def __len__(self) -> int:
        return self.numel()


class TensorShard(TokenShard):
    """Tokens held in memory: a 1-D integer tensor (raw text's byte tokens)."""

    def __init__(self, tokens: torch.Tensor) -> None:
        self.tokens = tokens

    def numel(self) -> int:
        return int(self.tokens.numel())

    def windows(self, starts: torch.Tensor, length: int) -> torch.Tensor:
        return self.tokens[starts[:, None] + torch.arange(length)].long()


class TokenFile:
    """A raw little-endian token array on disk, read by position (no mapping, no cache of ours).

    Positional reads (not ``np.memmap``) because a mapping's touched pages count in the
    process's RSS and random windows touch all of them: reading 2000 batches from a 100 MB
    file through a memmap grew RSS by 71 MB (docs/data.md, "Memory"). The kernel's page
    cache still serves repeated reads, shared by every process on the machine.
    """

    def __init__(self, path: Path, dtype: np.dtype[np.unsignedinteger], count: int) -> None:
        self.path = path
        self.dtype = dtype
        self.count = count
        try:
            self.fd = os.open(path, os.O_RDONLY | getattr(os, "O_BINARY", 0))
        except OSError as exc:
            raise ConfigError("data.source", str(path), f"cannot open: {exc.strerror}") from exc
        self.lock = threading.Lock()  # only where there is no pread (a shared file offset)
        weakref.finalize(self, os.close, self.fd)

    def read(self, spans: Sequence[tuple[int, int]]) -> bytes:
        """The tokens of each ``(offset, count)`` span, in order, as one bytes object: one
        ``pread`` per span (faster than ``preadv`` into views: no buffer to acquire)."""
        size = self.dtype.itemsize
        fd = self.fd
        if PREAD:
            data = b"".join([os.pread(fd, n * size, o * size) for o, n in spans])
        else:  # Windows: no pread; seek and read under a lock
            with self.lock:
                parts = []
                for o, n in spans:
                    os.lseek(fd, o * size, os.SEEK_SET)
                    parts.append(os.read(fd, n * size))
                data = b"".join(parts)
        want = sum(n for _, n in spans) * size
        if len(data) != want:
            why = f"truncated while reading: {len(data)} of {want} bytes"
            raise ConfigError("data.source", str(self.path), why)
        return data


class FileShard(TokenShard):
    """Shard ``index`` of ``count`` of a token file: every ``count``-th chunk of ``chunk``
    tokens, starting with chunk ``index`` (``count = 1``: the whole file, or its first
    ``length`` tokens). Logical token i lives at ``((i // chunk) * count + index) * chunk +
    i % chunk`` in the file: the same dealing as raw text's shards, as index arithmetic."""

    def __init__(
        self, file: TokenFile, length: int, chunk: int = 1, index: int = 0, count: int = 1
    ) -> None:
        self.file = file
        self.length = length
        self.chunk = chunk
        self.index = index
        self.count = count

    def numel(self) -> int:
        return self.length

    def windows(self, starts: torch.Tensor, length: int) -> torch.Tensor:
        first: list[int] = starts.tolist()
        if first and (min(first) < 0 or max(first) + length > self.length):
            raise IndexError(f"window beyond a shard of {self.length} tokens")
        if self.count == 1:  # contiguous: one read per window
            spans = [(start, length) for start in first]
        else:
            spans = []
            chunk, stride, index = self.chunk, self.count, self.index
            for start in first:
                c, w = divmod(start, chunk)
                if w + length <= chunk:  # within one chunk (the common case): one read
                    spans.append(((c * stride + index) * chunk + w, length))
                    continue
                done = 0
                while done < length:  # across chunk edges: a read per piece
                    c, w = divmod(start + done, chunk)
                    take = min(chunk - w, length - done)
                    spans.append(((c * stride + index) * chunk + w, take))
                    done += take
        data = np.frombuffer(self.file.read(spans), dtype=self.file.dtype)
        return torch.from_numpy(data.astype(np.int64).reshape(len(first), length))


class ConcatShard(TokenShard):
    """Several shards end to end, as one (a data-parallel job's view of every shard)."""

    def __init__(self, parts: Sequence[TokenShard]) -> None:
        self.parts = tuple(parts)
        self.ends: list[int] = np.cumsum([p.numel() for p in self.parts]).tolist()

    def numel(self) -> int:
        return self.ends[-1] if self.ends else 0

    def windows(self, starts: torch.Tensor, length: int) -> torch.Tensor:
        out = torch.empty((len(starts), length), dtype=torch.int64)
        for row, start in enumerate(starts.tolist()):
            done = 0
            while done < length:
                part = bisect.bisect_right(self.ends, start + done)
                if part >= len(self.parts):
                    raise IndexError(f"window beyond {self.numel()} tokens")
                local = start + done - (self.ends[part] - self.parts[part].numel())
                take = min(self.ends[part] - (start + done), length - done)
                piece = self.parts[part].windows(torch.tensor([local]), take)
                out[row, done : done + take] = piece[0]
                done += take
        return out


def as_shard(tokens: torch.Tensor | TokenShard) -> TokenShard:
    """A shard for ``tokens`` (a 1-D tensor is wrapped as it is)."""
    return tokens if isinstance(tokens, TokenShard) else TensorShard(tokens)


def concatenated(shards: Sequence[torch.Tensor | TokenShard]) -> TokenShard:
    """Shards end to end; in-memory ones are concatenated as tensors (as ``torch.cat`` did)."""
    parts = [as_shard(s) for s in shards]
    if all(isinstance(p, TensorShard) for p in parts):
        return TensorShard(torch.cat([p.tokens for p in parts if isinstance(p, TensorShard)]))
    return ConcatShard(parts)


@dataclass(frozen=True)
class TokenSplits:
    """Disjoint token streams: one per learner shard, plus a held-out eval stream."""

    shards: tuple[TokenShard, ...]
    eval: TokenShard
