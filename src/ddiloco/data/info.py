"""What a data source tells the rest of a run before any token is read: its vocabulary, the
ratio of its held-out tokens to text bytes (bits per byte), and a prepared directory's meta.

Raw text (the built-in corpus, a file, a directory) is byte tokens, vocabulary 256; a
directory written by ``ddiloco data prepare`` says its vocabulary in ``meta.json``. The model
is built for it (:func:`ddiloco.models.registry.build_model`) and checked against it. Only
``json`` here: the models import this module.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ddiloco.errors import ConfigError

BYTE_VOCAB = 256  # raw text: tokens are bytes
META = "meta.json"  # what `ddiloco data prepare` writes beside its token files
FORMAT = "ddiloco.tokens/1"
# bytes; a BPE trained by prepare; a tokenizer.json brought; tokens made elsewhere (no tokenizer)
TOKENIZER_KINDS = ("bytes", "bpe", "hf", "none")
SPLITS = ("train", "val")


def token_dtype(vocab: int) -> str:
    """The nanoGPT convention: uint16 while every id fits, else uint32."""
    return "uint16" if vocab <= 1 << 16 else "uint32"


@dataclass(frozen=True)
class Split:
    tokens: int  # token ids in the split's file
    text_bytes: int  # UTF-8 bytes of the text they encode (end-of-text tokens excluded)


@dataclass(frozen=True)
class Meta:
    """A prepared directory's ``meta.json``, checked field by field."""

    path: Path  # the meta.json file
    vocab_size: int
    dtype: str
    tokenizer: str
    eot: int | None
    train: Split
    val: Split
    raw: dict[str, Any]

    @property
    def directory(self) -> Path:
        return self.path.parent


def read_meta(source: str | Path) -> Meta | None:
    """``source``'s meta.json, validated; None when ``source`` is not a prepared directory."""
    path = Path(source) / META
    if not path.is_file():
        return None

    def bad(why: str) -> ConfigError:
        return ConfigError("data.source", str(path), why)

    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise bad(f"unreadable meta.json: {exc}") from exc
    except RecursionError:  # (json's C parser recurses)
        raise bad("unreadable meta.json: nested too deeply") from None
    if not isinstance(raw, dict):
        raise bad("meta.json is not an object")

    def count(value: Any, name: str, least: int = 0) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise bad(f"{name} {value!r} is not a count")
        return value

    vocab = count(raw.get("vocab_size"), "vocab_size", 1)
    dtype = raw.get("dtype", token_dtype(vocab))
    if dtype not in ("uint16", "uint32"):
        raise bad(f"dtype {dtype!r}: token files are uint16 or uint32")
    if dtype != token_dtype(vocab):
        raise bad(f"dtype {dtype} does not match vocab_size {vocab} (want {token_dtype(vocab)})")
    kind = raw.get("tokenizer", "bytes")
    if kind not in TOKENIZER_KINDS:
        raise bad(f"tokenizer {kind!r}: known {', '.join(TOKENIZER_KINDS)}")
    if kind == "bytes" and vocab != BYTE_VOCAB:
        raise bad(f"tokenizer bytes has vocab_size {BYTE_VOCAB}, not {vocab}")
    eot = raw.get("eot_token")
    if eot is not None and count(eot, "eot_token") >= vocab:
        raise bad(f"eot_token {eot} is outside vocab_size {vocab}")
    splits = []
    for name in SPLITS:
        part = raw.get(name)
        if not isinstance(part, dict):
            raise bad(f"no {name!r} split (tokens, text_bytes)")
        tokens = count(part.get("tokens"), f"{name}.tokens")
        splits.append(Split(tokens, count(part.get("text_bytes"), f"{name}.text_bytes")))
    return Meta(path, vocab, dtype, kind, eot, splits[0], splits[1], raw)


def vocab_size(source: str) -> int:
    """The vocabulary of ``source``'s tokens."""
    meta = read_meta(source)
    return BYTE_VOCAB if meta is None else meta.vocab_size


def bits_per_byte(loss_nats_per_token: float, source: str) -> float:
    """Eval loss in bits per UTF-8 byte of text: ``loss / ln 2 x (eval tokens / eval bytes)``,
    comparable across tokenizers (byte tokens: just ``loss / ln 2``)."""
    meta = read_meta(source)
    bits = loss_nats_per_token / math.log(2)
    if meta is None or meta.val.text_bytes == 0:
        return bits
    return bits * meta.val.tokens / meta.val.text_bytes
