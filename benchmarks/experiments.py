"""The paper's experiments at CPU scale, each one command, results as a markdown table.

    python benchmarks/experiments.py equal-tokens [--seeds 0 1] [--tokens 500000 1000000 2000000]
    python benchmarks/experiments.py heterogeneity [--seeds 0 1]
    python benchmarks/experiments.py codecs | fragmentation | rda | scavenging | failure-sweep
    python benchmarks/experiments.py apply [--seeds 0 1] [--tokens 500000]
    python benchmarks/experiments.py scaling [--seeds 0 1] [--tokens 250000 500000 1000000]
        [--models gpt-1m gpt-4m gpt-12m]
    python benchmarks/experiments.py ladder | lr-sweep | outer | merge-rule | staleness | learners |
        compression [--tokens 20] [--seeds 0 1]    (benchmarks/quality.py: tokens per parameter)
        [--knob-model gpt-1m]   (a knob experiment at another model: under <out>/<name>@<model>)
        [--rows 'rda, outer lr 0.7']   (only the rows of these labels)

Every run is an ordinary ``ddiloco train`` run (its directory lands under --out), so any row
can be inspected, plotted or re-run. Runs are sequential: two torch processes on a 2-core
machine slow each other down many times over, unless each has one thread and a core of its
own: ``--methods`` runs only the methods named, each in a directory of its own
(``<run>.<method>``), so that two invocations with ``OMP_NUM_THREADS=1`` (one method each)
share a 2-core machine; ``--reuse`` then tabulates the methods found in either place.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import re
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import quality
from ddiloco import train
from ddiloco.config import load_config
from ddiloco.report.summary import add_equal_time
from quality import LADDER_MODELS, QUALITY, method_curve, method_dir, plot_ladder

Run = tuple[str, list[str]]  # (label, --set overrides)
CRASHES = (
    "chaos=[{at=60.0, kind='crash', learner=1, duration=40.0},"
    " {at=180.0, kind='crash', learner=2, duration=40.0}]"
)


# M = 8 at the default global batch (4 learners x 8 sequences): the same tokens per step
EIGHT_LEARNERS = ("train.learners=8", "train.batch_size=4")


def budget(tokens: int, evals: int = 5) -> list[str]:
    """The run length every experiment sets: ``tokens``, evaluated ``evals`` times on the way."""
    return [f"train.tokens={tokens}", f"train.eval_every={tokens // evals}"]


def decoupled_alone(tokens: int, evals: int = 5) -> list[str]:
    """Decoupled alone, without scripted chaos: what the experiments on its knobs vary."""
    return [*budget(tokens, evals), "chaos=[]", "methods=['decoupled']"]


def equal_tokens(tokens: int) -> list[Run]:
    """Exp. 1: Decoupled under failures vs failure-free Streaming DiLoCo and data-parallel."""
    base = budget(tokens)
    return [
        ("decoupled, crashes", [*base, "methods=['decoupled']", CRASHES]),
        ("streaming, no failures", [*base, "methods=['streaming']", "chaos=[]"]),
        ("data-parallel, no failures", [*base, "methods=['data_parallel']", "chaos=[]"]),
    ]


def heterogeneity(tokens: int) -> list[Run]:
    """Exp. 3: 8 learners, half 18% slower, +10% jitter: K = 8, K = 1, K = 1 + grace."""
    base = [
        *decoupled_alone(tokens),
        *EIGHT_LEARNERS,
        "hardware.speed=[1, 1, 1, 1, 1.18, 1.18, 1.18, 1.18]",
        "hardware.jitter=0.1",
    ]
    return [
        ("K=8 lock-step", [*base, "methods=['decoupled_sync']"]),
        ("K=8, never waiting", [*base, "sync.rounds.quorum=8", "sync.rounds.grace=false"]),
        ("K=1, no grace", [*base, "sync.rounds.quorum=1", "sync.rounds.grace=false"]),
        ("K=1 + adaptive grace", [*base, "sync.rounds.quorum=1", "sync.rounds.grace=true"]),
    ]


def codecs(tokens: int) -> list[Run]:
    """Exp. 5: wire formats of the outer gradients."""
    base = decoupled_alone(tokens)
    return [
        (c, [*base, f"sync.codec.answers={c}"]) for c in ("bf16", "int8", "int4", "int2", "int1")
    ]


def fragmentation(tokens: int) -> list[Run]:
    """Exp. 6: balanced, layer-wise and tensor-wise plans (P = 6: gpt-1m has 7 layer groups)."""
    base = [
        *decoupled_alone(tokens),
        "sync.fragments=6",
        "sync.sync_every=12",
    ]
    return [
        ("balanced", [*base, "sync.partition=balanced"]),
        ("layer", [*base, "sync.partition=layer", "sync.split_rows=false"]),
        ("tensor", [*base, "sync.partition=tensor", "sync.split_rows=false"]),
    ]


def rda(tokens: int) -> list[Run]:
    """Exp. 4: RDA against the plain weighted mean at M = 8, each over outer learning rates."""
    base = [*decoupled_alone(tokens), *EIGHT_LEARNERS]
    runs = []
    for rule, rates in (("rda", (0.3, 0.5, 0.7)), ("mean", (0.5, 0.7, 1.0))):
        for lr in rates:
            runs.append(
                (
                    f"{rule}, outer lr {lr}",
                    [*base, f"sync.merge_rule={rule}", f"sync.outer.lr={lr}"],
                )
            )
    return runs


def scavenging(tokens: int) -> list[Run]:
    """Exp. 7: temporary learners that join at t = 30 and leave at t = 90 (+25/50/100% compute
    for a while): virtual time to a loss every run reaches."""
    base = [
        *decoupled_alone(tokens, evals=20),
        "chaos_gen.scavenge_join_at=30",
        "chaos_gen.scavenge_stay=60",
    ]
    return [("4 learners", base)] + [
        (f"4 + {n} scavenged, t=30..90", [*base, f"train.scavenged={n}"]) for n in (1, 2, 4)
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
SWEEP_DP = (
    "data_parallel.restart_seconds=35",
    "data_parallel.reconfigure_seconds=15",
    "data_parallel.checkpoint_every=10",
)


def failure_sweep(tokens: int) -> list[Run]:
    """Exp. 2: equal virtual time, failure rate from none to the paper's 1.2M-chip regime.

    Every method stops at ``tokens`` or at the virtual time failure-free Decoupled needs for
    them (1 s steps, 4 learners of 1024 tokens, +5%), whichever comes first: failures then
    show as fewer tokens trained in the same time.
    """
    seconds = tokens / (4 * 1024) * 1.05
    runs = []
    for chips in SWEEP_CHIPS:
        gen = (
            []
            if chips == 0
            else [
                "chaos_gen.mtbi_hours=8766",
                f"chaos_gen.chips_per_learner={chips // 4}",
                f"chaos_gen.recovery_seconds={SWEEP_RECOVERY}",
                f"chaos_gen.time_scale={SWEEP_TIME_SCALE}",
                f"chaos_gen.horizon_seconds={seconds:.0f}",
            ]
        )
        label = "no failures" if chips == 0 else f"{chips // 1000}K chips"
        runs.append(
            (
                label,
                [
                    *budget(tokens),
                    f"train.max_virtual_seconds={seconds:.0f}",
                    "chaos=[]",
                    "methods=['decoupled','elastic_dp','data_parallel']",
                    *SWEEP_DP,
                    *gen,
                ],
            )
        )
    return runs


def plot_failure_sweep(directories: dict[int, Path], out: Path) -> Path:
    """Eval loss and goodput of every method against the failure rate (chips at 1 y MTBI)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_good) = plt.subplots(1, 2, figsize=(10, 4))
    by_method: dict[str, list[tuple[int, float, float]]] = {}
    for chips, directory in sorted(directories.items()):
        summary = json.loads((directory / "summary.json").read_text(encoding="utf-8"))
        for method, s in summary["methods"].items():
            by_method.setdefault(method, []).append((chips, s["eval_loss"], s["goodput"]))
    for method, points in by_method.items():
        x = [c / 1e6 for c, _, _ in points]
        ax_loss.plot(x, [loss for _, loss, _ in points], "o-", label=method)
        ax_good.plot(x, [100 * g for _, _, g in points], "o-", label=method)
    ax_good.plot([1.2], [58], "k^", label="paper: elastic DP at 1.2M")
    ax_good.plot([1.2], [27], "kv", label="paper: DP at 1.2M")
    ax_loss.set(
        xlabel="cluster size (M chips, per-chip MTBI 1 year)",
        ylabel="eval loss (nats)",
        title="equal virtual time",
    )
    ax_good.set(xlabel="cluster size (M chips, per-chip MTBI 1 year)", ylabel="goodput (%)")
    ax_loss.legend()
    ax_good.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


