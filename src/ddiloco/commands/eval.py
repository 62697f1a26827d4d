"""``ddiloco eval RUN_OR_CHECKPOINT [--data SOURCE]``: the global model's eval loss.

On the run's own held-out batches by default (the very batches the run evaluated on: the same
split, sequence length and count, so the loss of a run's last checkpoint is its final
``eval_loss``). With ``--data``, on every token of the text named: raw text (a file, a
directory, a glob...) is tokenized with the checkpoint's own tokenizer (its tokenizer.json,
else bytes) and evaluated whole (``--held-out``: only the last ``data.eval_fraction`` of
every document, as a run holds it out), a directory ``ddiloco data prepare`` wrote with the
model's tokenizer on its held-out file (``val.bin``), both bounded by ``--max-tokens``.
Prints the loss in nats per token and in bits per byte (comparable across tokenizers), and
how many tokens of what, or ``--json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from typing import Any

from torch import nn

from ddiloco.checkpoints.load import Checkpoint
from ddiloco.commands.export import add_source_arguments, open_model
from ddiloco.data.corpus import split_corpus
from ddiloco.data.encode import Encoded, encode_text, every_window, held_out_file, predictions
from ddiloco.data.info import bits_per_byte
from ddiloco.data.tokenizer import same_vocabulary, tokenizer_for
from ddiloco.data.tokens import FILES, is_prepared, looks_unprepared
from ddiloco.errors import ConfigError, require
from ddiloco.runtime.run import EVAL_BATCH_SIZE, make_eval_batches
from ddiloco.trainer import evaluate, sequence_length


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_source_arguments(parser, "RUN_OR_CHECKPOINT")
    parser.add_argument(
        "--data",
        metavar="SOURCE",
        help="evaluate on every token of this text instead of the run's held-out batches: a "
        "file, directory, glob, .jsonl/.parquet or saved dataset, tokenized with the "
        "checkpoint's tokenizer; or a directory `data prepare` wrote with it (its val.bin)",
    )
    parser.add_argument(
        "--held-out",
        action="store_true",
        help="with --data raw text: only the last data.eval_fraction of every document (the "
        "part a run on that text holds out)",
    )
    parser.add_argument(
        "--max-tokens",
        type=int,
        metavar="N",
        help="with --data: evaluate at most this many tokens, the first ones (default: all)",
    )
    parser.add_argument(
        "--batches",
        type=int,
        metavar="N",
        help=f"batches of {EVAL_BATCH_SIZE} sequences (default: the run's data.eval_batches; "
        "with --data: as many as the text fills)",
    )
    parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N (%(default)s)")
    parser.add_argument("--json", action="store_true", help="the result as one JSON object")


def run(args: argparse.Namespace) -> int:
    for name in ("batches", "max_tokens"):
        value = getattr(args, name)
        require(value is None or value >= 1, f"--{name.replace('_', '-')}", value, "must be >= 1")
    if args.data is None and (args.max_tokens is not None or args.held_out):
        flag = "--max-tokens" if args.max_tokens is not None else "--held-out"
        value = args.max_tokens if args.max_tokens is not None else True
        why = "applies to --data (the run's own held-out batches are bounded by --batches)"
        raise ConfigError(flag, value, why)
    ckpt = open_model(args, args.device)
    result = own_held_out(ckpt, args) if args.data is None else on_data(ckpt, args)
    said = result.pop("said")
    result = {"checkpoint": str(ckpt.path), "method": ckpt.method, "step": ckpt.step, **result}
    if args.json:
        print(json.dumps(result))
    else:
        print(
            f"{ckpt.path}: eval loss {result['eval_loss']:.4f} nats/token, "
            f"{result['eval_bpb']:.4f} bits/byte on {said}"
        )
    return 0


def own_held_out(ckpt: Checkpoint, args: argparse.Namespace) -> dict[str, Any]:
    """The run's own held-out batches: the split, sequence length and count it evaluated."""
    config = ckpt.config
    data = dataclasses.replace(config.data, eval_batches=args.batches or config.data.eval_batches)
    config = dataclasses.replace(config, data=data)
    slots = config.train.learners + config.train.scavenged
    splits = split_corpus(data.source, slots, data.eval_fraction)
    batches = make_eval_batches(config, splits, sequence_length(ckpt.model, config.train.seq_len))
    loss = evaluate(ckpt.model, batches)
    tokens = sum(int(y.numel()) for _, y in batches)
    return {
        "data": data.source,
        "what": "the run's held-out batches",
        "batches": len(batches),
        "tokens": tokens,
        "eval_loss": loss,
        "eval_bpb": bits_per_byte(loss, data.source),
        "said": f"{tokens:,} tokens: the run's held-out batches of {data.source} "
        f"({len(batches)} batches)",
    }


