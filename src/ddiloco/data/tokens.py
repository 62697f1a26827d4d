"""Prepared token directories (``ddiloco data prepare``): writing and reading them.

A directory holds ``train.bin`` and ``val.bin`` (raw little-endian uint16 or uint32 token
ids, the nanoGPT convention), ``meta.json`` and, for a JSON tokenizer, ``tokenizer.json``.
Reading one checks every file against meta.json before any training (a wrong, truncated or
mixed-up file is one line naming it) and hands out shards that are views of the files
(:class:`~ddiloco.data.shards.FileShard`): nothing is loaded.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
from blake3 import blake3

from ddiloco.data.info import FORMAT, META, Meta, read_meta, token_dtype
from ddiloco.data.shards import FileShard, TokenFile, TokenShard, TokenSplits
from ddiloco.data.tokenizer import TOKENIZER_FILE, json_vocab_size
from ddiloco.errors import ConfigError

CHUNK = 4096  # tokens per dealt chunk (raw text: bytes, the same number)
FILES = {"train": "train.bin", "val": "val.bin"}
MIN_VAL = 2  # one window's worth at least; eval_batches asks for a whole sequence


def numpy_dtype(name: str) -> np.dtype[np.unsignedinteger]:
    return np.dtype("<u2" if name == "uint16" else "<u4")


def is_prepared(source: str | Path) -> bool:
    return (Path(source) / META).is_file()


def looks_unprepared(source: str | Path) -> bool:
    """Token files without the meta.json that says how to read them (e.g. nanoGPT's)."""
    path = Path(source)
    return path.is_dir() and not is_prepared(path) and (path / FILES["train"]).is_file()


def check_directory(source: str | Path) -> Meta:
    """The directory's meta, once its files are checked: present, of the size meta.json says,
    and a tokenizer.json of the same vocabulary when the tokenizer is not bytes."""
    meta = read_meta(source)
    if meta is None:
        raise ConfigError("data.source", str(Path(source) / META), "missing")
    itemsize = numpy_dtype(meta.dtype).itemsize
    for split, name in FILES.items():
        path = meta.directory / name
        tokens = getattr(meta, split).tokens
        if not path.is_file():
            raise ConfigError("data.source", str(path), f"missing ({META} lists {tokens} tokens)")
        size = path.stat().st_size
        want = tokens * itemsize
        if size != want:
            other = 4 if itemsize == 2 else 2
            hint = ""
            if size == tokens * other:
                hint = f"; looks like uint{other * 8} tokens, {META} says {meta.dtype}"
            elif size < want:
                hint = "; truncated, or from another preparation"
            why = f"{size} bytes, {META} says {tokens} {meta.dtype} tokens = {want} bytes{hint}"
            raise ConfigError("data.source", str(path), why)
    tokenizer = meta.directory / TOKENIZER_FILE
    if meta.tokenizer in ("bpe", "hf"):
        if not tokenizer.is_file():
            why = f"missing ({META} says tokenizer {meta.tokenizer})"
            raise ConfigError("data.source", str(tokenizer), why)
        vocab = json_vocab_size(tokenizer)
        if vocab != meta.vocab_size:
            why = f"vocabulary {vocab}, {META} says vocab_size {meta.vocab_size}"
            raise ConfigError("data.source", str(tokenizer), why)
    return meta


def open_prepared(source: str | Path, num_shards: int) -> TokenSplits:
    """Shard m of ``num_shards``: every ``num_shards``-th CHUNK of train.bin from chunk m
    (the tail beyond whole rounds of chunks is dropped, as for raw text); eval: val.bin."""
    meta = check_directory(source)
    dtype = numpy_dtype(meta.dtype)
    rounds = meta.train.tokens // (CHUNK * num_shards)
    if rounds < 4:
        why = f"{meta.train.tokens} train tokens: too few for {num_shards} shards of 4 chunks"
        raise ConfigError("data.source", str(meta.directory / FILES["train"]), why)
    if meta.val.tokens < MIN_VAL:
        why = f"{meta.val.tokens} held-out tokens: too few to evaluate"
        raise ConfigError("data.source", str(meta.directory / FILES["val"]), why)
    train = TokenFile(meta.directory / FILES["train"], dtype, meta.train.tokens)
    val = TokenFile(meta.directory / FILES["val"], dtype, meta.val.tokens)
    shards: tuple[TokenShard, ...] = tuple(
        FileShard(train, rounds * CHUNK, CHUNK, m, num_shards) for m in range(num_shards)
    )
    return TokenSplits(shards, FileShard(val, meta.val.tokens))


class TokenWriter:
    """Appends token ids to a ``.bin`` file, hashing as it writes (no second read)."""

    def __init__(self, path: Path, dtype: str) -> None:
        self.path = path
        self.dtype = numpy_dtype(dtype)
        self.limit = np.iinfo(self.dtype).max
        self.file: BinaryIO = path.open("wb")
        self.hash = blake3()
        self.tokens = 0
        self.text_bytes = 0

    def write(self, ids: np.ndarray[Any, Any]) -> None:
        if ids.size == 0:
            return
        if int(ids.max()) > self.limit or int(ids.min()) < 0:
            raise ValueError(f"token id beyond {self.dtype} in {self.path.name}")
        data = ids.astype(self.dtype, copy=False).tobytes()
        self.file.write(data)
        self.hash.update(data)
        self.tokens += int(ids.size)

    def close(self) -> dict[str, Any]:
        """Flush to disk; the file's entry in meta.json's ``files``."""
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        return {"size": self.path.stat().st_size, "blake3": self.hash.hexdigest()}


def file_entry(path: Path) -> dict[str, Any]:
    digest = blake3()
    with path.open("rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return {"size": path.stat().st_size, "blake3": digest.hexdigest()}


def write_token_directory(
    out: Path,
    train: Iterable[np.ndarray[Any, Any]],
    val: Iterable[np.ndarray[Any, Any]],
    vocab_size: int,
    tokenizer: str = "none",
    text_bytes: tuple[int, int] | None = None,
) -> dict[str, Any]:
    """A token directory from token arrays made elsewhere (already tokenized corpora, tests,
    benchmarks): the files, then meta.json last. ``text_bytes`` (train, val) default to the
    token counts (bits per byte is then bits per token)."""
    out.mkdir(parents=True, exist_ok=True)
    dtype = token_dtype(vocab_size)
    files, counts = {}, []
    for split, chunks in (("train", train), ("val", val)):
        writer = TokenWriter(out / FILES[split], dtype)
        for chunk in chunks:
            writer.write(np.asarray(chunk))
        files[FILES[split]] = writer.close()
        counts.append(writer.tokens)
    sizes = text_bytes or (counts[0], counts[1])
    meta = {
        "format": FORMAT,
        "vocab_size": vocab_size,
        "dtype": dtype,
        "tokenizer": tokenizer,
        "eot_token": None,
        "train": {"tokens": counts[0], "text_bytes": sizes[0]},
        "val": {"tokens": counts[1], "text_bytes": sizes[1]},
        "files": files,
    }
    (out / META).write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
    return meta
