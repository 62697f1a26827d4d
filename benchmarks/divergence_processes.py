"""Outer-momentum divergence on real processes: the run-directory test's config, N seeds.

Runs ``tests/integration/bases.py``'s SMALL config (gpt-tiny, 2 learner processes, P = 4,
H = 8) for 12K tokens with the shipped outer momentum, once per seed, and prints each run's
evaluations and merged rounds. Wall-clock runs do not replay: a seed names a data order and
an init, not a timing. docs/results.md §9 has what it printed.

    .venv/bin/python benchmarks/divergence_processes.py [--seeds 0 1 ...] [--set KEY=VALUE]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "integration"))

from bases import SMALL

from ddiloco import train
from ddiloco.config import load_config


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=list(range(8)))
    ap.add_argument("--tokens", type=int, default=12000)
    ap.add_argument("--set", action="append", default=[], help="more overrides, as ddiloco's")
    ap.add_argument("--out", default="runs/divergence")
    args = ap.parse_args()
    finals = []
    for seed in args.seeds:
        overrides = [*SMALL, f"train.tokens={args.tokens}", f"seed={seed}", *args.set]
        out = Path(args.out) / f"seed-{seed}"
        (summary,) = train(load_config(None, overrides), out, quiet=True)
        lines = (out / "metrics.jsonl").read_text().splitlines()
        evals = [r["loss"] for r in map(json.loads, lines) if r["kind"] == "eval"]
        finals.append(evals[-1])
        print(f"seed {seed}: eval {[round(e, 3) for e in evals]}  rounds {summary['rounds']}")
    print(f"final eval loss: mean {sum(finals) / len(finals):.3f}, worst {max(finals):.3f}")


if __name__ == "__main__":
    main()
