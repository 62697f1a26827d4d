"""Your own loop over a model sharded with FSDP2: each rank of a learner holds half of a
Hugging Face causal LM (parameters, gradients, AdamW state), and answers the syncer with
its half of every fragment.

Under torchrun (``processes.ranks = 2``) every rank runs :func:`main`: it joins the ranks'
process group, builds a GPT-2 from a config built in code, shards it with
``fully_shard`` (each transformer block, then the rest) and trains it with its own loss and
loader (examples/own_loop.py's windows, each rank its own); ``ddiloco.Learner`` sees the
sharded parameters and works on this rank's rows of each fragment (docs/own_loop.md).

    pip install 'ddiloco[hf]'
    python examples/own_loop_fsdp.py [--tokens 300000] [--out runs/own-loop-fsdp] [--no-crash]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from own_loop import BATCH, CONTEXT, batches, lr_at, text_bytes
from torch.distributed.fsdp import fully_shard
from transformers import GPT2Config, GPT2LMHeadModel

import ddiloco


def build_model() -> GPT2LMHeadModel:
    shape = GPT2Config(vocab_size=256, n_positions=CONTEXT, n_embd=64, n_layer=2, n_head=2,
                       bos_token_id=0, eos_token_id=0)  # fmt: skip
    return GPT2LMHeadModel(shape)


def evaluate(model: GPT2LMHeadModel, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """The syncer's evaluation (``train.evaluate``): mean next-token loss, in nats."""
    model.eval()
    losses = [model(input_ids=x, labels=x).loss for x, _ in batches]
    return float(torch.stack(losses).mean())


def main() -> None:
    """One rank of one learner (``train.entry``)."""
    if not dist.is_initialized():  # (torchrun's environment: the learner's ranks)
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    model = build_model()
    for block in model.transformer.h:
        fully_shard(block)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    with ddiloco.Learner(model, optimizer) as learner:
        config = learner.config.train
        total = config.tokens // (config.learners * BATCH * CONTEXT * dist.get_world_size())
        start = learner.start()
        data = batches(text_bytes(), learner.id, config.learners, start.step, dist.get_rank())
        for step, (x, _) in enumerate(data):
            for group in optimizer.param_groups:
                group["lr"] = lr_at(start.step + step, total)
            loss = model(input_ids=x, labels=x).loss  # (GPT-2 shifts the labels)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if not learner.step(tokens=x.numel(), loss=loss.item()):
                break


def overrides(tokens: int, chaos: str = "[]") -> list[str]:
    """The run: 2 learners of 2 FSDP ranks each (this file's model, loop and evaluation)."""
    return [
        "runtime='processes'",
        "methods=['decoupled']",
        "model='own_loop_fsdp:build_model'",
        "train.entry='own_loop_fsdp:main'",
        "train.evaluate='own_loop_fsdp:evaluate'",
        "train.parallel='fsdp'",
        "processes.ranks=2",
        "train.learners=2",
        f"train.batch_size={BATCH}",
        f"train.seq_len={CONTEXT}",
        f"train.tokens={tokens}",
        f"train.eval_every={max(tokens // 3, 1)}",
        "sync.fragments=4",
        "sync.sync_every=8",
        "data.eval_batches=2",
        f"chaos={chaos}",
    ]


def run(argv: list[str] | None = None) -> list[dict]:
    """The whole run, and a syncer; learner 1 killed once it trained a while (its ranks
    copy learner 0's, rank by rank)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=300_000)
    parser.add_argument("--out", default="runs/own-loop-fsdp")
    parser.add_argument("--no-crash", action="store_true", help="no chaos")
    args = parser.parse_args(argv)
    chaos = "[]" if args.no_crash else "[{at=15.0, kind='crash', learner=1, duration=1.0}]"
    here = str(Path(__file__).resolve().parent)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)
    sys.path.insert(0, here)
    return ddiloco.train(None, args.out, overrides=overrides(args.tokens, chaos))


if __name__ == "__main__":
    for summary in run():
        print({k: summary.get(k) for k in ("method", "eval_loss", "tokens", "ledger_balanced")})
