"""The ``ddiloco`` command: one subcommand per task, each in :mod:`ddiloco.commands`."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from ddiloco import __version__
from ddiloco.commands import (
    bandwidth,
    compare,
    data,
    deploy,
    export,
    learner,
    plan,
    sample,
    simulate,
    syncer,
    train,
)
from ddiloco.commands import eval as evaluate
from ddiloco.errors import FATAL_EXIT, DDiLoCoError

SERVICES = ("syncer", "learner")  # started by a supervisor, which must not restart them

COMMANDS = {
    "train": (train, "train with Decoupled DiLoCo and baselines (no arguments: the demo)"),
    "compare": (compare, "print and plot several run directories side by side"),
    "plan": (plan, "show a model's fragment plan: tensors, bytes, imbalance, bytes per step"),
    "syncer": (syncer, "run the CPU syncer service of a real-processes run"),
    "learner": (learner, "run one learner process of a real-processes run"),
    "deploy": (deploy, "write SLURM, Kubernetes or KubeRay job files for a multi-host run"),
    "simulate": (simulate, "cluster goodput simulator: DP, elastic DP, Decoupled, 150K-2.4M chips"),
    "bandwidth": (bandwidth, "WAN bandwidth each method needs for a target compute utilization"),
    "data": (data, "prepare a corpus: tokenize text into token files for data.source"),
    "export": (export, "write a checkpoint directory of a run's global model (any run)"),
    "sample": (sample, "generate text with a run's (or a checkpoint's) global model"),
    "eval": (evaluate, "eval loss and bits per byte of a run's (or a checkpoint's) global model"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ddiloco",
        description="Decoupled DiLoCo: independent learners, an asynchronous CPU syncer.",
    )
    parser.add_argument("--version", action="version", version=f"ddiloco {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        module.add_arguments(p)
        p.set_defaults(run=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    try:
        return int(args.run(args))
    except DDiLoCoError as exc:
        print(f"ddiloco {args.command}: error: {exc}", file=sys.stderr, flush=True)
        return FATAL_EXIT if args.command in SERVICES else 2


if __name__ == "__main__":
    sys.exit(main())
