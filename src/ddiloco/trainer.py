"""One learner's real training: a model replica, AdamW, its data shard.

Time and the network are the runtime's business; this class only trains, evaluates and
copies state, so both clocks (the simulated engine and the learner processes) and the
data-parallel baseline (one replica fed the global batch) share it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from copy import deepcopy
from typing import Any

import torch
from torch import nn

from ddiloco.config import TrainConfig
from ddiloco.data.corpus import BatchStream
from ddiloco.models.recompute import checkpoint_blocks


def pick_device(name: str) -> torch.device:
    """The learner's device; falls back to CPU (with no surprise) only when asked for 'auto'."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


EVAL_FORWARD_TOKENS = 2048  # tokens per forward in an evaluation (its activations' size)
DEFAULT_SEQ_LEN = 128  # a model that declares no context trains on sequences this long

CONTEXT_FIELDS = ("block_size", "n_positions", "max_position_embeddings")


def model_context(model: nn.Module) -> int | None:
    """The model's context length, read from its ``config`` (ours: ``block_size``; Hugging
    Face: ``n_positions`` or ``max_position_embeddings``); None when it declares none."""
    config = getattr(model, "config", None)
    for name in CONTEXT_FIELDS:
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def sequence_length(model: nn.Module, seq_len: int = 0) -> int:
    """Training sequence length: ``train.seq_len`` when set, else the model's context, else
    ``DEFAULT_SEQ_LEN`` (the contract check refuses a seq_len beyond the context)."""
    return seq_len or model_context(model) or DEFAULT_SEQ_LEN


class Trainer:
    """A model, its inner optimizer and a batch stream."""

    def __init__(
        self, model: nn.Module, stream: BatchStream, config: TrainConfig, total_steps: int
    ) -> None:
        self.device = pick_device(config.device)
        self.model = model.to(self.device)
        if config.activation_checkpointing:
            checkpoint_blocks(model)
        self.stream = stream
        self.config = config
        self.total_steps = max(total_steps, 1)
        self.optimizer = self._new_optimizer()
        self.steps = 0
        self.amp = uses_bf16(config.precision, self.device)

    def _new_optimizer(self) -> torch.optim.Optimizer:
        c = self.config
        if c.optimizer == "sgd":
            momentum = c.betas[0]
            return torch.optim.SGD(
                self.model.parameters(),
                lr=c.lr,
                momentum=momentum,
                nesterov=momentum > 0,
                weight_decay=c.weight_decay,
            )
        return torch.optim.AdamW(
            self.model.parameters(),
            lr=c.lr,
            weight_decay=c.weight_decay,
            betas=(c.betas[0], c.betas[1]),
            eps=c.eps,
        )

    def reset_optimizer(self) -> None:
        """Fresh inner state (a learner restarting with no peer to copy from)."""
        self.optimizer = self._new_optimizer()

    def lr_at(self, step: int) -> float:
        """Linear warmup, then ``train.schedule`` over the planned steps (cosine or linear
        decay to ``min_lr_ratio`` of the peak, or constant)."""
        return learning_rate(self.config, step, self.total_steps)

    def train_step(self, batches: int = 1) -> tuple[float, int]:
        """One optimizer step on ``batches`` x ``train.grad_accum`` micro-batches (gradients
        averaged); (loss, tokens)."""
        self.model.train()
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr_at(self.steps)
        self.optimizer.zero_grad(set_to_none=True)
        total = 0.0
        batches *= self.config.grad_accum
        for _ in range(batches):
            x, y = self.stream.next()
            with torch.autocast(self.device.type, torch.bfloat16, enabled=self.amp):
                _, loss = self.model(x.to(self.device), y.to(self.device))
            assert loss is not None
            (loss / batches).backward()
            total += float(loss.detach()) / batches
        if self.config.grad_clip > 0:
            nn.utils.clip_grad_norm_(self.model.parameters(), self.config.grad_clip)
        self.optimizer.step()
        self.steps += 1
        return total, batches * self.stream.tokens_per_batch

    def params(self) -> dict[str, torch.Tensor]:
        return dict(self.model.named_parameters())

    def state(self, copy: bool = True) -> dict[str, Any]:
        """Everything a newcomer copies from a peer: weights, AdamW moments, step, data
        position. ``copy=False``: the live tensors (3x the parameters' bytes not copied), for
        a caller done with them before the next step (a save streamed to disk)."""
        model, optimizer = self.model.state_dict(), self.optimizer.state_dict()
        return {
            "model": deepcopy(model) if copy else model,
            "optimizer": deepcopy(optimizer) if copy else optimizer,
            "steps": self.steps,
            "position": self.stream.position,
        }

    def load_state(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.steps = int(state["steps"])
        self.stream.position = int(state["position"])

    def state_bytes(self) -> int:
        """Bytes a peer copy moves: parameters plus AdamW's two moments."""
        return 3 * sum(p.numel() * p.element_size() for p in self.model.parameters())


def learning_rate(config: TrainConfig, step: int, total_steps: int) -> float:
    """The inner learning rate at ``step`` of ``total_steps`` (warmup, then the schedule)."""
    c = config
    if step < c.warmup_steps:
        return c.lr * (step + 1) / c.warmup_steps
    if c.schedule == "constant":
        return c.lr
    progress = min(1.0, (step - c.warmup_steps) / max(1, total_steps - c.warmup_steps))
    shape = 0.5 * (1.0 + math.cos(math.pi * progress)) if c.schedule == "cosine" else 1 - progress
    return c.lr * (c.min_lr_ratio + (1.0 - c.min_lr_ratio) * shape)


def uses_bf16(precision: str, device: torch.device) -> bool:
    """Whether training autocasts to bf16: 'auto' on CUDA that supports it, 'bf16' always
    (the contract check refuses it where the device cannot), never for 'fp32'."""
    if precision == "auto":
        return device.type == "cuda" and torch.cuda.is_bf16_supported()
    return precision == "bf16"


@torch.no_grad()
def evaluate(
    model: nn.Module,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    hold: Callable[[], AbstractContextManager[Any]] = nullcontext,
) -> float:
    """Mean cross-entropy (nats/token) over fixed evaluation batches, each run through the
    model in slices of at most ``EVAL_FORWARD_TOKENS`` tokens: an evaluation's activations
    stay a training step's size, whatever the evaluation set (16 x 512 tokens at once were
    ~0.4 GB of a gpt-50m syncer's peak, issue 28). Slicing rows changes nothing but the
    order of the sums: each row's loss is its own. Each slice's forward runs inside
    ``hold()``: the syncer's in-place evaluation keeps merges out of a forward that way."""
    model.eval()
    device = next(model.parameters()).device
    total, count = 0.0, 0
    for x, y in batches:
        rows = max(1, EVAL_FORWARD_TOKENS // max(1, x.shape[-1]))
        for i in range(0, len(x), rows):
            xs, ys = x[i : i + rows], y[i : i + rows]
            with hold():
                _, loss = model(xs.to(device), ys.to(device))
            assert loss is not None
            total += float(loss) * ys.numel()
            count += ys.numel()
    return total / count
