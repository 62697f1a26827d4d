"""Quality where the paper measures it (issue 32): runs at a compute-optimal budget.

Each function here is one experiment of ``benchmarks/experiments.py`` whose ``--tokens`` is
**tokens per parameter** (default 20, the Chinchilla budget): every run trains
``tokens x parameters`` tokens of its model. They are registered in
``experiments.EXPERIMENTS`` and run, tabulate and re-tabulate (``--reuse``) like the others.

    python benchmarks/experiments.py ladder --tokens 20 --seeds 0 1 [--models gpt-tiny gpt-300k]
    python benchmarks/experiments.py lr-sweep --tokens 20 --seeds 0 1
    python benchmarks/experiments.py outer --tokens 20 --seeds 0 1
    python benchmarks/experiments.py outer-fine --tokens 20 --seeds 0 1
    python benchmarks/experiments.py short --seeds 0 1    (decision 83's short budgets)
    python benchmarks/experiments.py warmup --seeds 0 1   (Nesterov with a momentum warmup)
    python benchmarks/experiments.py warmup-lr --seeds 0 1
    python benchmarks/experiments.py staleness --tokens 20 --seeds 0 1
    python benchmarks/experiments.py late-weights --tokens 20 --seeds 0 1
    python benchmarks/experiments.py learners --tokens 20 --seeds 0 1
    python benchmarks/experiments.py compression --tokens 20 --seeds 0 1
    python benchmarks/experiments.py gap --tokens 20 --seeds 0 1
    python benchmarks/experiments.py merge-rule --tokens 20 --seeds 0 1

The knob experiments (all but ``ladder``) run at ``KNOB_MODEL``; ``--knob-model gpt-1m`` runs
one at another model, under ``<out>/<experiment>@<model>``. What each table compares is said
in its function's docstring; docs/results.md §12 holds the
tables and the decisions they led to.
"""

from __future__ import annotations

import functools
import statistics
from pathlib import Path

from ddiloco.models.registry import build_model
from ddiloco.report.metrics import read_records
from ddiloco.report.summary import loss_at

Run = tuple[str, list[str]]  # (label, --set overrides)

LADDER_MODELS = ["gpt-tiny", "gpt-300k", "gpt-1m"]  # (--models replaces them)
KNOB_MODEL = "gpt-tiny"  # the model the knob experiments run at (minutes a run here)
EVALS = 8  # evaluations over a run: the equal-time loss is read between two of them

# the demo's failures (the embedded default's chaos): learner 1 crashes at t = 60 s for 40 s
# and recovers from a peer; learner 3 runs 1.3x slower from t = 20 s to the end
DEMO_FAILURES = (
    "chaos=[{at=60.0, kind='crash', learner=1, duration=40.0},"
    " {at=20.0, kind='slow', learner=3, duration=0.0, factor=1.3}]"
)
ALL_METHODS = "methods=['decoupled', 'streaming', 'diloco', 'data_parallel']"

# late answers are common here: half the learners 1.5x slower, a link 2.5 s each way
HETEROGENEOUS = ("hardware.speed=[1, 1, 1.5, 1.5]", "network.latency_seconds=2.5")


@functools.cache
def parameters(model: str) -> int:
    return sum(p.numel() for p in build_model(model).parameters())


def at_budget(model: str, per_param: int) -> list[str]:
    """``model`` trained for ``per_param`` tokens per parameter, evaluated EVALS times."""
    tokens = per_param * parameters(model)
    return [f"model='{model}'", f"train.tokens={tokens}", f"train.eval_every={tokens // EVALS}"]


