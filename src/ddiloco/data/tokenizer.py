"""Tokenizers: bytes (no file, vocabulary 256) or a Hugging Face ``tokenizers`` JSON.

:func:`tokenizer_for` finds the tokenizer of a data source or a checkpoint directory: its
``tokenizer.json`` when it has one, else bytes. ``tokenizers`` is imported only here and only
when a JSON tokenizer is used (the ``data`` extra), so the byte path needs nothing installed.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Protocol

from ddiloco.data.info import BYTE_VOCAB, read_meta
from ddiloco.errors import ConfigError

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"  # what transformers' AutoTokenizer reads beside it
SPECIAL_TOKENS_MAP = "special_tokens_map.json"  # (older transformers read this one too)
EOT = "<|endoftext|>"  # the end-of-text token a trained BPE gets (id 0)
EOT_CANDIDATES = (EOT, "<|end_of_text|>", "</s>", "<eos>", "<|eot_id|>")
EXTRA = "pip install 'ddiloco[data]'"


class Tokenizer(Protocol):
    """What samples, checkpoints and ``data prepare`` need from a tokenizer."""

    @property
    def name(self) -> str: ...  # "bytes" or "hf" (a tokenizers JSON)

    @property
    def vocab_size(self) -> int: ...

    @property
    def eot(self) -> int | None: ...  # the end-of-text id documents are separated by

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def save(self, directory: Path) -> None: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens: what raw text trains on."""

    name = "bytes"
    vocab_size = BYTE_VOCAB
    eot = None

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        """Ids outside 0..255 (a model with a larger vocabulary may sample them) are skipped."""
        return bytes(i for i in ids if 0 <= i < BYTE_VOCAB).decode("utf-8", errors="replace")

    def save(self, directory: Path) -> None:
        """Nothing to write: no tokenizer.json means bytes."""


class HFTokenizer:
    """A Hugging Face ``tokenizers.Tokenizer`` (a trained BPE, or one brought as JSON)."""

    name = "hf"

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        ids = tokenizer.get_vocab(with_added_tokens=True).values()
        self.vocab_size: int = max(ids, default=-1) + 1
        found = (tokenizer.token_to_id(t) for t in EOT_CANDIDATES)
        self.eot: int | None = next((i for i in found if i is not None), None)

    @property
    def eot_token(self) -> str | None:
        """The end-of-text token's text (``<|endoftext|>`` for a BPE ``data prepare`` trained)."""
        return None if self.eot is None else self.tokenizer.id_to_token(self.eot)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Many texts at once (in parallel, inside ``tokenizers``)."""
        encodings = self.tokenizer.encode_batch(texts, add_special_tokens=False)
        return [e.ids for e in encodings]

    def decode(self, ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=False))

    def save(self, directory: Path) -> None:
        self.tokenizer.save(str(Path(directory) / TOKENIZER_FILE))


def same_vocabulary(a: Tokenizer, b: Tokenizer) -> bool:
    """Whether ids mean the same tokens in ``a`` and ``b`` (two BPEs of one size do not)."""
    if (a.name, a.vocab_size) != (b.name, b.vocab_size):
        return False
    if isinstance(a, HFTokenizer) and isinstance(b, HFTokenizer):
        vocab = [t.tokenizer.get_vocab(with_added_tokens=True) for t in (a, b)]
        return bool(vocab[0] == vocab[1])
    return True


def transformers_files(tokenizer: Tokenizer, context: int | None) -> dict[str, dict[str, Any]]:
    """The files beside a checkpoint's tokenizer.json that make ``AutoTokenizer`` know its
    special tokens: the end-of-text token that separated documents in training is
    ``eos_token`` and, as for GPT-2 (each document follows one), ``bos_token``; no pad token
    (set ``pad_token = eos_token`` to pad, as for GPT-2). ``context``: the model's, as
    ``model_max_length``. Byte tokens have no tokenizer.json and no end-of-text token (all
    256 ids are bytes): nothing to write."""
    if not isinstance(tokenizer, HFTokenizer):
        return {}
    special = {}
    if tokenizer.eot_token is not None:
        special = {"bos_token": tokenizer.eot_token, "eos_token": tokenizer.eot_token}
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special,
        "add_bos_token": False,  # (training never put one first: documents end with eos)
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
    }
    if context is not None:
        config["model_max_length"] = context
    return {TOKENIZER_CONFIG: config, SPECIAL_TOKENS_MAP: special}


def _tokenizers(key: str, value: object) -> Any:
    try:
        import tokenizers
    except ImportError as exc:
        raise ConfigError(key, value, f"needs the 'tokenizers' package: {EXTRA}") from exc
    return tokenizers


def load_tokenizer(path: str | Path, key: str = "tokenizer") -> HFTokenizer:
    """A ``tokenizer.json`` file, or a directory holding one."""
    file = Path(path)
    if file.is_dir():
        file = file / TOKENIZER_FILE
    if not file.is_file():
        raise ConfigError(key, str(file), "no such tokenizer.json")
    tokenizers = _tokenizers(key, str(file))
    try:
        return HFTokenizer(tokenizers.Tokenizer.from_file(str(file)))
    except Exception as exc:  # tokenizers raises a bare Exception on a malformed file
        raise ConfigError(key, str(file), f"not a tokenizers JSON: {exc}") from exc


def train_bpe(texts: Iterable[str], vocab_size: int, key: str = "--tokenizer") -> HFTokenizer:
    """A byte-level BPE (GPT-2's pre-tokenization) with ``<|endoftext|>`` as id 0, trained on
    ``texts``: deterministic for the same texts in the same order."""
    tk = _tokenizers(key, f"bpe:{vocab_size}")
    tokenizer = tk.Tokenizer(tk.models.BPE())
    tokenizer.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOT],
        initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return HFTokenizer(tokenizer)


def json_vocab_size(path: Path) -> int:
    """The vocabulary a tokenizer.json declares (highest id + 1), read as plain JSON so a
    prepared directory is checked without ``tokenizers`` installed."""
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
        vocab = raw["model"]["vocab"]
        ids = list(vocab.values()) if isinstance(vocab, dict) else list(range(len(vocab)))
        ids += [int(t["id"]) for t in raw.get("added_tokens") or ()]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError("data.source", str(path), f"unreadable tokenizer.json: {exc}") from exc
    except RecursionError:  # (json's C parser recurses)
        why = "unreadable tokenizer.json: nested too deeply"
        raise ConfigError("data.source", str(path), why) from None
    return max(ids, default=-1) + 1


def tokenizer_for(path: str | Path) -> Tokenizer:
    """The tokenizer of a prepared data directory or a checkpoint directory (its
    ``tokenizer.json``), of a tokenizer.json file itself, else bytes (raw text, the built-in
    corpus, a directory prepared with ``--tokenizer bytes``)."""
    where = Path(path)
    if where.is_file() and where.name == TOKENIZER_FILE:
        return load_tokenizer(where)
    if where.is_dir() and (where / TOKENIZER_FILE).is_file():
        return load_tokenizer(where)
    meta = read_meta(where) if where.is_dir() else None
    if meta is not None and meta.tokenizer == "none":
        raise ConfigError("tokenizer", str(where), "tokens made elsewhere: no tokenizer here")
    if meta is not None and meta.tokenizer != "bytes":
        why = f"meta.json says tokenizer {meta.tokenizer} but there is no {TOKENIZER_FILE}"
        raise ConfigError("tokenizer", str(where), why)
    return ByteTokenizer()
