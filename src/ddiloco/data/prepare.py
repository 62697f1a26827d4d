"""``ddiloco data prepare``: text in, a token directory out (docs/data.md).

Two passes over the source when a BPE is trained (one to train it on the train split, one to
encode), one otherwise. Documents stream through: each is split (its last ``eval_fraction``
held out, as :func:`~ddiloco.data.corpus.split_corpus` splits raw text), encoded a MiB
at a time and appended to ``train.bin`` / ``val.bin``, so memory holds one batch of text and
its tokens, never the corpus. Everything is written into a hidden sibling directory and
renamed into place last: a crash leaves no directory that looks complete.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from blake3 import blake3

from ddiloco.data.info import FORMAT, META, read_meta, token_dtype
from ddiloco.data.sources import (
    Document,
    documents,
    is_hf_dataset,
    iter_line_pieces,
    line_pieces,
)
from ddiloco.data.tokenizer import (
    TOKENIZER_FILE,
    ByteTokenizer,
    HFTokenizer,
    Tokenizer,
    load_tokenizer,
    train_bpe,
)
from ddiloco.data.tokens import FILES, TokenWriter, file_entry, is_prepared
from ddiloco.errors import ConfigError, require

BATCH_TEXT = 1 << 20  # bytes of text encoded at once (its ids as Python ints: ~12 MB)
ENCODE_PIECE = 4096  # characters per text handed to the tokenizer (long texts encode slowly)
MAX_BPE_VOCAB = 1 << 20


@dataclass(frozen=True)
class Options:
    source: str
    out: Path
    tokenizer: str = "bytes"  # bytes, bpe:VOCAB, or a tokenizer.json (or its directory)
    text_field: str = "text"
    eval_fraction: float = 0.05
    force: bool = False  # replace an existing, non-empty --out


class Progress:
    """A line on stderr at most every ``every`` seconds, and one at the end."""

    def __init__(self, every: float = 2.0, stream: Any = None) -> None:
        self.every = every
        self.stream = sys.stderr if stream is None else stream
        self.last = time.monotonic()
        self.documents = 0
        self.text_bytes = 0
        self.skipped: dict[str, int] = {}  # line: files it stands for (said once, though
        # the source is read twice)

    def say(self, line: str) -> None:
        print(f"ddiloco data prepare: {line}", file=self.stream, flush=True)

    def warn(self, line: str, count: int = 1) -> None:
        """Files skipped (binary, a link not followed...): said once, counted in meta.json."""
        if line not in self.skipped:
            self.skipped[line] = count
            print(f"ddiloco: warning: {line}", file=self.stream, flush=True)

    def tick(self, tokens: int, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self.last >= self.every:
            self.last = now
            mb = self.text_bytes / 1e6
            self.say(f"{self.documents:,} documents, {mb:,.1f} MB read, {tokens:,} tokens written")


def split_document(doc: Document, fraction: float, on_char: bool) -> Iterator[tuple[int, bytes]]:
    """(0: train / 1: val, UTF-8 bytes) pieces of ``doc``: the last ``fraction`` of its bytes
    held out, cut where :func:`split_corpus` cuts (``on_char``: moved back to a character
    boundary, for tokenizers that read text)."""
    size = sum(len(piece.encode("utf-8")) for piece in doc.pieces())
    cut = size - int(size * fraction)
    seen = 0
    for piece in doc.pieces():
        data = piece.encode("utf-8")
        end = seen + len(data)
        if end <= cut:
            yield 0, data
        elif seen >= cut:
            yield 1, data
        else:
            k = cut - seen
            while on_char and k > 0 and data[k] & 0xC0 == 0x80:
                k -= 1
            yield 0, data[:k]
            yield 1, data[k:]
        seen = end


class SplitEncoder:
    """One split's text → tokens → file, a batch of text at a time, end-of-text after each
    document's part (when the tokenizer has one)."""

    def __init__(self, path: Path, dtype: str, tokenizer: Tokenizer) -> None:
        self.writer = TokenWriter(path, dtype)
        self.tokenizer = tokenizer
        self.pending: list[str | None] = []  # None: an end-of-text token
        self.pending_chars = 0
        self.open_document = False

    def add(self, data: bytes) -> None:
        if not data:
            return
        self.writer.text_bytes += len(data)
        self.open_document = True
        if isinstance(self.tokenizer, ByteTokenizer):
            self.writer.write(np.frombuffer(data, dtype=np.uint8))
            return
        for piece in iter_line_pieces(data.decode("utf-8"), ENCODE_PIECE):
            self.pending.append(piece)
            self.pending_chars += len(piece)
            if self.pending_chars >= BATCH_TEXT:  # (within a long piece too: one batch's
                self.flush()  # tokens at a time, whatever the line's length)

    def end_document(self) -> None:
        if self.open_document and self.tokenizer.eot is not None:
            self.pending.append(None)
        self.open_document = False

    def flush(self) -> None:
        texts = [t for t in self.pending if t is not None]
        if isinstance(self.tokenizer, HFTokenizer):
            encoded = iter(self.tokenizer.encode_batch(texts))
        else:
            encoded = iter([self.tokenizer.encode(t) for t in texts])
        eot = [self.tokenizer.eot]
        parts = [eot if t is None else next(encoded) for t in self.pending]
        if parts:
            self.writer.write(np.concatenate([np.asarray(p, dtype=np.int64) for p in parts]))
        self.pending, self.pending_chars = [], 0

    def close(self) -> dict[str, Any]:
        self.flush()
        return self.writer.close()