def ladder(per_param: int) -> list[Run]:
    """Every method at the budget, per model: one run without failures (Decoupled, Streaming,
    DiLoCo and data-parallel side by side: equal time is read across them) and one with the
    demo's crash and straggler (Decoupled and data-parallel, both under them). Data-parallel's
    global batch is M = 4 learners' (4 x 8 sequences); every method at the shipped inner lr."""
    runs = []
    for model in LADDER_MODELS:
        base = at_budget(model, per_param)
        runs.append((f"{model}, no failures", [*base, ALL_METHODS, "chaos=[]"]))
        runs.append(
            (
                f"{model}, demo failures",
                [*base, "methods=['decoupled', 'data_parallel']", DEMO_FAILURES],
            )
        )
    return runs


def lr_sweep(per_param: int) -> list[Run]:
    """Each method at its own best inner learning rate: a sweep (half the shipped 3e-3, it,
    double, four times: the best of three was the highest) at KNOB_MODEL, no failures, every
    method in each run."""
    base = at_budget(KNOB_MODEL, per_param)
    return [
        (f"inner lr {lr}", [*base, ALL_METHODS, "chaos=[]", f"train.lr={lr}"])
        for lr in (0.0015, 0.003, 0.006, 0.012)
    ]


OUTER_STEPS = {  # label -> the outer optimizer's settings
    "as-is (1, 0)": ("nesterov", 1.0, 0.0, 1),
    "nesterov (0.5, 0.9)": ("nesterov", 0.5, 0.9, 1),
    "nesterov (0.7, 0.9)": ("nesterov", 0.7, 0.9, 1),
    "delayed nesterov (0.7, 0.9, d=4)": ("delayed_nesterov", 0.7, 0.9, 4),
}


def outer(per_param: int) -> list[Run]:
    """Decoupled's outer step at the budget: as-is, Nesterov at two rates, delayed Nesterov,
    at H = 12, 24, 48 (P = H), no failures; plus data-parallel once for reference."""
    base = at_budget(KNOB_MODEL, per_param)
    runs: list[Run] = [("data-parallel", [*base, "methods=['data_parallel']", "chaos=[]"])]
    for h in (12, 24, 48):
        for label, (name, lr, momentum, delay) in OUTER_STEPS.items():
            sets = [
                *base,
                "methods=['decoupled']",
                "chaos=[]",
                f"sync.fragments={h}",
                f"sync.sync_every={h}",
                f"sync.outer.optimizer='{name}'",
                f"sync.outer.lr={lr}",
                f"sync.outer.momentum={momentum}",
                f"sync.outer.delay={delay}",
            ]
            runs.append((f"H={h}, {label}", sets))
    return runs


def outer_fine(per_param: int) -> list[Run]:
    """The outer step at the inner lr the sweep found best for Decoupled (6e-3, twice the
    shipped one): as-is against Nesterov (0.5, 0.9) with its momentum warmed up over 30
    outer steps (the shipped step): does the choice hold where the inner lr is best?"""
    base = [*at_budget(KNOB_MODEL, per_param), "methods=['decoupled']", "chaos=[]"]
    grid = {
        "inner lr 0.006, as-is (1, 0)": (0.006, 1.0, 0.0, 0),
        "inner lr 0.006, nesterov (0.5, 0.9) W=30": (0.006, 0.5, 0.9, 30),
    }
    return [
        (
            label,
            [
                *base,
                f"train.lr={lr}",
                f"sync.outer.lr={eta}",
                f"sync.outer.momentum={mu}",
                f"sync.outer.warmup={w}",
                "sync.outer.warmup_lr=false",
            ],
        )
        for label, (lr, eta, mu, w) in grid.items()
    ]


SHORT_STEPS = {  # the outer steps the short-budget check compares (eta, mu)
    "as-is (1, 0)": (1.0, 0.0),
    "nesterov (0.5, 0.9)": (0.5, 0.9),
    "nesterov (0.3, 0.9)": (0.3, 0.9),
    "nesterov (0.5, 0.8)": (0.5, 0.8),
}
TINY_GPT2 = Path("runs/tiny-gpt2")  # decision 83's model, written by :func:`tiny_gpt2`


