"""Checkpoints of the global model: the writer's cost, and what the syncer pays meanwhile.

1. Write time of a gpt-50m global checkpoint through ``checkpoints.write.write_checkpoint``
   (safetensors weights hashed with BLAKE3 as they are written, config.json, run.toml,
   ddiloco.json, fsync of every file and the directory, atomic rename) against a plain
   ``safetensors.torch.save_file`` of the same tensors, which neither hashes nor fsyncs.
   Also the same writer with fsync/fdatasync made no-ops (its own cost, durability aside)
   and save_file followed by an fsync (the durable plain write). Interleaved repeats,
   medians; target: plain / ours-without-fsync >= 0.8. The checkpoint is given its eval
   loss (the evaluation is not the writer's cost).
2. The syncer's side: it copies the fragments into the writer's model between two merges
   (``CheckpointWriter.staged``: the only part on its loop), then a thread writes. Measured:
   the copy; how long the main thread waits for the GIL while a checkpoint is written on a
   thread (it wakes from 1 ms sleeps: its longest wait, against the same with no writer);
   and merges/s of an RDA + Nesterov merge of one fragment (gpt-50m / 24, M learners, one
   torch thread: the syncer's setting) while checkpoints are written back to back on a
   thread, against merges/s with no writer (a CPU share, on a small machine, not the GIL).

    python benchmarks/bench_checkpoint.py [--model gpt-50m] [--repeats 5] [--seconds 6]
        [--learners 4] [--dir DIR]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import threading
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from ddiloco.checkpoints.write import CheckpointWriter, fsync, write_checkpoint
from ddiloco.config import load_config
from ddiloco.core.fragments import gather
from ddiloco.core.merge import merge, tensor_norms, token_weight
from ddiloco.core.outer import NesterovSGD
from ddiloco.data.tokenizer import ByteTokenizer
from ddiloco.runtime.run import RunSetup

TARGET = 0.8


def ours(setup: RunSetup, path: Path) -> None:
    write_checkpoint(
        path,
        setup.model,
        setup.config,
        ByteTokenizer(),
        method="decoupled",
        step=0,
        tokens=0,
        eval_loss=1.0,
    )


def write_times(setup: RunSetup, root: Path, repeats: int) -> dict[str, float]:
    """Median seconds of each way of writing the model (module docstring)."""
    tensors = {k: v.detach().contiguous() for k, v in setup.model.state_dict().items()}
    real = os.fsync, os.fdatasync

    def no_sync(path: Path) -> None:
        os.fsync = os.fdatasync = lambda fd: None
        try:
            ours(setup, path)
        finally:
            os.fsync, os.fdatasync = real

    def durable(path: Path) -> None:
        save_file(tensors, str(path))
        fsync(path)

    ways = {
        "ours": lambda path: ours(setup, path),
        "ours, no fsync": no_sync,
        "save_file": lambda path: save_file(tensors, str(path)),
        "save_file + fsync": durable,
    }
    times: dict[str, list[float]] = {name: [] for name in ways}
    for i in range(repeats + 1):  # the first round warms the page cache and allocators
        for name, way in ways.items():
            path = root / "out"
            start = time.perf_counter()
            way(path)
            if i:
                times[name].append(time.perf_counter() - start)
            shutil.rmtree(path) if path.is_dir() else path.unlink()
    return {name: statistics.median(t) for name, t in times.items()}


class Writer(threading.Thread):
    """Writes checkpoints back to back until told to stop."""

    def __init__(self, setup: RunSetup, root: Path) -> None:
        super().__init__(daemon=True)
        self.setup, self.root = setup, root
        self.stop = threading.Event()
        self.written = 0

    def run(self) -> None:
        while not self.stop.is_set():
            path = write_checkpoint(
                self.root / "bg",
                self.setup.model,
                self.setup.config,
                ByteTokenizer(),
                method="decoupled",
                step=0,
                tokens=0,
                eval_loss=1.0,
            )
            shutil.rmtree(path)
            self.written += 1


def merges_per_second(fragment: list[torch.Tensor], learners: int, seconds: float) -> float:
    deltas = [[torch.randn_like(t) * 1e-3 for t in fragment] for _ in range(learners)]
    weights = [token_weight(4096 * (m + 8), m + 8) for m in range(learners)]
    theta = [t.clone() for t in fragment]
    workspace = [torch.zeros_like(t) for t in fragment]
    opt = NesterovSGD(lr=0.5, momentum=0.9)
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        norms = [tensor_norms(d) for d in deltas]  # what arrival does, once per answer
        opt.step(theta, merge(deltas, weights, "rda", norms=norms, out=workspace, scale=-1.0))
        count += 1
    return count / (time.perf_counter() - start)


def longest_wait(seconds: float) -> float:
    """The main thread's longest wake-up from a 1 ms sleep (it needs the GIL to wake)."""
    start = last = time.perf_counter()
    longest = 0.0
    while last - start < seconds:
        time.sleep(0.001)
        now = time.perf_counter()
        longest = max(longest, now - last - 0.001)
        last = now
    return longest


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt-50m")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--seconds", type=float, default=6.0, help="per merge-rate measurement")
    ap.add_argument("--learners", type=int, default=4)
    ap.add_argument("--fragments", type=int, default=24)
    ap.add_argument("--dir", help="where to write (default: a temp directory)")
    args = ap.parse_args()
    torch.set_num_threads(1)  # the syncer's setting (ddiloco syncer --threads 1)
    config = load_config(None, [f"model='{args.model}'", f"sync.fragments={args.fragments}"])
    setup = RunSetup(config, "decoupled")
    root = Path(tempfile.mkdtemp(prefix="bench-ckpt-", dir=args.dir))
    nbytes = sum(t.numel() * t.element_size() for t in setup.model.state_dict().values())
    try:
        times = write_times(setup, root, args.repeats)
        writer = CheckpointWriter(setup, root)
        params = dict(setup.model.named_parameters())
        fragments = [
            [t.clone() for t in gather(setup.plan, p, params)] for p in range(args.fragments)
        ]
        stage = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            writer.staged(fragments)
            stage.append(time.perf_counter() - start)
        fragment = max(fragments, key=lambda f: sum(t.numel() for t in f))
        alone = merges_per_second(fragment, args.learners, args.seconds)
        wait_alone = longest_wait(args.seconds / 2)
        bg = Writer(setup, root)
        bg.start()
        time.sleep(0.5)
        busy = merges_per_second(fragment, args.learners, args.seconds)
        wait_busy = longest_wait(args.seconds / 2)
        bg.stop.set()
        bg.join()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    mib = nbytes / 2**20
    frag_mib = sum(t.numel() * 4 for t in fragment) / 2**20
    print(
        f"checkpoint benchmark: {args.model} ({mib:.0f} MiB of weights), "
        f"{os.cpu_count()} CPUs, torch threads {torch.get_num_threads()}, dir {args.dir or '/tmp'}"
    )
    for name, t in times.items():
        print(f"  {name:<30} : {t * 1e3:8.1f} ms  {mib / t:7.0f} MiB/s")
    ratio = times["save_file"] / times["ours, no fsync"]
    verdict = "PASS" if ratio >= TARGET else "BELOW TARGET"
    print(f"  ratio save_file / ours no fsync : {ratio:7.2f}  (target >= {TARGET}: {verdict})")
    print(f"  ratio save_file+fsync / ours    : {times['save_file + fsync'] / times['ours']:7.2f}")
    print(f"  ratio save_file / ours          : {times['save_file'] / times['ours']:7.2f}")
    print(
        f"  syncer loop: copy of fragments : {statistics.median(stage) * 1e3:8.1f} ms a checkpoint"
    )
    print(
        f"  merges/s, one {frag_mib:.1f} MiB fragment, M={args.learners}: "
        f"{alone:.1f} alone, {busy:.1f} while writing ({busy / alone:.2f}x; "
        f"{bg.written} checkpoints written meanwhile)"
    )
    print(
        f"  main thread's longest wait for the GIL: {wait_busy * 1e3:.1f} ms while writing "
        f"(alone {wait_alone * 1e3:.1f} ms)"
    )


if __name__ == "__main__":
    main()
