"""Token shards and prepared directories: the same batches as before for raw text, views
(never copies) of token files, disjoint and covering shards, resumable positions, one-line
errors for a damaged directory, and O(batch) memory while reading a 100 MB file."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from ddiloco.data.corpus import CHUNK, BatchStream, eval_batches, load_documents, split_corpus
from ddiloco.data.info import bits_per_byte, read_meta, vocab_size
from ddiloco.data.shards import ConcatShard, FileShard, TensorShard, concatenated
from ddiloco.data.tokens import write_token_directory
from ddiloco.errors import ConfigError

# ---- the algorithm as it was before token directories (the reference for raw text) -------


# sha256 (first 16 hex digits) of the three shards and the held-out text of the shipped
# corpus, as the byte split before token directories cut them (4096-byte chunks dealt round
# robin, the last 5% of every play held out)
OLD_SPLIT = (["bb6a417ef59f72d2", "2e32235ea5290dbe", "d2853bf7fdcf714a"], "d007a5cfb01eeaee")


def digest(tokens: torch.Tensor) -> str:
    return hashlib.sha256(tokens.numpy().tobytes()).hexdigest()[:16]


def old_batches(tokens: torch.Tensor, batch_size: int, seq_len: int, seed: int, n: int):
    out = []
    for position in range(n):
        g = torch.Generator().manual_seed(seed * 1_000_003 + position)
        high = tokens.numel() - seq_len - 1
        starts = torch.randint(0, high, (batch_size,), generator=g)
        windows = tokens[starts[:, None] + torch.arange(seq_len + 1)].long()
        out.append((windows[:, :-1], windows[:, 1:]))
    return out


def old_eval(tokens: torch.Tensor, seq_len: int, batch_size: int, max_batches: int):
    count = min(max_batches * batch_size, (tokens.numel() - 1) // seq_len)
    stride = (tokens.numel() - seq_len - 1) // max(count, 1)
    starts = torch.arange(count) * stride
    windows = tokens[starts[:, None] + torch.arange(seq_len + 1)].long()
    return [
        (windows[i : i + batch_size, :-1], windows[i : i + batch_size, 1:])
        for i in range(0, count, batch_size)
    ]


def same(a, b) -> bool:
    return len(a) == len(b) and all(
        torch.equal(x, y) and torch.equal(u, v) for (x, u), (y, v) in zip(a, b, strict=True)
    )


@pytest.fixture(scope="module")
def shakespeare3():
    return split_corpus("shakespeare", 3)


def test_raw_text_batches_are_bit_for_bit_the_old_ones(shakespeare3):
    splits = shakespeare3
    assert all(isinstance(s, TensorShard) for s in splits.shards)
    assert ([digest(s.tokens) for s in splits.shards], digest(splits.eval.tokens)) == OLD_SPLIT
    old_shards, old_held = [s.tokens.clone() for s in splits.shards], splits.eval.tokens.clone()
    for m, (new, old) in enumerate(zip(splits.shards, old_shards, strict=True)):
        stream = BatchStream(new, 4, 64, seed=7 + m)
        assert same([stream.next() for _ in range(5)], old_batches(old, 4, 64, 7 + m, 5))
    assert same(eval_batches(splits.eval, 64, 16, 3), old_eval(old_held, 64, 16, 3))
    # the data-parallel baseline's view of every shard (was torch.cat of the shards)
    joined = concatenated(splits.shards)
    stream = BatchStream(joined, 3, 64, seed=1)
    assert same([stream.next() for _ in range(4)], old_batches(torch.cat(old_shards), 3, 64, 1, 4))
    # a plain tensor still works where a shard is expected (tests, examples)
    assert same(
        [BatchStream(old_shards[0], 2, 32, 5).next()], old_batches(old_shards[0], 2, 32, 5, 1)
    )


def test_a_stream_at_position_k_continues_like_one_advanced_k_times(tmp_path):
    write_token_directory(tmp_path, [np.arange(200_000) % 3000], [np.arange(5000)], 3000)
    shard = split_corpus(str(tmp_path), 2).shards[1]
    walked = BatchStream(shard, 4, 32, seed=3)
    for _ in range(6):
        walked.next()
    jumped = BatchStream(shard, 4, 32, seed=3)
    jumped.position = 6  # what a learner restored from a peer's snapshot does
    assert same([walked.next() for _ in range(3)], [jumped.next() for _ in range(3)])


def test_file_shards_are_disjoint_covering_dealt_views(tmp_path):
    n_train = CHUNK * 3 * 5 + 1234  # 5 whole rounds of 3 chunks, and a dropped tail
    write_token_directory(tmp_path, [np.arange(n_train)], [np.arange(7000) + 10**6], 1 << 21)
    splits = split_corpus(str(tmp_path), 3)
    seen = []
    for m, shard in enumerate(splits.shards):
        assert isinstance(shard, FileShard) and shard.file is splits.shards[0].file  # one file
        assert len(shard) == shard.numel() == 5 * CHUNK
        whole = shard.windows(torch.tensor([0]), shard.numel())[0].numpy()
        chunks = whole.reshape(5, CHUNK)
        assert (chunks[:, 0] // CHUNK == np.arange(5) * 3 + m).all()  # chunk m, m+3, m+6, ...
        seen.append(whole)
        # windows across a chunk edge read two pieces, in order
        edge = shard.windows(torch.tensor([CHUNK - 3, 0, 2 * CHUNK - 1]), 6).numpy()
        assert (edge[0] == np.concatenate([whole[CHUNK - 3 : CHUNK + 3]])).all()
        assert (edge[2] == whole[2 * CHUNK - 1 : 2 * CHUNK + 5]).all()
    everything = np.sort(np.concatenate(seen))
    assert (everything == np.arange(15 * CHUNK)).all()  # disjoint and covering
    assert splits.eval.numel() == 7000
    assert splits.eval.windows(torch.tensor([6990]), 10)[0].tolist() == list(
        range(10**6 + 6990, 10**6 + 7000)
    )
    joined = concatenated(splits.shards)
    assert isinstance(joined, ConcatShard)
    assert torch.equal(
        joined.windows(torch.tensor([0]), joined.numel())[0], torch.from_numpy(np.concatenate(seen))
    )
    assert joined.windows(torch.tensor([5 * CHUNK - 2]), 4)[0].tolist() == [
        *seen[0][-2:],
        *seen[1][:2],
    ]


def test_a_prepared_byte_directory_trains_on_exactly_the_raw_texts_batches(tmp_path, shakespeare3):
    docs = load_documents("shakespeare")
    cut = [len(t.encode()) - int(len(t.encode()) * 0.05) for _, t in docs]
    train = [np.frombuffer(t.encode()[:c], np.uint8) for (_, t), c in zip(docs, cut, strict=True)]
    val = [np.frombuffer(t.encode()[c:], np.uint8) for (_, t), c in zip(docs, cut, strict=True)]
    write_token_directory(tmp_path, train, val, 256, tokenizer="bytes")
    mapped = split_corpus(str(tmp_path), 3)
    for raw, view in zip(shakespeare3.shards, mapped.shards, strict=True):
        a, b = BatchStream(raw, 4, 64, 11), BatchStream(view, 4, 64, 11)
        assert same([a.next() for _ in range(3)], [b.next() for _ in range(3)])
    assert same(eval_batches(shakespeare3.eval, 64, 16, 2), eval_batches(mapped.eval, 64, 16, 2))


def test_vocab_and_bits_per_byte_follow_the_source(tmp_path):
    assert vocab_size("shakespeare") == 256
    assert bits_per_byte(np.log(2) * 3, "shakespeare") == pytest.approx(3.0)
    write_token_directory(
        tmp_path, [np.zeros(70_000, np.int64)], [np.zeros(100)], 50_000, text_bytes=(300_000, 400)
    )
    assert vocab_size(str(tmp_path)) == 50_000
    assert bits_per_byte(np.log(2), str(tmp_path)) == pytest.approx(100 / 400)


def _damage(tmp_path: Path, how: str) -> str:
    write_token_directory(tmp_path, [np.arange(80_000) % 500], [np.arange(3000) % 500], 500)
    meta = json.loads((tmp_path / "meta.json").read_text())
    if how == "missing":
        (tmp_path / "val.bin").unlink()
    elif how == "truncated":
        data = (tmp_path / "train.bin").read_bytes()
        (tmp_path / "train.bin").write_bytes(data[:-10])
    elif how == "longer":
        with (tmp_path / "train.bin").open("ab") as f:
            f.write(b"\0\0")
    elif how == "wider":  # written as uint32, meta says uint16
        ids = np.fromfile(tmp_path / "val.bin", "<u2").astype("<u4")
        ids.tofile(tmp_path / "val.bin")
    elif how == "dtype":
        meta["dtype"] = "uint32"
    elif how == "not-json":
        (tmp_path / "meta.json").write_text("{vocab_size: 3")
        return "unreadable meta.json"
    elif how == "tokenizer-vocab":
        meta["tokenizer"] = "bpe"
        (tmp_path / "tokenizer.json").write_text(json.dumps({"model": {"vocab": {"a": 0, "b": 1}}}))
    elif how == "tokenizer-missing":
        meta["tokenizer"] = "hf"
    if how == "no-meta":
        (tmp_path / "meta.json").unlink()
    else:
        (tmp_path / "meta.json").write_text(json.dumps(meta))
    return {
        "missing": r"val\.bin'?: missing",
        "truncated": r"train\.bin'?: 159990 bytes, meta.json says 80000 uint16 tokens = 160000 "
        r"bytes; truncated",
        "longer": r"train\.bin'?: 160002 bytes",
        "wider": r"val\.bin'?: 12000 bytes, .*looks like uint32 tokens",
        "dtype": r"meta\.json'?: dtype uint32 does not match vocab_size 500",
        "tokenizer-vocab": r"tokenizer\.json'?: vocabulary 2, meta.json says vocab_size 500",
        "tokenizer-missing": r"tokenizer\.json'?: missing \(meta.json says tokenizer hf\)",
        "no-meta": r"has train\.bin but no meta.json",
    }[how]


@pytest.mark.parametrize(
    "how",
    [
        "missing",
        "truncated",
        "longer",
        "wider",
        "dtype",
        "not-json",
        "tokenizer-vocab",
        "tokenizer-missing",
        "no-meta",
    ],
)
def test_a_damaged_directory_is_one_line_naming_the_file(tmp_path, how):
    why = _damage(tmp_path, how)
    with pytest.raises(ConfigError, match=why) as info:
        split_corpus(str(tmp_path), 2)
    assert info.value.field == "data.source"
    assert "\n" not in str(info.value)


def test_too_few_tokens_for_the_shards_is_refused(tmp_path):
    write_token_directory(tmp_path, [np.arange(4 * CHUNK * 2)], [np.arange(100)], 1 << 17)
    split_corpus(str(tmp_path), 2)  # exactly enough
    with pytest.raises(ConfigError, match=r"too few for 3 shards"):
        split_corpus(str(tmp_path), 3)


def test_a_window_beyond_a_file_shard_is_an_error(tmp_path):
    write_token_directory(tmp_path, [np.arange(5 * CHUNK)], [np.arange(100)], 1 << 17)
    shard = split_corpus(str(tmp_path), 1).shards[0]
    with pytest.raises(IndexError):
        shard.windows(torch.tensor([shard.numel() - 3]), 4)


def test_meta_records_and_reads_back(tmp_path):
    write_token_directory(tmp_path, [np.arange(10)], [np.arange(3)], 70_000, tokenizer="none")
    meta = read_meta(tmp_path)
    assert meta is not None and meta.dtype == "uint32" and meta.train.tokens == 10
    assert (tmp_path / "train.bin").stat().st_size == 40
    assert read_meta(tmp_path / "nowhere") is None


MEMORY_CHILD = textwrap.dedent(
    """
    import json, sys
    import psutil, torch
    from ddiloco.data.corpus import BatchStream, eval_batches, split_corpus
    torch.set_num_threads(1)
    process = psutil.Process()
    splits = split_corpus(sys.argv[1], 2)
    stream = BatchStream(splits.shards[0], 16, 256, seed=0)
    stream.next()
    eval_batches(splits.eval, 256, 16, 1)
    base = peak = process.memory_info().rss
    for i in range(3000):
        x, y = stream.next()
        if i % 25 == 0:
            peak = max(peak, process.memory_info().rss)
    evals = eval_batches(splits.eval, 256, 16, 8)
    peak = max(peak, process.memory_info().rss)
    print(json.dumps({"base": base, "peak": peak, "read": 3000 * 16 * 257, "evals": len(evals)}))
    """
)


def test_reading_a_100_mb_token_file_keeps_memory_o_of_the_batch(tmp_path):
    rng = np.random.default_rng(0)
    chunks = (rng.integers(0, 50_000, 5_000_000) for _ in range(10))  # 10 x 10 MB
    write_token_directory(tmp_path, chunks, [rng.integers(0, 50_000, 1_000_000)], 50_000)
    assert (tmp_path / "train.bin").stat().st_size == 100_000_000
    done = subprocess.run(
        [sys.executable, "-c", MEMORY_CHILD, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]  # what the child said, if it failed
    report = json.loads(done.stdout.strip().splitlines()[-1])
    growth = (report["peak"] - report["base"]) / 2**20
    assert report["read"] * 2 > 24_000_000  # 24 MB of windows spread over the 100 MB file
    assert growth < 40, f"RSS grew {growth:.1f} MiB reading a 100 MB token file"