def make_tokenizer(options: Options, docs: Callable[[], Iterator[Document]]) -> Tokenizer:
    spec = options.tokenizer
    if spec == "bytes":
        return ByteTokenizer()
    if spec.startswith("bpe:"):
        try:
            vocab = int(spec[4:])
        except ValueError:
            vocab = 0
        ok = 257 <= vocab <= MAX_BPE_VOCAB
        require(ok, "--tokenizer", spec, f"bpe:VOCAB needs a vocabulary in 257..{MAX_BPE_VOCAB}")

        def train_text() -> Iterator[str]:
            for doc in docs():
                for split, data in split_document(doc, options.eval_fraction, on_char=True):
                    if split == 0 and data:
                        yield from line_pieces(data.decode("utf-8"), ENCODE_PIECE)

        return train_bpe(train_text(), vocab)
    path = Path(spec)
    if not (path.is_file() or path.is_dir()):
        why = "no such file: use bytes, bpe:VOCAB, or a tokenizer.json (or a directory of one)"
        raise ConfigError("--tokenizer", spec, why)
    return load_tokenizer(path, key="--tokenizer")


def _kind(options: Options, tokenizer: Tokenizer) -> str:
    if tokenizer.name == "bytes":
        return "bytes"
    return "bpe" if options.tokenizer.startswith("bpe:") else "hf"