def on_data(ckpt: Checkpoint, args: argparse.Namespace) -> dict[str, Any]:
    """Every token of ``--data`` (up to the bounds), with the checkpoint's tokenizer."""
    source, tokenizer = args.data, ckpt.tokenizer
    seq_len = sequence_length(ckpt.model, ckpt.config.train.seq_len)
    limit = args.max_tokens
    if args.batches is not None:
        bound = args.batches * EVAL_BATCH_SIZE * seq_len
        limit = bound if limit is None else min(limit, bound)
    if is_prepared(source):
        theirs = tokenizer_for(source)  # the same tokens the model was trained on, or refuse
        if not same_vocabulary(theirs, tokenizer):
            other = (
                " (another tokenizer.json of that size)" if theirs.name == tokenizer.name else ""
            )
            why = (
                f"tokenized as {theirs.name} (vocab {theirs.vocab_size}){other}, the model as "
                f"{tokenizer.name} (vocab {tokenizer.vocab_size}): give the raw text instead "
                "(it is tokenized with the model's tokenizer)"
            )
            raise ConfigError("--data", source, why)
        encoded = held_out_file(source)
        part, of = f"the held-out split ({FILES['val']})", f" of {source}"
        extent = f"{encoded.text_bytes:,} bytes of text"
        how = "prepared with the checkpoint's tokenizer"
    elif looks_unprepared(source):
        why = f"has {FILES['train']} but no meta.json: write one with `ddiloco data prepare`"
        raise ConfigError("--data", source, why)
    else:
        fraction = ckpt.config.data.eval_fraction if args.held_out else None
        encoded = encode_text(source, tokenizer, held_out=fraction, limit=limit)
        part = f"the last {fraction * 100:g}% of every document" if fraction else "all"
        of = f" of {source}"
        plural = "s" if encoded.documents != 1 else ""
        extent = f"{encoded.documents:,} document{plural}, {encoded.text_bytes:,} bytes"
        how = (
            "tokenized as bytes, as the checkpoint was"
            if tokenizer.name == "bytes"
            else f"tokenized with the checkpoint's tokenizer.json (vocab {tokenizer.vocab_size})"
        )
    count = predictions(encoded.tokens, limit)
    loss, batches = _evaluate(ckpt.model, encoded, seq_len, limit)
    complete = count == predictions(encoded.tokens) and encoded.complete
    if not complete:  # (the bytes read may hold more text than the tokens evaluated: not said)
        bound = ("--max-tokens", args.max_tokens)
        if limit != args.max_tokens:
            bound = ("--batches", args.batches)
        part = f"the first {count:,}" + ("" if part == "all" else f" of {part}")
        extent = f"{bound[0]} {bound[1]}"
    what = f"{part}{of}"
    return {
        "data": source,
        "what": what,
        "batches": batches,
        "tokens": count,
        "complete": complete,
        "text_bytes": encoded.text_bytes,
        "eval_loss": loss,
        "eval_bpb": loss / math.log(2) * encoded.tokens_per_byte,
        "said": f"{count:,} tokens: {what} ({extent}), {how}; {batches} batches of {seq_len}-token "
        "windows",
    }


def _evaluate(
    model: nn.Module, encoded: Encoded, seq_len: int, limit: int | None
) -> tuple[float, int]:
    """The mean loss over every window, a batch at a time (memory: one batch, whatever the
    text's size); and how many batches."""
    total, count, batches = 0.0, 0, 0
    for x, y in every_window(encoded.tokens, seq_len, EVAL_BATCH_SIZE, limit):
        total += evaluate(model, [(x, y)]) * y.numel()
        count += y.numel()
        batches += 1
    return total / count, batches
