"""Data loading: our token-file reader against a plain ``np.memmap`` slice loop, and the
memory of a process reading batches as the corpus grows.

Throughput: ``BatchStream`` over a prepared directory's train.bin (one shard, so a logical
window is a contiguous file range) against the same windows cut from an ``np.memmap`` of
the same file into a preallocated int64 batch (``out[r] = mm[s : s + L]``), every page of
the mapping touched beforehand (its best case: no page faults). Both count tokens per second
of (batch, seq_len + 1) windows; the stream also draws its starts from its generator (the
baseline gets them precomputed). Repeats interleave the two; ratios are from medians. A
4-shard (dealt) stream is timed too, for information.

Memory: one fresh process per corpus size opens the directory as a learner does (4 shards),
draws batches from shard 0 and the eval batches, and reports its RSS growth over its state
just before the first batch and its peak RSS (VmHWM); the same for the ``np.memmap`` loop,
whose mapped pages count in its RSS.

    python benchmarks/bench_data.py [--sizes 10,100,300] [--batch 16] [--seq 256,1024]
                                    [--batches 2000] [--repeats 5] [--dir DIR]

Target: ratio >= 0.8; peak RSS flat in the corpus size.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from ddiloco.data.corpus import BatchStream, split_corpus
from ddiloco.data.tokens import write_token_directory

TARGET = 0.8
VOCAB = 50_000

CHILD = """
import json, sys
import numpy as np, psutil, torch
from ddiloco.data.corpus import BatchStream, eval_batches, split_corpus
torch.set_num_threads(1)
directory, kind, batch, seq, batches = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:])
process = psutil.Process()
if kind == "ours":
    splits = split_corpus(directory, 4)
    stream = BatchStream(splits.shards[0], batch, seq, seed=0)
    draw = stream.next
else:
    mm = np.memmap(directory + "/train.bin", dtype="<u2", mode="r")
    rng = np.random.default_rng(0)
    def draw():
        out = np.empty((batch, seq + 1), np.int64)
        for r, s in enumerate(rng.integers(0, len(mm) - seq - 1, batch).tolist()):
            out[r] = mm[s : s + seq + 1]
        return torch.from_numpy(out)
draw()
base = peak = process.memory_info().rss
for i in range(batches):
    draw()
    if i % 20 == 0:
        peak = max(peak, process.memory_info().rss)
if kind == "ours":
    eval_batches(splits.eval, seq, 16, 8)
peak = max(peak, process.memory_info().rss)
hwm = next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmHWM"))
print(json.dumps({"growth": peak - base, "hwm": hwm}))
"""


def make_directory(root: Path, megabytes: int) -> Path:
    out = root / f"tokens-{megabytes}mb"
    rng = np.random.default_rng(megabytes)
    tokens = megabytes * 1_000_000 // 2
    step = 5_000_000

    def chunks():
        for start in range(0, tokens, step):
            yield rng.integers(0, VOCAB, min(step, tokens - start), dtype=np.int64)

    write_token_directory(out, chunks(), [rng.integers(0, VOCAB, 500_000)], VOCAB)
    return out


def throughput(directory: Path, batch: int, seq: int, batches: int, repeats: int) -> None:
    tokens = batch * (seq + 1) * batches
    shard = split_corpus(str(directory), 1).shards[0]
    dealt = split_corpus(str(directory), 4).shards[0]
    mm = np.memmap(directory / "train.bin", dtype="<u2", mode="r")
    int(mm[::2048].sum())  # map every page: the baseline at its best
    starts = []
    probe = BatchStream(shard, batch, seq, seed=0)
    for position in range(batches):  # the very windows the stream draws
        g = torch.Generator().manual_seed(probe.seed * 1_000_003 + position)
        starts.append(torch.randint(0, shard.numel() - seq - 1, (batch,), generator=g).tolist())

    def ours(target=shard) -> float:
        stream = BatchStream(target, batch, seq, seed=0)
        t = time.perf_counter()
        for _ in range(batches):
            stream.next()
        return tokens / (time.perf_counter() - t)

    def plain() -> float:
        t = time.perf_counter()
        for row_starts in starts:
            out = np.empty((batch, seq + 1), np.int64)
            for r, s in enumerate(row_starts):
                out[r] = mm[s : s + seq + 1]
            batch_tensor = torch.from_numpy(out)
            _ = batch_tensor[:, :-1], batch_tensor[:, 1:]
        return tokens / (time.perf_counter() - t)

    x, _ = BatchStream(shard, batch, seq, seed=0).next()
    assert (x[0].numpy() == mm[starts[0][0] : starts[0][0] + seq]).all()  # the same windows
    ours_tps, plain_tps, dealt_tps = [], [], []
    for _ in range(repeats):
        plain_tps.append(plain())
        ours_tps.append(ours())
        dealt_tps.append(ours(dealt))
    o, p, d = (statistics.median(v) for v in (ours_tps, plain_tps, dealt_tps))
    size = (directory / "train.bin").stat().st_size / 1e6
    print(f"throughput ({size:.0f} MB train.bin, batch {batch} x {seq + 1}, {batches} batches)")
    print("| reader | tokens/s |")
    print("|---|---|")
    print(f"| np.memmap slice loop (baseline, pages pre-mapped) | {p / 1e6:.1f}M |")
    print(f"| BatchStream over a FileShard (1 shard) | {o / 1e6:.1f}M |")
    print(f"| BatchStream over a dealt FileShard (shard 0 of 4) | {d / 1e6:.1f}M |")
    verdict = "pass" if o / p >= TARGET else "FAIL"
    print(f"| **ratio ours / memmap** | **{o / p:.2f}** (target >= {TARGET}: {verdict}) |")


def memory(directories: dict[int, Path], batch: int, seq: int, batches: int) -> None:
    print(f"memory per process ({batches} batches of {batch} x {seq + 1}, fresh process each)")
    print("| train.bin | ours: RSS growth | ours: peak RSS | np.memmap: RSS growth |")
    print("|---|---|---|---|")
    for megabytes, directory in directories.items():
        row = []
        for kind in ("ours", "memmap"):
            args = [str(directory), kind, str(batch), str(seq), str(batches)]
            done = subprocess.run(
                [sys.executable, "-c", CHILD, *args], capture_output=True, text=True, check=True
            )
            row.append(json.loads(done.stdout.strip().splitlines()[-1]))
        ours, mapped = row
        print(
            f"| {megabytes} MB | {ours['growth'] / 2**20:.1f} MiB | {ours['hwm'] / 2**20:.0f} MiB "
            f"| {mapped['growth'] / 2**20:.1f} MiB |"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="10,100,300", help="train.bin sizes in MB")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument(
        "--seq", default="256,1024", help="sequence lengths to time (the first for memory)"
    )
    ap.add_argument("--batches", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dir", help="where to write the token files (default: a temporary dir)")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",") if s]
    torch.set_num_threads(1)
    root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="bench-data-"))
    try:
        directories = {mb: make_directory(root, mb) for mb in sizes}
        middle = directories[sorted(sizes)[len(sizes) // 2]]
        seqs = [int(s) for s in args.seq.split(",") if s]
        for seq in seqs:
            throughput(middle, args.batch, seq, args.batches, args.repeats)
            print()
        memory(directories, args.batch, seqs[0], args.batches)
    finally:
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
