"""``ddiloco simulate``: the cluster goodput simulator (no training, millions of chips).

With no arguments it runs the paper's table (150K..2.4M chips; DP, elastic DP, Decoupled
DiLoCo with M = 2, 4, 8, 16) with the default parameter set, 3 seeds x 30 simulated days, and
prints ours beside the paper's. ``--realistic`` swaps in published-order restart and
reconfiguration times. Parameters: docs/simulator.md.
"""

from __future__ import annotations

import argparse
import json
import re
import sys

from ddiloco.cluster.params import ClusterParams, load_params, replace
from ddiloco.cluster.table import render, run_table, to_json
from ddiloco.commands import add_config_arguments
from ddiloco.errors import ConfigError

_SUFFIX = {"": 1, "k": 1_000, "m": 1_000_000, "g": 1_000_000_000}


def parse_chips(text: str) -> int:
    """'150000', '150K', '2.4M', '1.5e5' -> a chip count (validated later, by name)."""
    m = re.fullmatch(r"\s*([-+]?[0-9.]+(?:e[-+]?[0-9]+)?)\s*([kmg]?)\s*", text.lower())
    if not m:
        raise ConfigError("chips", text, "expected a count like 150000, 150K or 2.4M")
    try:
        value = float(m.group(1)) * _SUFFIX[m.group(2)]
    except ValueError:
        raise ConfigError("chips", text, "expected a count like 150000, 150K or 2.4M") from None
    return round(value)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(
        parser,
        "a TOML parameter file (default: the paper set, configs/cluster_paper.toml)",
        example="elastic.upscale_s=60",
    )
    parser.add_argument(
        "--realistic",
        action="store_true",
        help="published-order restart/reconfiguration times (configs/cluster_realistic.toml)",
    )
    parser.add_argument(
        "--chips",
        nargs="+",
        metavar="N",
        help="cluster sizes, e.g. 150K 300K 2.4M (default: the paper's five)",
    )
    parser.add_argument(
        "--learners",
        nargs="+",
        type=int,
        metavar="M",
        help="Decoupled DiLoCo learner counts (default: 2 4 8 16)",
    )
    parser.add_argument("--quorum", type=int, metavar="K", help="syncer quorum K (default 1)")
    parser.add_argument("--mtbi-hours", type=float, help="per-chip MTBI (default 8760 = 1 y)")
    parser.add_argument("--seeds", type=int, help="seeds per cell (default 3)")
    parser.add_argument("--days", type=float, help="simulated days (default 30)")
    parser.add_argument("--seed", type=int, help="base seed (default 0)")
    parser.add_argument("--plot", metavar="PNG", help="also write goodput vs chips to PNG")
    parser.add_argument("--json", action="store_true", help="print a JSON object")
    parser.add_argument("--quiet", action="store_true", help="no progress on stderr")


def resolve(args: argparse.Namespace) -> ClusterParams:
    """Preset, file, --set overrides, then the dedicated flags."""
    p = load_params(args.config, "realistic" if args.realistic else None, list(args.set))
    run: dict[str, object] = {}
    if args.chips is not None:
        run["chips"] = tuple(parse_chips(c) for c in args.chips)
    for name in ("seeds", "days", "seed"):
        if getattr(args, name) is not None:
            run[name] = getattr(args, name)
    if run:
        p = replace(p, "run", **run)
    decoupled: dict[str, object] = {}
    if args.learners is not None:
        decoupled["learners"] = tuple(args.learners)
    if args.quorum is not None:
        decoupled["quorum"] = args.quorum
    if decoupled:
        p = replace(p, "decoupled", **decoupled)
    if args.mtbi_hours is not None:
        p = replace(p, "failures", mtbi_hours=args.mtbi_hours)
    return p


def run(args: argparse.Namespace) -> int:
    params = resolve(args)
    show = not args.quiet and sys.stderr.isatty()

    def progress(text: str) -> None:
        if show:
            print(f"\r  simulating: {text}   ", end="", file=sys.stderr, flush=True)

    result = run_table(params, progress)
    if show:
        print(file=sys.stderr)
    if args.plot:
        from ddiloco.cluster.plot import plot_table

        plot_table(result, args.plot)
    if args.json:
        data = to_json(result)
        if args.plot:
            data["plot"] = args.plot
        print(json.dumps(data, indent=2))
    else:
        print(render(result))
        if args.plot:
            print(f"\nplot: {args.plot}")
    return 0
