"""``ddiloco eval RUN_OR_CHECKPOINT [--data DIR_OR_TEXT]``: the global model's eval loss.

On the run's own held-out batches by default (the very batches the run evaluated on: the same
split, sequence length and count, so the loss of a run's last checkpoint is its final
``eval_loss``), or on the held-out split of another data source (``--data``: a text file or
directory, or a directory ``ddiloco data prepare`` wrote with the model's tokenizer). Prints
the loss in nats per token and in bits per byte (comparable across tokenizers), or ``--json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

from ddiloco.commands.export import add_source_arguments, open_model
from ddiloco.data.corpus import split_corpus
from ddiloco.data.info import bits_per_byte
from ddiloco.data.tokenizer import tokenizer_for
from ddiloco.errors import ConfigError
from ddiloco.runtime.run import make_eval_batches
from ddiloco.trainer import evaluate, sequence_length


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_source_arguments(parser, "RUN_OR_CHECKPOINT")
    parser.add_argument("--data", help="a data source (default: the run's own held-out split)")
    parser.add_argument("--batches", type=int, help="eval batches (default: the run's)")
    parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N (%(default)s)")
    parser.add_argument("--json", action="store_true", help="the result as one JSON object")


def run(args: argparse.Namespace) -> int:
    if args.batches is not None and args.batches < 1:
        raise ConfigError("--batches", args.batches, "must be >= 1")
    ckpt = open_model(args, args.device)
    config = ckpt.config
    data = config.data
    source = args.data or data.source
    if args.data is not None:  # the same tokens the model was trained on, or refuse
        theirs = tokenizer_for(source)
        if (theirs.name, theirs.vocab_size) != (ckpt.tokenizer.name, ckpt.tokenizer.vocab_size):
            why = (
                f"tokenized as {theirs.name} (vocab {theirs.vocab_size}), the model as "
                f"{ckpt.tokenizer.name} (vocab {ckpt.tokenizer.vocab_size})"
            )
            raise ConfigError("--data", source, why)
    data = dataclasses.replace(data, source=source, eval_batches=args.batches or data.eval_batches)
    config = dataclasses.replace(config, data=data)
    slots = config.train.learners + config.train.scavenged if args.data is None else 1
    splits = split_corpus(source, slots, data.eval_fraction)
    batches = make_eval_batches(config, splits, sequence_length(ckpt.model, config.train.seq_len))
    loss = evaluate(ckpt.model, batches)
    result = {
        "checkpoint": str(ckpt.path),
        "method": ckpt.method,
        "step": ckpt.step,
        "data": source,
        "batches": len(batches),
        "tokens": sum(int(y.numel()) for _, y in batches),
        "eval_loss": loss,
        "eval_bpb": bits_per_byte(loss, source),
    }
    if args.json:
        print(json.dumps(result))
    else:
        print(
            f"{ckpt.path}: eval loss {loss:.4f} nats/token, {result['eval_bpb']:.4f} bits/byte "
            f"on {source} ({result['batches']} batches, {result['tokens']:,} tokens)"
        )
    return 0
