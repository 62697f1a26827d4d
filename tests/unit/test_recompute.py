"""Activation checkpointing (``train.activation_checkpointing``): the same gradients, the
same parameter names, one block's activations at a time."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from ddiloco.config import TrainConfig, load_config
from ddiloco.data.corpus import BatchStream
from ddiloco.errors import ConfigError
from ddiloco.models.gpt import GPT, GPT_CONFIGS
from ddiloco.models.recompute import checkpoint_blocks
from ddiloco.trainer import Trainer


def trained(recompute: bool, steps: int = 3) -> Trainer:
    torch.manual_seed(0)
    tokens = torch.randint(0, 256, (20_000,), generator=torch.Generator().manual_seed(1))
    config = dataclasses.replace(TrainConfig(), activation_checkpointing=recompute)
    trainer = Trainer(GPT(GPT_CONFIGS["gpt-tiny"]), BatchStream(tokens, 4, 32, seed=3), config, 100)
    for _ in range(steps):
        trainer.train_step()
    return trainer


def test_training_with_recomputed_blocks_is_the_same_bits_as_without():
    plain, recomputed = trained(False), trained(True)
    names = [n for n, _ in plain.model.named_parameters()]
    assert [n for n, _ in recomputed.model.named_parameters()] == names  # the plan's names
    for (n, a), b in zip(plain.model.named_parameters(), recomputed.model.parameters(),
                         strict=True):  # fmt: skip
        assert torch.equal(a, b), n
        assert torch.equal(plain.optimizer.state[a]["exp_avg_sq"],
                           recomputed.optimizer.state[b]["exp_avg_sq"]), n  # fmt: skip


def test_a_block_keeps_only_its_input_for_backward():
    """What is saved for backward shrinks: the point of it."""
    model = GPT(GPT_CONFIGS["gpt-tiny"])
    x = torch.randint(0, 256, (2, 64))

    def saved_bytes() -> int:
        total = [0]

        def pack(t: torch.Tensor) -> torch.Tensor:
            total[0] += t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(x, x)[1].backward()
        return total[0]

    before = saved_bytes()
    assert checkpoint_blocks(model) == len(model.blocks)
    assert checkpoint_blocks(model) == len(model.blocks)  # once: not wrapped twice
    assert saved_bytes() < before / 2
    with torch.no_grad():  # evaluation runs the forward as it is
        assert torch.isfinite(model(x, x)[1])


def test_a_model_without_blocks_is_refused_by_name():
    with pytest.raises(ConfigError, match=r"activation_checkpointing.*Linear"):
        checkpoint_blocks(nn.Linear(4, 4))


def test_the_config_takes_it_from_toml_and_the_command_line():
    assert load_config(None, ["train.activation_checkpointing=true"]).train.activation_checkpointing
    assert not load_config(None, []).train.activation_checkpointing