def tiny_gpt2() -> str:
    """Decision 83's tiny Hugging Face GPT-2 (125K parameters), its config written once."""
    if not (TINY_GPT2 / "config.json").exists():
        from transformers import GPT2Config

        config = GPT2Config(
            n_layer=2, n_head=2, n_embd=64, n_positions=128, vocab_size=256,
            bos_token_id=0, eos_token_id=0,
        )  # fmt: skip
        config.save_pretrained(TINY_GPT2)
    return f"hf:{TINY_GPT2.resolve()}"


def short(_: int) -> list[Run]:
    """The budgets where decision 83 chose the outer step (2-5 tokens per parameter): the
    tiny GPT-2 that stalled under Nesterov (M = 2, P = 4, H = 8, 600K tokens) and the demo
    (gpt-1m, 1.5M tokens, its crash and straggler), each outer step of SHORT_STEPS. (--tokens
    is not used: these budgets are the point.)"""
    gpt2 = [
        f"model='{tiny_gpt2()}'", "train.learners=2", "train.batch_size=8",
        "train.tokens=600000", "train.eval_every=100000", "sync.fragments=4",
        "sync.sync_every=8", "chaos=[]", "methods=['decoupled']",
    ]  # fmt: skip
    demo = ["train.tokens=1500000", "train.eval_every=300000", DEMO_FAILURES]
    demo.append("methods=['decoupled']")
    runs = []
    for setting, base in (("tiny GPT-2", gpt2), ("demo", demo)):
        for label, (eta, mu) in SHORT_STEPS.items():
            sets = [*base, f"sync.outer.lr={eta}", f"sync.outer.momentum={mu}"]
            runs.append((f"{setting}, {label}", sets))
    return runs


def warmup(per_param: int) -> list[Run]:
    """Nesterov (0.5, 0.9) with its momentum ramped from 0 over the first W outer steps of
    each fragment, where the plain one stalls (decision 83's tiny GPT-2, one seed) and where
    it wins (KNOB_MODEL at the budget), and the demo."""
    runs: list[Run] = []
    nesterov = ["sync.outer.lr=0.5", "sync.outer.momentum=0.9"]
    for w in (10, 30):
        gpt2 = short(per_param)[0][1][:-2]  # (its base, without the outer step)
        runs.append((f"tiny GPT-2, W={w}", [*gpt2, *nesterov, f"sync.outer.warmup={w}"]))
    base = [*at_budget(KNOB_MODEL, per_param), "methods=['decoupled']", "chaos=[]"]
    for w in (10, 30, 100):
        runs.append((f"{KNOB_MODEL}, W={w}", [*base, *nesterov, f"sync.outer.warmup={w}"]))
    demo = short(per_param)[4][1][:-2]
    runs.append(("demo, W=30", [*demo, *nesterov, "sync.outer.warmup=30"]))
    return runs


def warmup_lr(per_param: int) -> list[Run]:
    """:func:`warmup`'s W = 30 with the rate ramped too, from 1 (the merged delta as it is)
    to 0.5: the warmup's first steps no longer move the global model half as far as as-is."""
    runs: list[Run] = []
    ramp = ["sync.outer.lr=0.5", "sync.outer.momentum=0.9", "sync.outer.warmup=30"]
    ramp.append("sync.outer.warmup_lr=true")
    gpt2 = short(per_param)[0][1][:-2]
    runs.append(("tiny GPT-2, W=30, lr ramp", [*gpt2, *ramp]))
    base = [*at_budget(KNOB_MODEL, per_param), "methods=['decoupled']", "chaos=[]"]
    runs.append((f"{KNOB_MODEL}, W=30, lr ramp", [*base, *ramp]))
    return runs


