"""Activation checkpointing: keep each block's input, recompute its insides in backward.

A transformer's training step holds every block's activations from forward to backward,
and sharding (``train.parallel = "fsdp"``) does not split them: a 201M GPT's FSDP rank held
0.61-0.64 of a DDP rank's memory with them, 0.54-0.58 without (BENCHMARKS.md).
``train.activation_checkpointing = true`` keeps only each block's input and runs the
block's forward again when backward reaches it: about one more forward per step (+20-35%
step time) for activations of one block at a time.

A block is every module of every ``nn.ModuleList`` (our GPT's ``blocks``, a Hugging Face
model's decoder layers): its ``forward`` is wrapped in place, so the parameters keep their
names (the fragment plan, checkpoints and peer copies are unchanged) and FSDP2's hooks on
the block still run around it. Non-reentrant ``torch.utils.checkpoint``, RNG state
preserved: the recomputed forward is the same computation, and the gradients are the same
values as without it (a unit test checks them bit for bit on CPU). Evaluation (no grad)
runs the forward as it is.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ddiloco.errors import ConfigError

MARK = "_ddiloco_recomputed"


def checkpoint_blocks(model: nn.Module) -> int:
    """Wrap every block's ``forward`` in an activation checkpoint (once: a block already
    wrapped is left alone); returns how many blocks are wrapped. Raises
    :class:`ConfigError` for a model with no ``nn.ModuleList`` of blocks."""
    blocks = [b for m in model.modules() if isinstance(m, nn.ModuleList) for b in m]
    if not blocks:
        why = f"{type(model).__name__} has no nn.ModuleList of blocks to recompute"
        raise ConfigError("train.activation_checkpointing", True, why)
    for block in blocks:
        if getattr(block, MARK, False):
            continue
        block.forward = _recomputed(block.forward)
        setattr(block, MARK, True)
    return len(blocks)


def _recomputed(forward: Any) -> Any:
    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():  # evaluation: nothing is saved for backward anyway
            return forward(*args, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    return run
