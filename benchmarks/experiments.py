"""The paper's experiments at CPU scale, each one command, results as a markdown table.

    python benchmarks/experiments.py equal-tokens [--seeds 0 1] [--tokens 500000 1000000 2000000]
    python benchmarks/experiments.py heterogeneity [--seeds 0 1]
    python benchmarks/experiments.py codecs | fragmentation | rda | scavenging | failure-sweep

Every run is an ordinary ``ddiloco train`` run (its directory lands under --out), so any row
can be inspected, plotted or re-run. Runs are sequential: two torch processes on a 2-core
machine slow each other down many times over.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ddiloco.commands.train import train
from ddiloco.config import load_config

Run = tuple[str, list[str]]  # (label, --set overrides)
CRASHES = (
    "chaos=[{at=60.0, kind='crash', learner=1, duration=40.0},"
    " {at=180.0, kind='crash', learner=2, duration=40.0}]"
)


def equal_tokens(tokens: int) -> list[Run]:
    """Exp. 1: Decoupled under failures vs failure-free Streaming DiLoCo and data-parallel."""
    base = [f"train.tokens={tokens}", f"train.eval_every={tokens // 5}"]
    return [
        ("decoupled, crashes", [*base, "methods=['decoupled']", CRASHES]),
        ("streaming, no failures", [*base, "methods=['streaming']", "chaos=[]"]),
        ("data-parallel, no failures", [*base, "methods=['data_parallel']", "chaos=[]"]),
    ]


def heterogeneity(tokens: int) -> list[Run]:
    """Exp. 3: 8 learners, half 18% slower, +10% jitter: K = 8, K = 1, K = 1 + grace."""
    base = [
        f"train.tokens={tokens}", f"train.eval_every={tokens // 5}", "train.learners=8",
        "train.batch_size=4", "hardware.speed=[1, 1, 1, 1, 1.18, 1.18, 1.18, 1.18]",
        "hardware.jitter=0.1", "chaos=[]", "methods=['decoupled']",
    ]  # fmt: skip
    return [
        ("K=8 lock-step", [*base, "methods=['decoupled_sync']"]),
        ("K=8, never waiting", [*base, "sync.quorum=8", "sync.grace=false"]),
        ("K=1, no grace", [*base, "sync.quorum=1", "sync.grace=false"]),
        ("K=1 + adaptive grace", [*base, "sync.quorum=1", "sync.grace=true"]),
    ]


def codecs(tokens: int) -> list[Run]:
    """Exp. 5: wire formats of the outer gradients."""
    base = [f"train.tokens={tokens}", f"train.eval_every={tokens // 5}", "chaos=[]",
            "methods=['decoupled']"]  # fmt: skip
    return [(c, [*base, f"sync.codec={c}"]) for c in ("bf16", "int8", "int4", "int2", "int1")]


def fragmentation(tokens: int) -> list[Run]:
    """Exp. 6: balanced, layer-wise and tensor-wise plans (P = 6: gpt-1m has 7 layer groups)."""
    base = [f"train.tokens={tokens}", f"train.eval_every={tokens // 5}", "chaos=[]",
            "methods=['decoupled']", "sync.fragments=6", "sync.sync_every=12"]  # fmt: skip
    return [
        ("balanced", [*base, "sync.strategy=balanced"]),
        ("layer", [*base, "sync.strategy=layer", "sync.split_rows=false"]),
        ("tensor", [*base, "sync.strategy=tensor", "sync.split_rows=false"]),
    ]


def rda(tokens: int) -> list[Run]:
    """Exp. 4: RDA against the plain weighted mean at M = 8, each over outer learning rates."""
    base = [f"train.tokens={tokens}", f"train.eval_every={tokens // 5}", "chaos=[]",
            "methods=['decoupled']", "train.learners=8", "train.batch_size=4"]  # fmt: skip
    runs = []
    for rule, rates in (("rda", (0.3, 0.5, 0.7)), ("mean", (0.5, 0.7, 1.0))):
        for lr in rates:
            runs.append((f"{rule}, outer lr {lr}", [*base, f"sync.merge_rule={rule}",
                                                    f"sync.outer_lr={lr}"]))  # fmt: skip
    return runs


def scavenging(tokens: int) -> list[Run]:
    """Exp. 7: temporary learners joining mid-run (virtual time to the same tokens)."""
    base = [f"train.tokens={tokens}", f"train.eval_every={tokens // 5}", "chaos=[]",
            "methods=['decoupled']"]  # fmt: skip
    return [
        ("4 learners", base),
        (
            "4 + 2 scavenged from t=60",
            [*base, "train.scavenged=2", "chaos_gen.scavenge_join_at=60"],
        ),
        (
            "4 + 4 scavenged from t=60",
            [*base, "train.scavenged=4", "chaos_gen.scavenge_join_at=60"],
        ),
    ]


# Exp. 2's failure model, calibrated once (docs/results.md): each of the M = 4 learners stands
# for a quarter of an N-chip cluster with a per-chip MTBI of one year, and one virtual second
# stands for SWEEP_TIME_SCALE cluster seconds, so at 1.2M chips the system fails every ~75
# virtual seconds. Data-parallel's restart and reconfiguration times are then set so that it
# lands near the paper's goodput at 1.2M chips (27% not elastic, 58% elastic); a Decoupled
# learner's crash costs its recovery (median SWEEP_RECOVERY s), a peer copy and its unpushed work.
SWEEP_CHIPS = (0, 150_000, 300_000, 600_000, 1_200_000)
SWEEP_TIME_SCALE = 0.35
SWEEP_RECOVERY = 4.0
SWEEP_DP = ("dp.restart_seconds=35", "dp.reconfigure_seconds=15", "dp.checkpoint_every=10")


def failure_sweep(tokens: int) -> list[Run]:
    """Exp. 2: equal virtual time, failure rate from none to the paper's 1.2M-chip regime.

    Every method stops at ``tokens`` or at the virtual time failure-free Decoupled needs for
    them (1 s steps, 4 learners of 1024 tokens, +5%), whichever comes first: failures then
    show as fewer tokens trained in the same time.
    """
    seconds = tokens / (4 * 1024) * 1.05
    runs = []
    for chips in SWEEP_CHIPS:
        gen = [] if chips == 0 else [
            "chaos_gen.mtbi_hours=8766", f"chaos_gen.chips_per_learner={chips // 4}",
            f"chaos_gen.recovery_seconds={SWEEP_RECOVERY}",
            f"chaos_gen.time_scale={SWEEP_TIME_SCALE}", f"chaos_gen.horizon_seconds={seconds:.0f}",
        ]  # fmt: skip
        label = "no failures" if chips == 0 else f"{chips // 1000}K chips"
        runs.append((label, [f"train.tokens={tokens}", f"train.eval_every={tokens // 5}",
                             f"train.max_virtual_seconds={seconds:.0f}", "chaos=[]",
                             "methods=['decoupled','elastic_dp','data_parallel']",
                             *SWEEP_DP, *gen]))  # fmt: skip
    return runs


EXPERIMENTS: dict[str, Callable[[int], list[Run]]] = {
    "equal-tokens": equal_tokens,
    "failure-sweep": failure_sweep,
    "heterogeneity": heterogeneity,
    "rda": rda,
    "codecs": codecs,
    "fragmentation": fragmentation,
    "scavenging": scavenging,
}


def run_all(name: str, tokens: Sequence[int], seeds: Sequence[int], out: Path) -> str:
    rows: dict[tuple[int, str, str], list[dict[str, Any]]] = {}
    for n in tokens:
        for label, overrides in EXPERIMENTS[name](n):
            for seed in seeds:
                config = load_config(None, [*overrides, f"seed={seed}"])
                directory = out / name / f"{n}-{label.replace(' ', '_').replace(',', '')}-s{seed}"
                started = time.monotonic()
                for s in train(config, directory, quiet=True):
                    rows.setdefault((n, label, s["method"]), []).append(s)
                print(f"  {n:>9,} tokens  {label:<28} seed {seed}  "
                      f"{time.monotonic() - started:6.0f} s", flush=True)  # fmt: skip
    lines = ["| tokens | run | method | eval loss (mean ± spread) | goodput | virtual s | "
             "peak B/step |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    for (n, label, method), summaries in rows.items():
        losses = [s["eval_loss"] for s in summaries]
        spread = (max(losses) - min(losses)) / 2 if len(losses) > 1 else 0.0
        peak = summaries[0].get("plan", {}).get("peak_bytes_per_step", "")
        lines.append(
            f"| {n:,} | {label} | {method} | {statistics.mean(losses):.4f} ± {spread:.4f} | "
            f"{statistics.mean(s['goodput'] for s in summaries):.1%} | "
            f"{statistics.mean(s['virtual_seconds'] for s in summaries):.0f} | {peak} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("experiment", choices=sorted(EXPERIMENTS))
    ap.add_argument("--tokens", type=int, nargs="+", default=[1_000_000])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--out", default="runs/experiments")
    args = ap.parse_args()
    print(f"experiment {args.experiment}: tokens {args.tokens}, seeds {args.seeds}")
    print(run_all(args.experiment, args.tokens, args.seeds, Path(args.out)))


if __name__ == "__main__":
    main()
