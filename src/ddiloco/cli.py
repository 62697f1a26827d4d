"""The ``ddiloco`` command: one subcommand per task, each in :mod:`ddiloco.commands`."""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from collections.abc import Sequence
from types import ModuleType

from ddiloco.errors import FATAL_EXIT, DDiLoCoError
from ddiloco.version import __version__

SERVICES = ("syncer", "learner")  # started by a supervisor, which must not restart them

# name -> what it does; each is the module ddiloco.commands.<name> (eval: eval.py), imported
# only when it runs: a learner process must not pay for the plotting stack or the planner.
COMMANDS = {
    "train": "train with Decoupled DiLoCo and baselines (no arguments: the demo)",
    "compare": "print and plot several run directories side by side",
    "plan": "show a model's fragment plan: tensors, bytes, imbalance, bytes per step",
    "syncer": "run the CPU syncer service of a real-processes run",
    "learner": "run one learner process of a real-processes run",
    "deploy": "write SLURM, Kubernetes or KubeRay job files for a multi-host run",
    "simulate": "cluster goodput simulator: DP, elastic DP, Decoupled, 150K-2.4M chips",
    "bandwidth": "WAN bandwidth each method needs for a target compute utilization",
    "data": "prepare a corpus: tokenize text into token files for data.source",
    "export": "write a checkpoint directory of a run's global model (any run)",
    "sample": "generate text with a run's (or a checkpoint's) global model",
    "eval": "eval loss and bits per byte of a run's (or a checkpoint's) global model",
}


def command(name: str) -> ModuleType:
    """The module of command ``name`` (``add_arguments(parser)``, ``run(args)``)."""
    return importlib.import_module(f"ddiloco.commands.{name}")


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """Every command's parser, or with ``only`` that one's arguments (the others listed)."""
    parser = argparse.ArgumentParser(
        prog="ddiloco",
        description="Decoupled DiLoCo: independent learners, an asynchronous CPU syncer.",
    )
    parser.add_argument("--version", action="version", version=f"ddiloco {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, help_text in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if only in (None, name):
            module = command(name)
            module.add_arguments(p)
            p.set_defaults(run=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    named = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(named if named in COMMANDS else None)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    try:
        return int(args.run(args))
    except DDiLoCoError as exc:
        print(f"ddiloco {args.command}: error: {exc}", file=sys.stderr, flush=True)
        return FATAL_EXIT if args.command in SERVICES else 2


def exit_service(code: int) -> None:
    """End a syncer or learner process now that its command returned: everything it wrote
    is closed and flushed, and the interpreter's teardown (torch's, ~1 s) would only delay
    the supervisor that waits for it."""
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)


if __name__ == "__main__":  # (how supervisors start the services: python -m ddiloco.cli)
    status = main()
    if sys.argv[1:2] and sys.argv[1] in SERVICES:
        exit_service(status)
    sys.exit(status)