# a far link: 2.5 s each way, so a fragment's merge comes back 5-6 steps after the ask. (A
# link slowed by bandwidth alone cannot do that: with P = H one fragment leaves each learner
# per step, so a link that takes 2-4 steps per fragment saturates and answers queue up.)
SLOW_LINK = "network.latency_seconds=2.5"


def apply_rules(tokens: int) -> list[Run]:
    """How a merged fragment meets local progress (sync.apply), at tau = 1, 2, 4, on the
    default link and on one slow enough that a merge comes back 4-8 steps after the ask."""
    base = decoupled_alone(tokens)
    runs = []
    for link, extra in (("fast", []), ("far", [SLOW_LINK])):
        for tau in (1, 2, 4):
            for rule in ("overwrite", "blend", "carry"):
                sets = [*base, f"sync.rounds.overlap={tau}", f"sync.apply='{rule}'", *extra]
                runs.append((f"{rule}, tau={tau}, {link} link", sets))
    return runs


SCALING_MODELS = ["gpt-1m", "gpt-4m", "gpt-12m"]  # (--models replaces them)


def scaling(tokens: int) -> list[Run]:
    """The gap to data-parallel at equal tokens as model and run grow (no failures), on the
    GPU when there is one (``train.device = 'auto'``)."""
    return [
        (
            model,
            [
                f"model='{model}'",
                *budget(tokens),
                "train.device='auto'",
                "methods=['decoupled', 'data_parallel']",
                "chaos=[]",
            ],
        )
        for model in SCALING_MODELS
    ]