def staleness(per_param: int) -> list[Run]:
    """Late answers (half the learners 1.5x slower, a far link): today's rule (a late delta
    against its own base, dropped past max_staleness 1), staleness-aware weights, anchoring on
    the current value, and a larger max_staleness with the weights; with the adaptive grace
    window (the default) and without it (K = 1 closes a round at its first answer: every
    other answer of the round comes late and rides in the next one)."""
    base = [*at_budget(KNOB_MODEL, per_param), "methods=['decoupled']", "chaos=[]", *HETEROGENEOUS]
    variants = {
        "today (own base, s<=1)": [],
        "weights 1/(1+s)": ["sync.rounds.stale_weight=1.0"],
        "anchored on current": ["sync.rounds.anchor='current'"],
        "weights 1/(1+s), s<=4": ["sync.rounds.stale_weight=1.0", "sync.rounds.max_staleness=4"],
    }
    runs: list[Run] = [("data-parallel, same hardware", [*base, "methods=['data_parallel']"])]
    for grace in ("grace", "no grace"):
        window = [f"sync.rounds.grace={'true' if grace == 'grace' else 'false'}"]
        runs.extend(
            (f"{grace}, {label}", [*base, *window, *sets]) for label, sets in variants.items()
        )
    return runs


def late_weights(per_param: int) -> list[Run]:
    """:func:`staleness`'s grace runs without and with staleness-aware weights, under the
    shipped outer step (the staleness experiment ran under the merged delta as it is)."""
    return [r for r in staleness(per_param) if r[0] in LATE_PAIR]


LATE_PAIR = ("grace, today (own base, s<=1)", "grace, weights 1/(1+s)")


def learners(per_param: int) -> list[Run]:
    """M = 1, 2, 4, 8, 16 at a fixed global batch (32 sequences), no failures; at M = 8 and 16
    RDA against the weighted mean. M = 1 is data-parallel's batch through the syncer: what
    the fragments, the overlap and the outer step cost without any averaging of learners."""
    base = [*at_budget(KNOB_MODEL, per_param), "methods=['decoupled']", "chaos=[]"]
    runs = []
    for m in (1, 2, 4, 8, 16):
        shape = [f"train.learners={m}", f"train.batch_size={32 // m}"]
        runs.append((f"M={m}, rda", [*base, *shape]))
        if m >= 8:
            runs.append((f"M={m}, mean", [*base, *shape, "sync.merge_rule='mean'"]))
    return runs


def gap(per_param: int) -> list[Run]:
    """What the gap to data-parallel is made of, one knob at a time from the shipped
    Decoupled (no failures): progress kept across a merge (apply = carry) instead of
    overwritten, a shorter overlap (tau = 1), a sync period half as long (P = H = 6)."""
    base = [*at_budget(KNOB_MODEL, per_param), "methods=['decoupled']", "chaos=[]"]
    return [
        ("shipped", base),
        ("apply carry", [*base, "sync.apply='carry'"]),
        ("tau=1", [*base, "sync.rounds.overlap=1"]),
        ("P=H=6", [*base, "sync.fragments=6", "sync.sync_every=6"]),
    ]


def merge_rule(per_param: int) -> list[Run]:
    """RDA against the plain weighted mean at M = 4, each over outer learning rates (the
    shipped warmed-up Nesterov momentum): RDA keeps a learner's typical step length, the mean
    shrinks it as the learners' deltas disagree, so their best rates differ (RDA's 0.5 is the
    shipped step)."""
    base = [*at_budget(KNOB_MODEL, per_param), "methods=['decoupled']", "chaos=[]"]
    runs = []
    for rule, rates in (("rda", (0.3, 0.5, 0.7)), ("mean", (0.5, 0.7, 1.0))):
        for lr in rates:
            sets = [*base, f"sync.merge_rule='{rule}'", f"sync.outer.lr={lr}"]
            runs.append((f"{rule}, outer lr {lr}", sets))
    return runs


def compression(per_param: int) -> list[Run]:
    """The answers' wire format at the budget: bf16, int4, int2, no failures."""
    base = [*at_budget(KNOB_MODEL, per_param), "methods=['decoupled']", "chaos=[]"]
    return [(c, [*base, f"sync.codec.answers='{c}'"]) for c in ("bf16", "int4", "int2")]


