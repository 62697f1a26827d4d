"""``ddiloco data prepare``: tokenize text into a directory ``data.source`` can point at.

Sources: ``shakespeare`` (built in), a text file of any suffix, a directory (every regular
file; binary ones skipped with a warning), a glob, ``.jsonl`` / ``.parquet`` files with a
text field, or a local Hugging Face dataset directory (``save_to_disk``). Output:
``train.bin``, ``val.bin``, ``meta.json`` and, unless the tokens are bytes, ``tokenizer.json``
(docs/data.md). Progress goes to stderr; the result's one-line summary to stdout.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ddiloco.data.prepare import Options, prepare


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="data_command", metavar="ACTION")
    p = sub.add_parser(
        "prepare",
        help="tokenize a corpus into train.bin / val.bin / meta.json (+ tokenizer.json)",
        description="Tokenize a corpus into a directory for data.source (docs/data.md).",
    )
    p.add_argument(
        "--source",
        required=True,
        help="shakespeare, a file, a directory, a glob, .jsonl/.parquet, or a saved HF dataset",
    )
    p.add_argument(
        "--tokenizer",
        default="bytes",
        help="bytes (default), bpe:VOCAB (train a byte-level BPE), or PATH/tokenizer.json",
    )
    p.add_argument("--text-field", default="text", help="jsonl/parquet/dataset text field")
    p.add_argument(
        "--eval-fraction",
        type=float,
        default=0.05,
        help="the last fraction of every document held out for evaluation (default 0.05)",
    )
    p.add_argument("--out", required=True, help="the directory to write (must be new or empty)")
    p.add_argument("--force", action="store_true", help="replace a non-empty --out")
    parser.set_defaults(data_parser=parser)


def run(args: argparse.Namespace) -> int:
    if args.data_command != "prepare":
        args.data_parser.print_help()
        return 2
    options = Options(
        source=args.source,
        out=Path(args.out),
        tokenizer=args.tokenizer,
        text_field=args.text_field,
        eval_fraction=args.eval_fraction,
        force=args.force,
    )
    meta = prepare(options)
    train, val = meta["train"], meta["val"]
    print(
        f"{options.out}: {meta['tokenizer']} tokens, vocab {meta['vocab_size']} "
        f"({meta['dtype']}), {meta['documents']:,} documents, train {train['tokens']:,} tokens "
        f"({train['text_bytes']:,} bytes), val {val['tokens']:,} tokens "
        f"({val['text_bytes']:,} bytes)"
    )
    print(f"train on it with: --set 'data.source=\"{options.out}\"'")
    return 0