def gap_table(rows: dict[tuple[int, str, str], list[dict[str, Any]]]) -> str:
    """Per run with data-parallel in it: each other method's eval loss minus data-parallel's,
    seed by seed, at equal tokens and at equal time (the first method's finishing time)."""
    lines = [
        "| run | method | eval loss | data-parallel | gap (per seed) | gap / DP loss "
        "| gap at equal time / DP loss |",
        "|---|---|---|---|---|---|---|",
    ]
    for (n, label, method), ours in rows.items():
        dp = rows.get((n, label, "data_parallel"))
        if method == "data_parallel" or not dp or len(dp) != len(ours):
            continue
        gaps = [a["eval_loss"] - b["eval_loss"] for a, b in zip(ours, dp, strict=True)]
        theirs = statistics.mean(s["eval_loss"] for s in dp)
        timed = [
            (a["eval_loss_equal_time"] - b["eval_loss_equal_time"]) / b["eval_loss_equal_time"]
            for a, b in zip(ours, dp, strict=True)
            if a.get("eval_loss_equal_time") is not None
            and b.get("eval_loss_equal_time") is not None
        ]
        at_time = f"{statistics.mean(timed):+.1%}" if timed else "-"
        lines.append(
            f"| {label} | {method} | {statistics.mean(s['eval_loss'] for s in ours):.4f} | "
            f"{theirs:.4f} | {' / '.join(f'{g:+.4f}' for g in gaps)} | "
            f"{statistics.mean(gaps) / theirs:+.1%} | {at_time} |"
        )
    return "\n".join(lines)


EXPERIMENTS: dict[str, Callable[[int], list[Run]]] = {
    "scaling": scaling,
    "apply": apply_rules,
    "equal-tokens": equal_tokens,
    "failure-sweep": failure_sweep,
    "heterogeneity": heterogeneity,
    "rda": rda,
    "codecs": codecs,
    "fragmentation": fragmentation,
    "scavenging": scavenging,
    **QUALITY,
}
PER_PARAM = set(QUALITY)  # experiments whose --tokens is tokens per parameter


# experiments whose table adds the virtual time to reach a target eval loss
TARGETED = {"scavenging"}
# experiments whose table adds the counts of late answers: held for the next round, dropped
# as stale, anchored on the current value
LATE = {"staleness", "apply"}
LATE_COUNTS = ("accepted", "waiting", "stale", "anchored")


def eval_curve(directory: Path, method: str) -> list[tuple[float, float]]:
    """(virtual time, eval loss) of one method, from a run directory's metrics.jsonl."""
    return method_curve(directory, method, "t")


def time_to(curve: list[tuple[float, float]], target: float) -> float:
    """First virtual time the eval loss reaches ``target``, linear between evaluations."""
    for (t0, l0), (t1, l1) in itertools.pairwise(curve):
        if l1 <= target:
            return t1 if l0 == l1 else t0 + (t1 - t0) * (l0 - target) / (l0 - l1)
    return math.inf