QUALITY = {
    "ladder": ladder,
    "lr-sweep": lr_sweep,
    "outer": outer,
    "outer-fine": outer_fine,
    "short": short,
    "warmup": warmup,
    "warmup-lr": warmup_lr,
    "staleness": staleness,
    "late-weights": late_weights,
    "learners": learners,
    "gap": gap,
    "merge-rule": merge_rule,
    "compression": compression,
}


def method_curve(directory: Path, method: str, key: str = "tokens") -> list[tuple[float, float]]:
    """(``key``, eval loss) of ``method``'s evaluations in a run directory, or in the
    method's own directory beside it (``<run>.<method>``: ``experiments.py --methods``)."""
    path = method_dir(directory, method) / "metrics.jsonl"
    path = path if path.exists() else directory / "metrics.jsonl"
    records = read_records(path) if path.exists() else []  # (a method not run yet)
    return [(r[key], r["loss"]) for r in records if r["kind"] == "eval" and r["method"] == method]


def method_dir(directory: Path, method: str) -> Path:
    """Where one method of a run split by method (``experiments.py --methods``) runs."""
    return directory.with_name(f"{directory.name}.{method}")


def gap_curves(directory: Path, method: str = "decoupled") -> list[tuple[float, float, float]]:
    """(tokens, gap at equal tokens, gap at equal time) of ``method`` to data-parallel in one
    run directory, at each of the method's evaluations after the first."""
    ours, theirs = method_curve(directory, method), method_curve(directory, "data_parallel")
    ours_t = method_curve(directory, method, "t")
    theirs_t = method_curve(directory, "data_parallel", "t")
    out = []
    for (n, loss), (t, _) in zip(ours[1:], ours_t[1:], strict=True):
        dp_n, dp_t = loss_at(theirs, n), loss_at(theirs_t, t)
        if dp_n is not None and dp_t is not None:
            out.append((n, (loss - dp_n) / dp_n, (loss - dp_t) / dp_t))
    return out


def plot_ladder(root: Path, out: Path) -> Path:
    """The gap to data-parallel (no failures) against tokens per parameter, one line per
    model (mean over the seeds found), at equal tokens and at equal time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_n, ax_t) = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for model in sorted({*LADDER_MODELS, *_ladder_models(root)}, key=parameters):
        # a run's directory, or its methods' own (<run>.<method>) when split by method
        runs = sorted({d.with_suffix("") for d in root.glob(f"*-{model}_no_failures-s*")})
        curves = [c for c in map(gap_curves, runs) if c]
        if not curves:
            continue
        size = parameters(model)
        points = list(zip(*curves, strict=False))  # evaluation by evaluation, over seeds
        x = [statistics.mean(p[0] for p in at) / size for at in points]
        label = f"{model} ({size / 1e6:.2f}M params, {len(curves)} seeds)"
        ax_n.plot(x, [100 * statistics.mean(p[1] for p in at) for at in points], "o-", label=label)
        ax_t.plot(x, [100 * statistics.mean(p[2] for p in at) for at in points], "o-", label=label)
    for ax, what in ((ax_n, "equal tokens"), (ax_t, "equal time")):
        ax.axhline(0.0, color="k", lw=0.8)
        ax.axhline(1.0, color="k", lw=0.8, ls=":")
        ax.set(xlabel="tokens per parameter", title=f"Decoupled vs data-parallel, {what}")
        ax.set_xscale("log")
    ax_n.set_ylabel("eval-loss gap to data-parallel (%)")
    ax_n.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def _ladder_models(root: Path) -> set[str]:
    """The models a ladder directory holds runs of (``20-gpt-tiny_no_failures-s0``)."""
    runs = root.glob("*_no_failures-s*")
    return {d.name.split("-", 1)[1].rsplit("_no_failures", 1)[0] for d in runs}
