"""One module per ``ddiloco`` subcommand: each adds its arguments and runs."""

import argparse


def add_config_arguments(
    parser: argparse.ArgumentParser, config_help: str, example: str = "sync.rounds.quorum=2"
) -> None:
    """``--config FILE`` and repeatable ``--set key=value``: how every command takes a config."""
    parser.add_argument("--config", help=config_help)
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help=f"override a config value, e.g. --set {example} (repeatable)",
    )