def slug(label: str) -> str:
    """A run label as a directory name: "H=12, nesterov (0.5, 0.9)" -> "H=12_nesterov_0.5_0.9"."""
    words = re.sub(r"[^A-Za-z0-9.=+-]+", " ", label.replace(",", "")).split()
    return "_".join(words)


def read_summary(directory: Path, method: str) -> dict[str, Any]:
    summary = json.loads((directory / "summary.json").read_text(encoding="utf-8"))
    return summary["methods"][method]


def run_one(
    overrides: list[str], directory: Path, reuse: bool, only: Sequence[str] | None
) -> list[dict[str, Any]]:
    """The summary of each method of one run, its eval ``curve`` added: read back with
    ``reuse`` (a method not trained yet is left out and said: ``reuse`` never trains), else
    trained. The run's methods train together in ``directory``, or one by one in their own
    directories (:func:`quality.method_dir`) when ``only`` names some or an earlier
    invocation split it."""
    config = load_config(None, overrides)
    first = config.methods[0]
    if reuse and (directory / "summary.json").exists():
        found = [(read_summary(directory, m), directory) for m in config.methods]
    elif reuse:
        found = []
        for method in config.methods:
            own = method_dir(directory, method)
            if (own / "summary.json").exists():
                found.append((read_summary(own, method), own))
            else:
                print(f"  (--reuse: {method} of {directory.name} not trained yet: left out)")
    else:
        split = {m: method_dir(directory, m) for m in config.methods}
        if only is None and not any(d.exists() for d in split.values()):
            found = [(s, directory) for s in train(config, directory, quiet=True)]
        else:
            found = []
            for method, own in split.items():
                if only is None or method in only:
                    config = load_config(None, [*overrides, f'methods=["{method}"]'])
                    found.extend((s, own) for s in train(config, own, quiet=True))
    for s, held in found:
        s["curve"] = eval_curve(held, s["method"])
    summaries = [s for s, _ in found]
    if any(held != directory for _, held in found):  # split by method
        # at equal time as in one run: every method at the first method's finishing time
        # (each directory alone measured it at its own), unknown while the first has not run
        if summaries[0]["method"] == first:
            add_equal_time(summaries, {s["method"]: s["curve"] for s in summaries})
        else:
            for s in summaries:
                s["eval_loss_equal_time"] = None
    return summaries


