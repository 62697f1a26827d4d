"""``ddiloco plan``: show how a model's parameters are split into fragments."""

from __future__ import annotations

import argparse
import json

from ddiloco.config import RunConfig
from ddiloco.core.plans import PARTITIONS, FragmentPlan, build_plan, tensor_specs
from ddiloco.models.registry import DEFAULT_MODEL, build_model
from ddiloco.report.text import human_bytes, table


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help="a built-in GPT config (gpt-tiny, gpt-1m, gpt-4m, gpt-12m, gpt-50m), hf:PATH "
        "(a local Hugging Face model directory) or module:function returning a "
        "torch.nn.Module (default: %(default)s)",
    )
    parser.add_argument("--fragments", "-P", type=int, default=24, help="P (default: 24)")
    parser.add_argument(
        "--partition", choices=PARTITIONS, default="balanced", help="default: %(default)s"
    )
    parser.add_argument("--sync-every", "-H", type=int, default=None, help="H (default: P)")
    parser.add_argument(
        "--split-rows",
        action="store_true",
        help="balanced only: split tensors larger than total/P by rows",
    )
    parser.add_argument("--json", action="store_true", help="print a JSON object")


def run(args: argparse.Namespace) -> int:
    model = build_model(args.model, RunConfig(model=args.model))  # as a default run builds it
    plan = build_plan(
        tensor_specs(model),
        args.fragments,
        args.partition,
        sync_every=args.sync_every,
        split_rows=args.split_rows,
    )
    if args.json:
        print(json.dumps({"model": args.model, **plan.to_dict()}, indent=2))
    else:
        print(render(plan, args.model))
    return 0


def render(plan: FragmentPlan, model_name: str) -> str:
    """The human-readable plan report."""
    numel = sum(s.numel for s in plan.specs)
    rows = []
    for f in plan.fragments:
        names = [
            s.name if s.rows is None else f"{s.name}[{s.rows[0]}:{s.rows[1]}]" for s in f.slices
        ]
        shown = ", ".join(names[:3]) + (f", +{len(names) - 3} more" if len(names) > 3 else "")
        rows.append([f.index, f.offset, f"{f.numel:,}", human_bytes(f.nbytes), shown])
    lines = [
        f"model {model_name}: {numel:,} parameters, {human_bytes(plan.total_bytes)}",
        f"partition {plan.partition}, P={plan.num_fragments} fragments, H={plan.sync_every}",
        "",
        table(["fragment", "t_p", "params", "bytes", "tensors"], rows),
        "",
        f"imbalance (max/mean fragment bytes): {plan.imbalance:.3f}",
        f"bytes per step: peak {human_bytes(plan.peak_bytes_per_step)}, "
        f"mean {human_bytes(plan.mean_bytes_per_step)} "
        f"(data-parallel all-reduces {human_bytes(plan.total_bytes)} every step)",
    ]
    return "\n".join(lines)
