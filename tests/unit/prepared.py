"""Test helpers for prepared data directories."""

from __future__ import annotations

import json
from pathlib import Path


def write_meta(directory: Path, vocab: int) -> Path:
    """A prepared directory's meta.json as ``ddiloco data prepare`` writes it (no token files:
    the vocabulary is checked before any token is read)."""
    directory.mkdir(exist_ok=True)
    split = {"tokens": 0, "text_bytes": 0}
    meta = {"vocab_size": vocab, "tokenizer": "bpe", "train": split, "val": split}
    (directory / "meta.json").write_text(json.dumps(meta))
    return directory
