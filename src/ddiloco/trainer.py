"""One learner's real training: a model replica, AdamW, its data shard.

Time and the network are the runtime's business; this class only trains, evaluates and
copies state, so both clocks (the simulated engine and the learner processes) and the
data-parallel baseline (one replica fed the global batch) share it.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import torch
from torch import nn

from ddiloco.config import TrainConfig
from ddiloco.data.corpus import BatchStream


def pick_device(name: str) -> torch.device:
    """The learner's device; falls back to CPU (with no surprise) only when asked for 'auto'."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def sequence_length(model: nn.Module) -> int:
    """Training sequence length: the model's context (``config.block_size``), else 128."""
    config = getattr(model, "config", None)
    return int(getattr(config, "block_size", 128))


class Trainer:
    """A model, its inner optimizer and a batch stream."""

    def __init__(
        self, model: nn.Module, stream: BatchStream, config: TrainConfig, total_steps: int
    ) -> None:
        self.device = pick_device(config.device)
        self.model = model.to(self.device)
        self.stream = stream
        self.config = config
        self.total_steps = max(total_steps, 1)
        self.optimizer = self._new_optimizer()
        self.steps = 0
        self.amp = self.device.type == "cuda" and torch.cuda.is_bf16_supported()

    def _new_optimizer(self) -> torch.optim.Optimizer:
        c = self.config
        return torch.optim.AdamW(
            self.model.parameters(), lr=c.lr, weight_decay=c.weight_decay, betas=(0.9, 0.95)
        )

    def reset_optimizer(self) -> None:
        """Fresh inner state (a learner restarting with no peer to copy from)."""
        self.optimizer = self._new_optimizer()

    def lr_at(self, step: int) -> float:
        """Linear warmup, then cosine decay to 10% over the planned steps."""
        c = self.config
        if step < c.warmup_steps:
            return c.lr * (step + 1) / c.warmup_steps
        progress = min(1.0, (step - c.warmup_steps) / max(1, self.total_steps - c.warmup_steps))
        return c.lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))

    def train_step(self, batches: int = 1) -> tuple[float, int]:
        """One optimizer step on ``batches`` batches (gradients averaged); (loss, tokens)."""
        self.model.train()
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr_at(self.steps)
        self.optimizer.zero_grad(set_to_none=True)
        total = 0.0
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

    def state(self) -> dict[str, Any]:
        """Everything a newcomer copies from a peer: weights, AdamW moments, step, data position."""
        return {
            "model": copy.deepcopy(self.model.state_dict()),
            "optimizer": copy.deepcopy(self.optimizer.state_dict()),
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


@torch.no_grad()
def evaluate(model: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """Mean cross-entropy (nats/token) over fixed evaluation batches."""
    model.eval()
    device = next(model.parameters()).device
    total, count = 0.0, 0
    for x, y in batches:
        _, loss = model(x.to(device), y.to(device))
        assert loss is not None
        total += float(loss) * y.numel()
        count += y.numel()
    return total / count
