"""Token efficiency of the apply rules on real processes, side by side in one run.

With the paper's overwrite rule a learner loses the steps it made on a fragment between its
answer and the merged fragment's arrival; on real processes that round trip is longer than
tau steps. This runs the same Decoupled DiLoCo job (4 learner processes and a syncer on
loopback, gpt-1m at context 64, batch 8, P = H = 24, tau = 2) once per ``sync.apply`` rule
and prints, per rule: token efficiency (tokens merged / trained), the overwritten share,
eval loss at equal tokens and at equal time (at the wall second the fastest rule's final
evaluation came, since its launch, linear between two evaluations), wall seconds, and each
rule's efficiency over overwrite's.

    .venv/bin/python benchmarks/bench_apply_processes.py [--tokens 786432] [--rules ...]

Runs are sequential (on 2 cores, two jobs slow each other down). Each run's directory lands
under --out for inspection.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from ddiloco import train
from ddiloco.config import load_config
from ddiloco.report.run_writer import eval_curves
from ddiloco.report.summary import loss_at

CONFIG = [
    "model='gpt-1m'",
    "methods=['decoupled']",
    "runtime='processes'",
    "train.learners=4",
    "train.batch_size=8",
    "train.seq_len=64",
    "sync.fragments=24",
    "sync.sync_every=24",
    "sync.rounds.overlap=2",
    "data.eval_batches=4",
    "chaos=[]",
    "processes.max_wall_seconds=1800",
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=786_432)
    ap.add_argument("--rules", nargs="+", default=["overwrite", "blend", "carry"])
    ap.add_argument("--set", action="append", default=[], help="more overrides, as ddiloco's")
    ap.add_argument("--out", default="runs/bench-apply")
    args = ap.parse_args()
    rows = []
    for rule in args.rules:
        overrides = [
            *CONFIG,
            f"train.tokens={args.tokens}",
            f"train.eval_every={args.tokens // 4}",
            f"sync.apply='{rule}'",
            *args.set,
        ]
        directory = Path(args.out) / f"{rule}-{time.strftime('%H%M%S')}"
        started = time.monotonic()
        (s,) = train(load_config(None, overrides), directory, quiet=True)
        seconds = time.monotonic() - started
        overwritten = s["tokens_wasted"].get("overwritten", 0.0) / max(s["tokens"], 1)
        (curve,) = eval_curves(directory / "metrics.jsonl").values()
        rows.append((rule, s, overwritten, seconds, curve))
        print(
            f"  {rule:<9} efficiency {s['token_efficiency']:.3f}  overwritten {overwritten:.1%}"
            f"  eval loss {s['eval_loss']:.4f}  {seconds:.0f} s  ({directory})",
            flush=True,
        )
    base = next((s["token_efficiency"] for r, s, *_ in rows if r == "overwrite"), None)
    horizon = min(curve[-1][0] for *_, curve in rows)
    print(f"\n(equal time: {horizon:.1f} s after each launch)")
    print(
        "| rule | token efficiency | vs overwrite | overwritten | eval loss | "
        "eval loss at equal time | wall s |"
    )
    print("|---|---|---|---|---|---|---|")
    for rule, s, overwritten, seconds, curve in rows:
        ratio = f"{s['token_efficiency'] / base:.3f}" if base else "-"
        at = loss_at(curve, horizon)
        print(
            f"| {rule} | {s['token_efficiency']:.3f} | {ratio} | {overwritten:.1%} | "
            f"{s['eval_loss']:.4f} | {'-' if at is None else f'{at:.4f}'} | {seconds:.0f} |"
        )
    print(json.dumps({r: s["tokens_wasted"] for r, s, *_ in rows}))


if __name__ == "__main__":
    main()
