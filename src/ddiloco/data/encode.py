"""A data source as token ids in memory, for ``ddiloco eval --data``: every token of the
text the user named, with the model's own tokenizer, and the windows that predict each.

Raw text is encoded as ``ddiloco data prepare`` encodes it (documents in the same order, the
end-of-text token after each when the tokenizer has one, long texts in the same pieces), so
raw text and a directory prepared from it with the same tokenizer give the same tokens; a
prepared directory gives its held-out file (``val.bin``), read in place.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from ddiloco.data.prepare import ENCODE_PIECE, split_document
from ddiloco.data.shards import FileShard, TensorShard, TokenFile, TokenShard, as_shard
from ddiloco.data.sources import documents, iter_line_pieces
from ddiloco.data.tokenizer import HFTokenizer, Tokenizer
from ddiloco.data.tokens import FILES, check_directory, numpy_dtype
from ddiloco.errors import ConfigError

Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class Encoded:
    """Token ids and the text they stand for (what bits per byte divides by)."""

    tokens: TokenShard
    read: int  # tokens read (``tokens`` may hold fewer: those a limit needs)
    text_bytes: int  # UTF-8 bytes of text the tokens read encode (end-of-text excluded)
    documents: int  # documents read (0: a prepared directory)
    complete: bool  # False: reading stopped at the limit, more text follows

    @property
    def tokens_per_byte(self) -> float:
        """What turns bits per token into bits per byte."""
        return self.read / self.text_bytes


def encode_ids(tokenizer: Tokenizer, data: bytes) -> np.ndarray[tuple[int], np.dtype[np.int64]]:
    """``data`` (UTF-8, cut at a character boundary unless the tokens are bytes) as ids: in
    the ~4 KB pieces ``data prepare`` hands its tokenizer (the same tokens as the whole)."""
    if tokenizer.name == "bytes":
        return np.frombuffer(data, dtype=np.uint8).astype(np.int64)
    pieces = list(iter_line_pieces(data.decode("utf-8"), ENCODE_PIECE))
    if isinstance(tokenizer, HFTokenizer):
        encoded = tokenizer.encode_batch(pieces)
    else:
        encoded = [tokenizer.encode(p) for p in pieces]
    return np.asarray([i for ids in encoded for i in ids], dtype=np.int64)


def encode_text(
    source: str,
    tokenizer: Tokenizer,
    *,
    held_out: float | None = None,
    limit: int | None = None,
    key: str = "--data",
) -> Encoded:
    """``source``'s text (a file, directory, glob, jsonl/parquet, a saved dataset, the
    built-in corpus) as ``tokenizer``'s ids: all of every document, or with ``held_out``
    only its last fraction (as a run holds it out); reading stops once more than ``limit``
    + 1 tokens are read (``limit`` predictions need one more)."""
    parts: list[np.ndarray[tuple[int], np.dtype[np.int64]]] = []
    count = text_bytes = docs = 0
    on_char = tokenizer.name != "bytes"
    eot = np.asarray([] if tokenizer.eot is None else [tokenizer.eot], dtype=np.int64)
    complete = True
    for doc in documents(source, key=key):
        docs += 1
        if held_out is None:
            pieces: Iterator[bytes] = (p.encode("utf-8") for p in doc.pieces())
        else:
            split = split_document(doc, held_out, on_char)
            pieces = (data for part, data in split if part == 1 and data)
        for data in pieces:
            parts.append(encode_ids(tokenizer, data))
            count += len(parts[-1])
            text_bytes += len(data)
        parts.append(eot)  # (after each document's part, as data prepare writes it)
        count += len(eot)
        if limit is not None and count > limit + 1:
            complete = False
            break
    ids = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
    if limit is not None:
        ids = ids[: limit + 1]
    if len(ids) < 2 or text_bytes == 0:
        what = "held-out text" if held_out is not None else "text"
        why = f"{text_bytes} bytes of {what}, {len(ids)} tokens: too little to evaluate"
        raise ConfigError(key, source, why)
    return Encoded(TensorShard(torch.from_numpy(ids)), count, text_bytes, docs, complete)


def held_out_file(source: str) -> Encoded:
    """A prepared directory's held-out tokens (``val.bin``), read in place."""
    meta = check_directory(source)
    path = meta.directory / FILES["val"]
    val = meta.val
    if val.tokens < 2 or val.text_bytes == 0:
        why = f"{val.tokens} held-out tokens of {val.text_bytes} bytes: too few to evaluate"
        raise ConfigError("--data", str(path), why)
    file = TokenFile(path, numpy_dtype(meta.dtype), val.tokens)
    return Encoded(FileShard(file, val.tokens), val.tokens, val.text_bytes, 0, True)


def every_window(
    tokens: torch.Tensor | TokenShard, seq_len: int, batch_size: int, limit: int | None = None
) -> Iterator[Batch]:
    """Consecutive windows that predict every token after the first once (the first
    ``limit`` of them): batches of ``batch_size`` windows of ``seq_len``, the last shorter,
    read one batch at a time."""
    shard = as_shard(tokens)
    total = shard.numel() - 1 if limit is None else min(shard.numel() - 1, limit)
    full = total // seq_len
    for first in range(0, full, batch_size):
        starts = torch.arange(first, min(first + batch_size, full)) * seq_len
        window = shard.windows(starts, seq_len + 1)
        yield window[:, :-1], window[:, 1:]
    rest = total - full * seq_len
    if rest > 0:
        window = shard.windows(torch.tensor([full * seq_len]), rest + 1)
        yield window[:, :-1], window[:, 1:]


def predictions(tokens: torch.Tensor | TokenShard, limit: int | None = None) -> int:
    """How many tokens :func:`every_window` predicts."""
    total = as_shard(tokens).numel() - 1
    return total if limit is None else min(total, limit)
