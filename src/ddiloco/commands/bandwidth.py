"""``ddiloco bandwidth``: the WAN bandwidth a method needs for a target compute utilization.

With ``--method`` it plans that method; without, it compares all four (plus Decoupled with
int4) for the same job. Defaults are the paper's case: 5B parameters, bf16, 1 s step,
2 datacenters, 90% utilization. Formulas: docs/bandwidth.md.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from ddiloco.cluster.bandwidth import (
    METHODS,
    PAPER_BANDWIDTH,
    RECOVERY_LINKS,
    BandwidthQuery,
    plan,
    recovery,
)

INT4_BITS = 4.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--method", help=f"one of {', '.join(METHODS)} (default: compare all)")
    parser.add_argument("--params", type=float, default=5e9, help="model parameters (5e9)")
    parser.add_argument(
        "--bits",
        type=float,
        default=16.0,
        help="bits per value on the wire (16 = bf16; int4: 4, or 4.25 with a "
        "32-bit scale per 128 values)",
    )
    parser.add_argument("--step-time", type=float, default=1.0, help="seconds per step (1)")
    parser.add_argument(
        "--utilization", type=float, default=0.9, help="target compute utilization, 0..1 (0.9)"
    )
    parser.add_argument("--datacenters", type=int, default=2, help="datacenters spanned (2)")
    parser.add_argument("--fragments", type=int, default=24, help="P (24)")
    parser.add_argument("--overlap", type=float, default=2.0, help="τ in steps (2)")
    parser.add_argument(
        "--inner-steps",
        type=int,
        default=0,
        metavar="H",
        help="H: DiLoCo's sync interval; streaming/decoupled sync each fragment "
        "every H steps (default: 100 for DiLoCo, P for the others)",
    )
    parser.add_argument(
        "--backward-fraction",
        type=float,
        default=2.0 / 3.0,
        help="share of a step DP can hide its all-reduce behind (2/3)",
    )
    parser.add_argument(
        "--bandwidth", type=float, metavar="GBPS", help="also the utilization of a link this fast"
    )
    parser.add_argument(
        "--grid", action="store_true", help="snap to the log-spaced grid the published tables used"
    )
    parser.add_argument(
        "--sustained",
        action="store_true",
        help="also require the link to keep up on average when transfers "
        "overlap (the published figures leave this out)",
    )
    parser.add_argument(
        "--recovery",
        action="store_true",
        help="instead: the bytes a peer recovery copies and its time on each --link",
    )
    parser.add_argument(
        "--model", help="with --recovery: a model's parameters (e.g. gpt-50m) instead of --params"
    )
    parser.add_argument(
        "--link",
        type=float,
        nargs="+",
        metavar="GBPS",
        help="with --recovery: link rates in Gbit/s (default: "
        + " ".join(f"{g:g}" for g in RECOVERY_LINKS)
        + ")",
    )
    parser.add_argument("--json", action="store_true", help="print a JSON object")


def query(args: argparse.Namespace, method: str, bits: float | None = None) -> BandwidthQuery:
    return BandwidthQuery(
        method=method,
        params=args.params,
        bits=args.bits if bits is None else bits,
        step_time_s=args.step_time,
        utilization=args.utilization,
        datacenters=args.datacenters,
        fragments=args.fragments,
        overlap=args.overlap,
        inner_steps=args.inner_steps,
        backward_fraction=args.backward_fraction,
    )


def run(args: argparse.Namespace) -> int:
    if args.recovery:
        return run_recovery(args)
    options = {"grid": args.grid, "bandwidth": args.bandwidth, "sustained": args.sustained}
    if args.method is not None:
        result = plan(query(args, args.method), **options)
        print(json.dumps(result, indent=2) if args.json else render([result]))
        return 0
    rows = [plan(query(args, m), **options) for m in METHODS]
    int4 = plan(query(args, "decoupled", INT4_BITS), **options)
    rows.append({**int4, "label": "decoupled int4"})
    if args.json:
        print(json.dumps({"methods": {r.get("label", r["method"]): r for r in rows}}, indent=2))
    else:
        print(render(rows))
    return 0


def render(rows: list[dict[str, Any]]) -> str:
    """The comparison for people (the paper's figures where it has one)."""
    from ddiloco.report.text import table

    q = rows[0]["query"]
    head = ["method", "Gbit/s", "raw", "x less than DP", "Gbit/transfer", "every (s)", "paper"]
    if "utilization_at_bandwidth" in rows[0]:
        head.append(f"CU at {rows[0]['bandwidth_gbit_per_s']:g} Gbit/s")
    body = []
    dp = next((r["gbit_per_s"] for r in rows if r["method"] == "dp"), None)
    for r in rows:
        label = r.get("label", r["method"])
        paper = PAPER_BANDWIDTH.get(label.replace(" ", "_"))
        ratio = r["times_less_than_dp"] if dp is None else dp / r["gbit_per_s"]
        line = [
            label,
            f"{r['gbit_per_s']:.4g}",
            f"{r['raw_gbit_per_s']:.4g}",
            f"{ratio:.1f}",
            f"{r['gbit_per_transfer']:.3g}",
            f"{r['transfer_period_s']:.3g}",
            "" if paper is None else f"{paper:g}",
        ]
        if "utilization_at_bandwidth" in r:
            line.append(f"{100 * r['utilization_at_bandwidth']:.1f}%")
        body.append(line)
    lines = [
        f"{q['params']:.3g} parameters, {q['bits']:g} bits/value, {q['step_time_s']:g} s step, "
        f"{q['datacenters']} datacenters, {100 * q['utilization']:g}% target utilization"
        + (" (grid)" if rows[0]["grid"] else ""),
        "",
        table(head, body),
    ]
    overlap = [r for r in rows if r["transfers_overlap"] and not r["sustained_included"]]
    if overlap:
        need = ", ".join(
            f"{r.get('label', r['method'])} {r['sustained_gbit_per_s']:.3g}" for r in overlap
        )
        lines += [
            "",
            "note: transfers overlap (τ > H/P), and the published model gives each one the link "
            "for its window;",
            f"keeping up on average needs (Gbit/s): {need}. Use --sustained to include it, or a "
            "larger --inner-steps.",
        ]
    return "\n".join(lines)


def model_size(name: str) -> tuple[float, float]:
    """A model's parameters and its other state (buffers) in bytes, built on the meta device
    (nothing allocated)."""
    import torch

    from ddiloco.models.registry import build_model

    with torch.device("meta"):
        model = build_model(name)
    names = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    extra = sum(
        t.numel() * t.element_size() for k, t in model.state_dict().items() if k not in names
    )
    return float(sum(p.numel() for p in model.parameters())), float(extra)


def run_recovery(args: argparse.Namespace) -> int:
    params, extra = model_size(args.model) if args.model else (args.params, 0.0)
    result = recovery(params, args.link or RECOVERY_LINKS, extra)
    if args.model:
        result["model"] = args.model
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    from ddiloco.report.text import table

    gb = result["snapshot_bytes"] / 1e9
    rows = [[f"{x['gbit_per_s']:g}", duration(x["seconds"])] for x in result["links"]]
    print(
        f"peer recovery of {args.model or 'a model'} ({params:.3g} parameters): a snapshot of "
        f"{gb:.3g} GB\n({result['bytes_per_param']:.1f} bytes/parameter: fp32 weights and "
        "AdamW's two moments)\n\n"
        + table(["link (Gbit/s)", "copy time"], rows)
        + "\n\nThe copy has no deadline, only a stall one (10 s without a chunk); the donor "
        "keeps\ntraining and holds one copy of its state while it serves it."
    )
    return 0


def duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.1f} s"
    if seconds < 5400:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"