def _check(options: Options) -> None:
    require(
        0.0 < options.eval_fraction < 0.5, "--eval-fraction", options.eval_fraction, "in (0, 0.5)"
    )
    out = options.out
    if out.exists() and not out.is_dir():
        raise ConfigError("--out", str(out), "exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not options.force:
        raise ConfigError("--out", str(out), "exists and is not empty (--force replaces it)")
    source = Path(options.source)
    if source.is_dir() and is_prepared(source):
        raise ConfigError("--source", options.source, "is already a prepared token directory")
    if source.resolve() == out.resolve() or out.resolve() in source.resolve().parents:
        raise ConfigError("--out", str(out), "holds the source (it would be replaced)")
    if source.is_dir() and not is_hf_dataset(source) and source.resolve() in out.resolve().parents:
        raise ConfigError("--out", str(out), "is inside the source directory (it would be read)")
    if out.is_dir() and any(out.iterdir()):
        _replaceable(out)


def _replaceable(out: Path) -> None:
    """``--force`` replaces a directory ``data prepare`` wrote, nothing else: its meta.json
    is ours and it holds only the files prepare writes (a mistyped ``--out ~`` is refused)."""
    if out.is_symlink():
        raise ConfigError("--out", str(out), "is a symlink: --force replaces only a directory")
    why = f"is not a prepared token directory (no {META}): --force replaces only those"
    try:
        if read_meta(out) is None:
            raise ConfigError("--out", str(out), why)
    except ConfigError as exc:
        if exc.field == "--out":
            raise
        raise ConfigError("--out", str(out), f"{why}; {exc.why}") from None
    ours = {*FILES.values(), META, TOKENIZER_FILE}
    stranger = sorted(p.name for p in out.iterdir() if p.name not in ours)
    if stranger:
        why = f"holds {stranger[0]!r}, which data prepare does not write: --force refuses it"
        raise ConfigError("--out", str(out), why)


def prepare(options: Options, progress: Progress | None = None) -> dict[str, Any]:
    """Tokenize ``options.source`` into ``options.out``; the meta.json written."""
    _check(options)
    progress = progress or Progress()

    def docs() -> Iterator[Document]:
        return documents(options.source, options.text_field, key="--source", warn=progress.warn)

    if options.tokenizer.startswith("bpe:"):
        progress.say(f"training a byte-level BPE ({options.tokenizer[4:]}) on the train split")
    tokenizer = make_tokenizer(options, docs)
    dtype = token_dtype(tokenizer.vocab_size)
    out = options.out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        meta = _encode(options, tokenizer, dtype, docs, tmp, progress)
        _replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return meta


def _encode(
    options: Options,
    tokenizer: Tokenizer,
    dtype: str,
    docs: Callable[[], Iterator[Document]],
    tmp: Path,
    progress: Progress,
) -> dict[str, Any]:
    on_char = tokenizer.name != "bytes"
    progress.last = time.monotonic()
    splits = [SplitEncoder(tmp / FILES[s], dtype, tokenizer) for s in ("train", "val")]
    content = blake3()  # of the documents' hashes, in order: ab|c and a|bc differ
    for doc in docs():
        progress.documents += 1
        digest = blake3()
        for split, data in split_document(doc, options.eval_fraction, on_char):
            digest.update(data)
            progress.text_bytes += len(data)
            splits[split].add(data)
        content.update(digest.digest())
        for encoder in splits:
            encoder.end_document()
        progress.tick(sum(e.writer.tokens for e in splits))
    if progress.documents == 0:
        raise ConfigError("--source", options.source, "no documents (only binary files?)")
    files = {FILES[s]: e.close() for s, e in zip(("train", "val"), splits, strict=True)}
    progress.tick(sum(e.writer.tokens for e in splits), force=True)
    train, val = (e.writer for e in splits)
    if train.tokens == 0 or val.tokens == 0:
        raise ConfigError("--source", options.source, "no text: the documents are empty")
    tokenizer.save(tmp)
    if (tmp / TOKENIZER_FILE).is_file():
        files[TOKENIZER_FILE] = file_entry(tmp / TOKENIZER_FILE)
    meta = {
        "format": FORMAT,
        "vocab_size": tokenizer.vocab_size,
        "dtype": dtype,
        "tokenizer": _kind(options, tokenizer),
        "eot_token": tokenizer.eot,
        "train": {"tokens": train.tokens, "text_bytes": train.text_bytes},
        "val": {"tokens": val.tokens, "text_bytes": val.text_bytes},
        "eval_fraction": options.eval_fraction,
        "documents": progress.documents,
        "skipped_files": sum(progress.skipped.values()),
        "source": {
            "path": options.source,
            "text_field": options.text_field,
            "blake3": content.hexdigest(),
        },
        "files": files,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    with (tmp / META).open("w", encoding="utf-8") as f:
        json.dump(meta, f, indent=2)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    return meta


def _replace(tmp: Path, out: Path) -> None:
    """``tmp`` becomes ``out``: one rename (an old ``out`` is moved aside first, then removed)."""
    old = None
    if out.exists() and any(out.iterdir()):
        old = out.parent / f".{out.name}.old-{os.getpid()}"
        os.replace(out, old)
    elif out.exists():
        out.rmdir()
    os.replace(tmp, out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