def run_all(
    name: str,
    tokens: Sequence[int],
    seeds: Sequence[int],
    out: Path,
    reuse: bool = False,
    only: Sequence[str] | None = None,
    labels: Sequence[str] | None = None,
) -> str:
    """Run (or with ``reuse`` read back) experiment ``name``'s rows (only those ``labels``
    names, when given; ``only``: only these methods) and tabulate them."""
    rows: dict[tuple[int, str, str], list[dict[str, Any]]] = {}
    for n in tokens:
        for label, overrides in EXPERIMENTS[name](n):
            if labels and label not in labels:
                continue
            for seed in seeds:
                directory = out / name / f"{n}-{slug(label)}-s{seed}"
                started = time.monotonic()
                for s in run_one([*overrides, f"seed={seed}"], directory, reuse, only):
                    s["seed"] = seed
                    rows.setdefault((n, label, s["method"]), []).append(s)
                print(
                    f"  {n:>9,} tokens  {label:<28} seed {seed}  "
                    f"{time.monotonic() - started:6.0f} s",
                    flush=True,
                )
    lines = [
        f"| {'tokens/param' if name in PER_PARAM else 'tokens'} | run | method "
        "| eval loss (mean ± spread) | at equal time | tokens trained | goodput "
        "| token efficiency | virtual s | peak B/step |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    if name in TARGETED:
        # the target is the worst final loss of the seed's runs: a loss every run reaches
        target: dict[tuple[int, int], float] = {}
        for (n, _, _), summaries in rows.items():
            for s in summaries:
                key = (n, s["seed"])
                target[key] = max(target.get(key, -math.inf), s["eval_loss"])
        for (n, _, _), summaries in rows.items():
            for s in summaries:
                s["to_target"] = time_to(s["curve"], target[n, s["seed"]])
        lines = [lines[0] + " virtual s to the target loss (per seed) |", lines[1] + "---|"]
    for (n, label, method), summaries in rows.items():
        losses = [s["eval_loss"] for s in summaries]
        spread = (max(losses) - min(losses)) / 2 if len(losses) > 1 else 0.0
        peak = summaries[0].get("plan", {}).get("peak_bytes_per_step", "")
        timed = [s["eval_loss_equal_time"] for s in summaries if s.get("eval_loss_equal_time")]
        at_time = f"{statistics.mean(timed):.4f}" if timed else "-"
        lines.append(
            f"| {n:,} | {label} | {method} | {statistics.mean(losses):.4f} ± {spread:.4f} | "
            f"{at_time} | {statistics.mean(s['tokens'] for s in summaries):,.0f} | "
            f"{statistics.mean(s['goodput'] for s in summaries):.1%} | "
            f"{statistics.mean(s['token_efficiency'] for s in summaries):.3f} | "
            f"{statistics.mean(s['virtual_seconds'] for s in summaries):.0f} | {peak} |"
        )
        if name in TARGETED:
            lines[-1] += " " + " / ".join(f"{s['to_target']:.0f}" for s in summaries) + " |"
        if name in LATE:  # how many answers came late, and what became of them (seed 0)
            answers = summaries[0].get("answers", {})
            lines[-1] += " " + ", ".join(f"{k} {answers[k]}" for k in LATE_COUNTS if k in answers)
            lines[-1] += " |"
    if name in LATE:
        lines[0] += " late answers (seed 0) |"
        lines[1] += "---|"
    if name in TARGETED:
        per_seed = [f"{n:,}/s{seed}: {loss:.4f}" for (n, seed), loss in sorted(target.items())]
        lines.append("\ntarget loss per (tokens, seed): " + ", ".join(per_seed))
    if any(method == "data_parallel" for _, _, method in rows) and len(rows) > 1:
        lines.append("\n" + gap_table(rows))
    if name == "ladder":
        lines.append(f"\nplot: {plot_ladder(out / name, out / name / 'gap.png')}")
    if name == "failure-sweep":
        for n in tokens:
            for seed in seeds:
                dirs = {
                    chips: out / name / f"{n}-{chips // 1000}K_chips-s{seed}"
                    for chips in SWEEP_CHIPS
                }
                dirs[0] = out / name / f"{n}-no_failures-s{seed}"
                png = plot_failure_sweep(dirs, out / name / f"failure-sweep-{n}-s{seed}.png")
                lines.append(f"\nplot: {png}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("experiment", choices=sorted(EXPERIMENTS))
    ap.add_argument(
        "--tokens",
        type=int,
        nargs="+",
        help="the run lengths (default 1M); tokens per parameter for the quality experiments "
        "(default 20)",
    )
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--out", default="runs/experiments")
    ap.add_argument("--reuse", action="store_true", help="tabulate runs already under --out")
    ap.add_argument("--models", nargs="+", help="scaling, ladder: the models (default: all)")
    ap.add_argument(
        "--knob-model",
        help=f"the quality knob experiments' model (default {quality.KNOB_MODEL}); its runs "
        "go under <out>/<experiment>@<model>",
    )
    ap.add_argument("--rows", nargs="+", help="run only these rows (their labels, as tabled)")
    ap.add_argument(
        "--methods",
        nargs="+",
        help="run only these methods, each in a directory of its own (<run>.<method>)",
    )
    args = ap.parse_args()
    if args.models:
        SCALING_MODELS[:] = args.models
        LADDER_MODELS[:] = args.models
    name = args.experiment
    if args.knob_model and args.knob_model != quality.KNOB_MODEL:
        if name not in QUALITY or name == "ladder":
            knobs = sorted(set(QUALITY) - {"ladder"})
            raise SystemExit(f"--knob-model: {name} is not a knob experiment ({knobs})")
        quality.KNOB_MODEL = args.knob_model  # (read by the experiment's function when called)
        name = f"{name}@{args.knob_model}"
        EXPERIMENTS[name] = EXPERIMENTS[args.experiment]
        for kinds in (PER_PARAM, LATE):
            if args.experiment in kinds:
                kinds.add(name)
    if args.tokens is None:
        args.tokens = [20] if name in PER_PARAM else [1_000_000]
    known = [label for label, _ in EXPERIMENTS[name](args.tokens[0])]
    if unknown := sorted(set(args.rows or ()) - set(known)):
        raise SystemExit(f"--rows: {name} has no row {unknown}; its rows: {known}")
    print(f"experiment {name}: tokens {args.tokens}, seeds {args.seeds}")
    out = Path(args.out)
    print(run_all(name, args.tokens, args.seeds, out, args.reuse, args.methods, args.rows))


if __name__ == "__main__":
    main()
