"""The Hugging Face ``Trainer`` as a Decoupled DiLoCo learner: a ``TrainerCallback`` that
drives ``ddiloco.Learner``.

The Trainer keeps its loop, its optimizer and its scheduler; the callback makes the
Learner around the model and the Trainer's optimizer when training begins, calls
``learner.step`` after every optimizer step (the Trainer stops when it returns False) and
closes it at the end. A learner that restarts copies a healthy peer's model, AdamW state
and step in ``start``; the callback then moves the Trainer's LR schedule to that step (the
Trainer's own step counter starts at 0 in a restarted process, its schedule must not).

The model is a GPT-2 from a config built in code (byte-level, ~0.1M parameters); the data
is examples/own_loop.py's (a shard of the plays per learner); the syncer evaluates the global
model with :func:`evaluate` (``train.evaluate``: a GPT-2 returns a ``ModelOutput``, not
ddiloco's ``(logits, loss)``).

    pip install 'ddiloco[hf]'   # transformers, accelerate
    python examples/hf_trainer.py [--tokens 150000] [--out runs/hf-trainer]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

import torch
from own_loop import BATCH, CONTEXT, batches, text_bytes
from torch.utils.data import IterableDataset
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

import ddiloco


def build_model() -> GPT2LMHeadModel:
    shape = GPT2Config(
        vocab_size=256,
        n_positions=CONTEXT,
        n_embd=64,
        n_layer=2,
        n_head=2,
        bos_token_id=0,
        eos_token_id=0,
    )
    return GPT2LMHeadModel(shape)


def evaluate(model: GPT2LMHeadModel, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """Mean next-token cross-entropy over the run's evaluation batches (``train.evaluate``)."""
    model.eval()
    losses = []
    for x, y in batches:
        logits = model(input_ids=x).logits
        losses.append(torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten()))
    return float(torch.stack(losses).mean())


class Windows(IterableDataset):
    """This learner's shard as Trainer examples (GPT-2 shifts ``labels`` itself)."""

    def __init__(self, shard: int, shards: int) -> None:
        self.shard, self.shards = shard, shards

    def __iter__(self) -> Any:
        for x, _ in batches(text_bytes(), self.shard, self.shards, skip=0):
            for row in range(len(x)):
                yield {"input_ids": x[row], "labels": x[row]}


class DDiLoCoCallback(TrainerCallback):
    """Drives a ``ddiloco.Learner`` from the Trainer's events."""

    def __init__(self, tokens_per_step: int) -> None:
        self.tokens_per_step = tokens_per_step
        self.learner: Any = None

    def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self.learner = ddiloco.Learner(kw["model"], kw["optimizer"])
        start = self.learner.start()
        scheduler = kw.get("lr_scheduler")
        if start.step and scheduler is not None:  # the schedule at the step we start from
            scheduler.last_epoch = start.step - 1
            scheduler.step()

    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if not self.learner.step(tokens=self.tokens_per_step):
            control.should_training_stop = True

    def on_train_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self.learner.close()


def main() -> None:
    """One learner (``train.entry``): the Trainer with the ddiloco callback."""
    model = build_model()
    learner = int(os.environ["DDILOCO_LEARNER"])  # (the Learner checks it too)
    shards = int(os.environ.get("DDILOCO_SHARDS", "2"))
    arguments = TrainingArguments(
        output_dir=os.environ.get("DDILOCO_STATE_DIR", "runs/hf-trainer-learner"),
        per_device_train_batch_size=BATCH,
        learning_rate=3e-3,
        lr_scheduler_type="cosine",
        warmup_steps=20,
        max_steps=10**9 // (BATCH * CONTEXT),  # ddiloco's budget stops it first
        weight_decay=0.1,
        max_grad_norm=1.0,
        use_cpu=not torch.cuda.is_available(),
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    trainer = Trainer(
        model=model,
        args=arguments,
        train_dataset=Windows(learner, shards),
        callbacks=[DDiLoCoCallback(BATCH * CONTEXT)],
    )
    trainer.train()


def run(argv: list[str] | None = None) -> list[dict]:
    """The whole run as learner processes and a syncer."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=150_000)
    parser.add_argument("--learners", type=int, default=2)
    parser.add_argument("--out", default="runs/hf-trainer")
    args = parser.parse_args(argv)
    here = str(Path(__file__).resolve().parent)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)
    os.environ["DDILOCO_SHARDS"] = str(args.learners)
    sys.path.insert(0, here)
    overrides = [
        "runtime='processes'",
        "methods=['decoupled']",
        "model='hf_trainer:build_model'",
        "train.entry='hf_trainer:main'",
        "train.evaluate='hf_trainer:evaluate'",
        f"train.learners={args.learners}",
        f"train.batch_size={BATCH}",
        f"train.seq_len={CONTEXT}",
        f"train.tokens={args.tokens}",
        f"train.eval_every={max(args.tokens // 3, 1)}",
        "sync.fragments=4",
        "sync.sync_every=8",
        "data.eval_batches=2",
        "chaos=[]",
    ]
    return ddiloco.train(None, args.out, overrides=overrides)


if __name__ == "__main__":
    for summary in run():
        print({k: summary.get(k) for k in ("method", "eval_loss", "tokens", "ledger_balanced")})
