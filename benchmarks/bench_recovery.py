"""Recovery time after a SIGKILL: from the kill to the killed learner's first merged answer.

Runs the same Decoupled DiLoCo job (gpt-1m at context 64, batch 8, 3 learners, P = H = 12) on
each runtime given, kills learner 0 at ``--kill-at`` wall seconds (restart after
``--down``), and prints per runtime: the kill, when the learner was back (its ``recovered``
event: the peer copy done), when a round first merged an answer of its new life, and those
times from the kill, side by side. What a restart costs is in the difference: the restart
delay, a fresh interpreter importing torch (on Ray the restarted actor imports it while the
launcher waits out ``--down``), the data, the peer copy.

    .venv/bin/python benchmarks/bench_recovery.py [--runtimes processes ray] [--set KEY=VALUE]

Runs are sequential (on 2 cores, two jobs slow each other down).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from ddiloco import train
from ddiloco.config import load_config

CONFIG = [
    "model='gpt-1m'",
    "methods=['decoupled']",
    "train.learners=3",
    "train.batch_size=8",
    "train.seq_len=64",
    "train.tokens=600000",
    "train.eval_every=300000",
    "sync.fragments=12",
    "sync.sync_every=12",
    "data.eval_batches=2",
    "processes.detect_seconds=3.0",
]


def timeline(run: Path, learner: int = 0) -> dict[str, float]:
    """Kill, back (recovered) and first merged answer after the kill, in wall seconds."""
    records: list[dict[str, Any]] = [
        json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()
    ]
    kill = next(r["t"] for r in records if r["kind"] == "chaos" and r["event"] == "crash")
    back = next(
        r["t"]
        for r in records
        if r["kind"] == "recovered" and r["learner"] == learner and r["t"] > kill
    )
    merged = next(
        r["t"]
        for r in records
        if r["kind"] == "round" and r["t"] > back and str(learner) in r["weights"]
    )
    return {"kill": kill, "back": back, "merged": merged}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runtimes", nargs="+", default=["processes", "ray"])
    ap.add_argument("--kill-at", type=float, default=25.0)
    ap.add_argument("--down", type=float, default=1.0)
    ap.add_argument("--set", action="append", default=[], help="more overrides, as ddiloco's")
    ap.add_argument("--out", default="runs/bench-recovery")
    args = ap.parse_args()
    rows = []
    for runtime in args.runtimes:
        crash = f"{{at={args.kill_at},kind='crash',learner=0,duration={args.down}}}"
        overrides = [*CONFIG, f"runtime='{runtime}'", f"chaos=[{crash}]", *args.set]
        run = Path(args.out) / f"{runtime}-{time.strftime('%H%M%S')}"
        (summary,) = train(load_config(None, overrides), run, quiet=True)
        t = timeline(run)
        rows.append((runtime, t, summary))
        print(
            f"  {runtime:<10} back {t['back'] - t['kill']:.1f} s after the kill, first merged "
            f"answer {t['merged'] - t['kill']:.1f} s  ({run})",
            flush=True,
        )
    print(f"\n(kill at {args.kill_at} s, restart after {args.down} s)")
    print("| runtime | back (peer copy done) | first merged answer | token efficiency |")
    print("|---|---|---|---|")
    for runtime, t, s in rows:
        back, merged = t["back"] - t["kill"], t["merged"] - t["kill"]
        print(f"| {runtime} | {back:.1f} s | {merged:.1f} s | {s['token_efficiency']:.3f} |")


if __name__ == "__main__":
    main()
