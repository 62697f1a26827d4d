"""Time the cluster goodput simulator on the paper's whole table.

30 cells (DP, elastic DP, Decoupled M = 2/4/8/16 at 150K..2.4M chips) x 3 seeds x 30
simulated days with the default (paper) parameter set: about 380,000 failures per seed, each
trace run through all six systems. Runs in this one process (one core); prints the seconds,
the largest deviation from the paper per row, and PASS/FAIL against the target.

    python benchmarks/bench_simulate.py [--realistic] [--repeats 1]

Target: < 60 s on 2 cores (the simulator uses one).
"""

from __future__ import annotations

import argparse
import time

from ddiloco.cluster.params import load_params
from ddiloco.cluster.table import run_table, tolerance, worst_deviation

TARGET_S = 60.0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--realistic", action="store_true", help="the realistic preset")
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    params = load_params(preset="realistic" if args.realistic else None)
    run = params.run
    print(
        f"table: {len(run.chips)} sizes x {2 + len(params.decoupled.learners)} systems, "
        f"{run.seeds} seeds x {run.days:g} days"
    )
    times = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        result = run_table(params)
        times.append(time.perf_counter() - t0)
    best = min(times)
    for system, dev in worst_deviation(result).items():
        print(
            f"  {system:14s} largest |ours - paper| {dev:5.2f} points (tolerance "
            f"{tolerance(system):g})"
        )
    verdict = "PASS" if best < TARGET_S else "FAIL"
    print(
        f"seconds: {best:.1f} (runs: {', '.join(f'{t:.1f}' for t in times)}); "
        f"target < {TARGET_S:g} s: {verdict}"
    )
    return 0 if verdict == "PASS" else 1


if __name__ == "__main__":
    raise SystemExit(main())
