"""Merge throughput: token weights + RDA + Nesterov against plain memory streaming.

M learners' outer gradients for one fragment (default 8 x 100 MB) are merged the way
``SyncerState`` does it: each answer's per-tensor norms are taken when it arrives (while it is
hot in cache, off the critical path), and when the round closes: token weights, radial-
directional averaging into a reused workspace, Nesterov outer step in fp32. The baseline
streams the same bytes: ``acc.add_(v_m)`` over the same tensors. All run in this process,
interleaved, and ratios of medians are printed: the round-close merge (what delays the
broadcast) and, for honesty, the merge plus the arrival-time norm passes.

    python benchmarks/bench_merge.py [--learners 8] [--megabytes 100] [--tensor-mb 4] [--repeats 5]

Target: ratio >= 0.5 (the merge moves at least half as fast as a bare sum of the inputs).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from ddiloco.core.merge import merge, tensor_norms, token_weight
from ddiloco.core.outer import NesterovSGD

TARGET = 0.5


def _fragment(megabytes: float, tensor_mb: float, seed: int) -> list[torch.Tensor]:
    """A fragment of equal fp32 tensors of ``tensor_mb`` MB adding up to ``megabytes`` MB."""
    g = torch.Generator().manual_seed(seed)
    per = int(tensor_mb * 2**20 / 4)
    count = max(1, round(megabytes / tensor_mb))
    return [torch.randn(per, generator=g) for _ in range(count)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--learners", type=int, default=8)
    ap.add_argument("--megabytes", type=float, default=100.0)
    ap.add_argument("--tensor-mb", type=float, default=4.0, help="size of each tensor")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    deltas = [_fragment(args.megabytes, args.tensor_mb, seed=m) for m in range(args.learners)]
    weights = [token_weight(4096 * (m + 8), m + 8) for m in range(args.learners)]
    theta = [torch.zeros_like(t) for t in deltas[0]]
    acc = [torch.zeros_like(t) for t in deltas[0]]
    workspace = [torch.zeros_like(t) for t in deltas[0]]
    opt = NesterovSGD(lr=0.5, momentum=0.9)
    nbytes = sum(t.numel() * 4 for t in deltas[0]) * args.learners

    def stream() -> None:
        for i, a in enumerate(acc):
            a.copy_(deltas[0][i])
            for d in deltas[1:]:
                a.add_(d[i])

    norms: list[list[float]] = []

    def arrival_norms() -> None:
        norms[:] = [tensor_norms(d) for d in deltas]

    def merge_step() -> None:
        merged = merge(deltas, weights, "rda", norms=norms, out=workspace, scale=-1.0)
        opt.step(theta, merged)

    stream()
    arrival_norms()
    merge_step()  # warm up, allocate momentum
    t_stream, t_norms, t_merge = [], [], []
    for _ in range(args.repeats):
        start = time.perf_counter()
        stream()
        t_stream.append(time.perf_counter() - start)
        start = time.perf_counter()
        arrival_norms()
        t_norms.append(time.perf_counter() - start)
        start = time.perf_counter()
        merge_step()
        t_merge.append(time.perf_counter() - start)
    s, n, m = (statistics.median(x) for x in (t_stream, t_norms, t_merge))
    ratio = s / m
    print(
        f"merge benchmark: M={args.learners}, fragment {nbytes / args.learners / 2**20:.0f} MiB "
        f"({len(deltas[0])} tensors of {args.tensor_mb} MiB), threads={torch.get_num_threads()}"
    )
    print(f"  plain streaming (acc += v_m) : {s * 1e3:8.1f} ms  {nbytes / s / 2**30:6.2f} GiB/s")
    print(f"  norms on arrival (all M)     : {n * 1e3:8.1f} ms  (off the critical path)")
    print(f"  round close: RDA + Nesterov  : {m * 1e3:8.1f} ms  {nbytes / m / 2**30:6.2f} GiB/s")
    verdict = "PASS" if ratio >= TARGET else "BELOW TARGET"
    print(f"  ratio streaming/round-close  : {ratio:8.2f}  (target >= {TARGET}: {verdict})")
    print(f"  ratio streaming/(norms+close): {s / (n + m):8.2f}  (all work, for reference)")


if __name__ == "__main__":
    main()
