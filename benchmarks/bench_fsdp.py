"""A sharded (FSDP) learner against a DDP learner of the same ranks, side by side in one run.

Two ``ddiloco train --runtime processes`` runs of the same model, batch, ranks and tokens,
one with ``train.parallel = "ddp"`` (every rank holds the whole model and its AdamW state)
and one with ``"fsdp"`` (each rank holds 1/R): each rank's peak RSS (its ``VmHWM``, recorded
as in bench_memory.py), the learner's bytes to and from the syncer, its step time. Targets
(issue 31): peak memory per rank FSDP / DDP <= 0.6 at R = 2; bytes each rank sends 1/R of a
DDP learner's rank 0 (each rank sends its own parts of the answers on its own link), and
receives 1/R of what it receives (each rank its rows of each merged fragment).

    .venv/bin/python benchmarks/bench_fsdp.py                          # gpt-50m, R = 2
    .venv/bin/python benchmarks/bench_fsdp.py --model bench_memory:gpt_200m --tokens 8192
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

from bench_memory import processes_run

MIB = 1024  # KiB


def one_run(kind: str, args: argparse.Namespace, root: Path) -> dict[str, Any]:
    """One run of ``train.parallel = kind``: per-rank peaks (MiB), bytes, step seconds."""
    overrides = [
        f"model='{args.model}'",
        "methods=['decoupled']",
        "chaos=[]",
        f"train.learners={args.learners}",
        f"train.batch_size={args.batch_size}",
        f"train.tokens={args.tokens}",
        f"train.eval_every={10 * args.tokens}",
        "data.eval_batches=1",
        f"processes.ranks={args.ranks}",
        f"train.parallel='{kind}'",
        "sync.fragments=4",
        "sync.sync_every=4",
        *args.set,
    ]
    out = root / kind
    out.mkdir()
    measured = processes_run(overrides, out, timeline=False)
    ranks = {name: peak["VmHWM"] / MIB for name, peak in measured["peaks"].items()
             if name.startswith("learner")}  # fmt: skip
    records = [json.loads(line) for line in (out / "run" / "metrics.jsonl").open()]
    summary = json.loads((out / "run" / "summary.json").read_text())
    steps = [r for r in records if r.get("kind") == "step"]
    times = sorted(r["t"] for r in steps)
    gaps = [b - a for a, b in itertools.pairwise(times)]
    rank_sent = [b for sent in summary["learner_bytes_sent"].values() for b in sent]
    rank_received = [b for got in summary["learner_bytes_received"].values() for b in got]
    return {
        "ranks": ranks,
        "rank_sent": rank_sent,  # (a DDP learner: rank 0's only; its other ranks send none)
        "rank_received": rank_received,
        "sent": summary["bytes_sent"],
        "received": summary["bytes_received"],
        "steps": len(steps),
        "step_seconds": statistics.median(gaps) * args.learners if gaps else float("nan"),
        "seconds": measured["seconds"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt-50m")
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--learners", type=int, default=1)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--set", action="append", default=[], help="more config overrides")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-fsdp-") as tmp:
        runs = {kind: one_run(kind, args, Path(tmp)) for kind in ("ddp", "fsdp")}
    print(f"{args.model}, {args.learners} learner(s) x {args.ranks} ranks, batch "
          f"{args.batch_size} a rank, {args.tokens} tokens")  # fmt: skip
    print("| learner rank (peak RSS, MiB) | ddp | fsdp | fsdp / ddp |")
    print("|---|---|---|---|")
    ddp, fsdp = (sorted(runs[k]["ranks"].values()) for k in ("ddp", "fsdp"))
    for i, (a, b) in enumerate(zip(ddp, fsdp, strict=False)):
        print(f"| rank, {i + 1}. smallest peak | {a:.0f} | {b:.0f} | **{b / a:.3f}** |")
    print(f"| the largest | {max(ddp):.0f} | {max(fsdp):.0f} | **{max(fsdp) / max(ddp):.3f}** |")
    for what in ("sent", "received"):
        a, b = runs["ddp"][what], runs["fsdp"][what]
        print(f"| bytes the syncer {what} | {a:,} | {b:,} | {b / max(a, 1):.3f} |")
    a, b = runs["ddp"]["step_seconds"], runs["fsdp"]["step_seconds"]
    print(f"| step (median, s) | {a:.2f} | {b:.2f} | {b / a:.3f} |")
    for what, verb in (("rank_sent", "sent"), ("rank_received", "received")):
        top = max(runs["ddp"][what])
        for i, nbytes in enumerate(runs["fsdp"][what]):
            print(f"| bytes fsdp rank {i} {verb} / ddp rank 0's | {nbytes:,} | {top:,} | "
                  f"**{nbytes / max(top, 1):.3f}** |")  # fmt: skip


if __name__ == "__main__":
    main()
