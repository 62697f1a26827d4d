"""Data-parallel baseline on the simulated clock: one model, global batch = sum of learner
batches, synchronous. Each step takes as long as the slowest of the M replicas plus a ring
all-reduce of the full gradient (2(M-1)/M x model bytes per link).

Same model, data (the union of the learner shards), token budget and evaluation as the
Decoupled run, so the two compare side by side. This baseline runs failure-free: it is the
quality reference at equal tokens.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import torch

from ddiloco.config import RunConfig
from ddiloco.data.corpus import BatchStream, TokenSplits
from ddiloco.models.registry import build_model
from ddiloco.runtime.sim.learner import Trainer, evaluate, sequence_length
from ddiloco.runtime.sim.world import Network, StepTimes


def run_data_parallel(
    config: RunConfig,
    splits: TokenSplits,
    eval_batches: list[tuple[torch.Tensor, torch.Tensor]],
    emit: Callable[[dict[str, Any]], None],
) -> dict[str, Any]:
    t = config.train
    torch.manual_seed(config.seed)
    model = build_model(config.model)
    seq_len = sequence_length(model)
    stream = BatchStream(torch.cat(splits.shards), t.batch_size * t.learners, seq_len, config.seed)
    steps = max(1, t.tokens // (t.learners * t.batch_size * seq_len))
    trainer = Trainer(model, stream, t, steps)
    step_times = StepTimes(config.hardware, t.learners, random.Random(config.seed))
    network = Network(config.network)
    grad_bytes = sum(p.numel() * 4 for p in model.parameters())
    ring = 2 * (t.learners - 1) / t.learners * grad_bytes if t.learners > 1 else 0
    allreduce = network.seconds(int(ring), config.network.learner_syncer_gbps)
    now, tokens, next_eval = 0.0, 0, 0
    loss = evaluate(model, eval_batches)
    emit({"kind": "eval", "t": now, "tokens": tokens, "loss": loss})
    next_eval = t.eval_every
    bytes_sent = 0
    while tokens < t.tokens:
        now += max(step_times.sample(m) for m in range(t.learners)) + allreduce
        train_loss, n = trainer.train_step()
        tokens += n
        bytes_sent += int(ring) * t.learners
        emit({"kind": "step", "t": now, "learner": 0, "step": trainer.steps, "loss": train_loss})
        if tokens >= next_eval:
            loss = evaluate(model, eval_batches)
            emit({"kind": "eval", "t": now, "tokens": tokens, "loss": loss})
            next_eval = tokens + t.eval_every
    final = evaluate(model, eval_batches)
    emit({"kind": "eval", "t": now, "tokens": tokens, "loss": final})
    return {
        "method": "data_parallel",
        "eval_loss": final,
        "tokens": tokens,
        "tokens_merged": float(tokens),
        "tokens_wasted": {},
        "ledger_balanced": True,
        "goodput": 1.0,
        "uptime": 1.0,
        "virtual_seconds": now,
        "bytes_sent": bytes_sent,
        "bytes_received": bytes_sent,
        "bytes_per_token": 2 * bytes_sent / max(tokens, 1),
    }
