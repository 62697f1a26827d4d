"""``ddiloco plan``: show how a model's parameters are split into fragments.

With no options it shows the plan a default ``ddiloco train`` uses (the model, P, H, the
partition and row splitting of the config dataclasses' defaults); ``--config`` / ``--set``
select a run's config, as for ``train``, and the explicit options override both.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from ddiloco.commands import add_config_arguments
from ddiloco.config import RunConfig, load_config
from ddiloco.core.plans import PARTITIONS, FragmentPlan
from ddiloco.errors import ConfigError
from ddiloco.models.registry import build_model
from ddiloco.report.text import human_bytes, table

CONFIG_FILES = ("config.toml", "run.toml")  # a run directory's, a checkpoint directory's


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(
        parser,
        "a run's TOML config, or a run or checkpoint directory (its config); default: the "
        "default training config",
        example="sync.fragments=24",
    )
    parser.add_argument(
        "--model",
        help="a built-in GPT config (gpt-tiny, gpt-300k, gpt-1m, gpt-4m, gpt-12m, gpt-50m), "
        "hf:PATH (a local Hugging Face model directory) or module:function returning a "
        "torch.nn.Module (default: the config's model)",
    )
    parser.add_argument("--fragments", "-P", type=int, help="P (default: the config's)")
    parser.add_argument(
        "--partition", choices=PARTITIONS, help="default: the config's sync.partition"
    )
    parser.add_argument(
        "--sync-every", "-H", type=int, help="H (default: the config's sync.sync_every)"
    )
    parser.add_argument(
        "--split-rows",
        action=argparse.BooleanOptionalAction,
        help="balanced only: split tensors larger than total/P by rows (default: the "
        "config's sync.split_rows)",
    )
    parser.add_argument("--json", action="store_true", help="print a JSON object")


def resolve(args: argparse.Namespace) -> RunConfig:
    """The config the plan is shown for: defaults, ``--config``, ``--set``, then the options."""
    path = Path(args.config) if args.config is not None else None
    if path is not None and path.is_dir():
        found = [path / name for name in CONFIG_FILES if (path / name).is_file()]
        if not found:
            why = "a directory with no config.toml (a run's) or run.toml (a checkpoint's)"
            raise ConfigError("--config", args.config, why)
        path = found[0]
    config = load_config(path, list(args.set))
    changes = {
        "fragments": args.fragments,
        "partition": args.partition,
        "sync_every": args.sync_every,
        "split_rows": args.split_rows,
    }
    sync = dataclasses.replace(config.sync, **{k: v for k, v in changes.items() if v is not None})
    model = config.model if args.model is None else args.model
    return dataclasses.replace(config, model=model, sync=sync)


def run(args: argparse.Namespace) -> int:
    config = resolve(args)
    model = build_model(config.model, config)  # as the run builds it
    plan = config.sync.fragment_plan(model)  # (rows split only in balanced plans, as trained)
    split_rows = config.sync.split_rows and plan.partition == "balanced"
    if args.json:
        out = {"model": config.model, "split_rows": split_rows, **plan.to_dict()}
        print(json.dumps(out, indent=2))
    else:
        print(render(plan, config.model, split_rows))
    return 0


def render(plan: FragmentPlan, model_name: str, split_rows: bool = False) -> str:
    """The human-readable plan report."""
    numel = sum(s.numel for s in plan.specs)
    rows = []
    for f in plan.fragments:
        names = [
            s.name if s.rows is None else f"{s.name}[{s.rows[0]}:{s.rows[1]}]" for s in f.slices
        ]
        shown = ", ".join(names[:3]) + (f", +{len(names) - 3} more" if len(names) > 3 else "")
        rows.append([f.index, f.offset, f"{f.numel:,}", human_bytes(f.nbytes), shown])
    split = ", split_rows" if split_rows else ""  # (tensors over total/P split by rows)
    lines = [
        f"model {model_name}: {numel:,} parameters, {human_bytes(plan.total_bytes)}",
        f"partition {plan.partition}{split}, P={plan.num_fragments} fragments, H={plan.sync_every}",
        "",
        table(["fragment", "t_p", "params", "bytes", "tensors"], rows),
        "",
        f"imbalance (max/mean fragment bytes): {plan.imbalance:.3f}",
        f"bytes per step: peak {human_bytes(plan.peak_bytes_per_step)}, "
        f"mean {human_bytes(plan.mean_bytes_per_step)} "
        f"(data-parallel all-reduces {human_bytes(plan.total_bytes)} every step)",
    ]
    return "\n".join(lines)
