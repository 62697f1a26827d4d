"""A learner's inner training knobs: schedule, optimizer, gradient accumulation, precision."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from ddiloco.config import TrainConfig, load_config
from ddiloco.data.corpus import BatchStream
from ddiloco.models.gpt import GPT, GPT_CONFIGS
from ddiloco.runtime.run import RunSetup
from ddiloco.trainer import Trainer, learning_rate, sequence_length, uses_bf16


def trainer(**knobs: object) -> Trainer:
    torch.manual_seed(0)
    model = GPT(GPT_CONFIGS["gpt-tiny"])
    tokens = torch.randint(0, 256, (20_000,), generator=torch.Generator().manual_seed(1))
    config = dataclasses.replace(TrainConfig(), **knobs)  # type: ignore[arg-type]
    return Trainer(model, BatchStream(tokens, 4, 32, seed=3), config, total_steps=100)


@pytest.mark.parametrize("schedule", ["cosine", "linear", "constant"])
def test_schedules_warm_up_then_decay_to_their_floor(schedule):
    c = TrainConfig(lr=1.0, warmup_steps=10, schedule=schedule, min_lr_ratio=0.2)
    lrs = [learning_rate(c, s, 110) for s in range(0, 130)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert all(a <= b for a, b in itertools.pairwise(lrs[:10]))  # warming up
    tail = lrs[10:]
    assert all(a >= b for a, b in itertools.pairwise(tail))  # never rises again
    floor = 1.0 if schedule == "constant" else 0.2
    assert lrs[-1] == pytest.approx(floor)
    if schedule == "linear":
        assert lrs[60] == pytest.approx(0.2 + 0.8 * 0.5)


def test_default_schedule_is_the_cosine_to_ten_percent_it_always_was():
    c = TrainConfig(lr=3e-3, warmup_steps=20)
    assert learning_rate(c, 20, 120) == pytest.approx(3e-3)
    assert learning_rate(c, 70, 120) == pytest.approx(3e-3 * (0.1 + 0.9 * 0.5))
    assert learning_rate(c, 500, 120) == pytest.approx(3e-4)


def test_betas_and_eps_reach_adamw_and_sgd_is_nesterov_momentum():
    adamw = trainer(betas=(0.8, 0.99), eps=1e-6).optimizer
    assert isinstance(adamw, torch.optim.AdamW)
    assert adamw.defaults["betas"] == (0.8, 0.99) and adamw.defaults["eps"] == 1e-6
    sgd = trainer(optimizer="sgd", betas=(0.9, 0.95)).optimizer
    assert isinstance(sgd, torch.optim.SGD)
    assert sgd.defaults["momentum"] == 0.9 and sgd.defaults["nesterov"] is True


def test_grad_accum_trains_that_many_batches_in_one_step():
    one, three = trainer(), trainer(grad_accum=3)
    _, tokens_one = one.train_step()
    _, tokens_three = three.train_step()
    assert tokens_three == 3 * tokens_one == 3 * 4 * 32
    assert three.stream.position == 3 and three.steps == 1
    _, tokens = three.train_step(batches=2)  # the data-parallel baseline: M batches x accum
    assert tokens == 6 * tokens_one and three.stream.position == 9


def test_grad_accum_averages_the_gradient_of_its_micro_batches():
    """Two micro-batches of 4 give the gradient of the one batch of 8 they make up."""
    accum = trainer(grad_accum=2, grad_clip=0.0, lr=1e-3, warmup_steps=0)
    whole = trainer(grad_clip=0.0, lr=1e-3, warmup_steps=0)
    batches = [accum.stream.next(), accum.stream.next()]
    accum.stream.position = 0
    x = torch.cat([b[0] for b in batches])
    y = torch.cat([b[1] for b in batches])
    _, loss = whole.model(x, y)
    loss.backward()
    expected = {n: p.grad.clone() for n, p in whole.model.named_parameters()}
    accum.optimizer.step = lambda *a, **k: None  # type: ignore[method-assign] # keep the grads
    accum.train_step()
    for name, p in accum.model.named_parameters():
        torch.testing.assert_close(p.grad, expected[name], rtol=1e-4, atol=1e-6)


def test_precision_auto_is_fp32_on_cpu_and_bf16_autocasts_when_asked():
    cpu = torch.device("cpu")
    assert not uses_bf16("auto", cpu) and not uses_bf16("fp32", cpu) and uses_bf16("bf16", cpu)
    loss, _ = trainer(precision="bf16").train_step()
    assert loss == loss  # finite, trained under CPU bf16 autocast


def test_seq_len_overrides_the_models_context_and_counts_in_tokens_per_step():
    model = GPT(GPT_CONFIGS["gpt-tiny"])
    assert sequence_length(model) == 64 and sequence_length(model, 32) == 32
    assert sequence_length(torch.nn.Linear(2, 2)) == 128  # no context declared
    config = load_config(None, ["model=gpt-tiny", "train.seq_len=32", "train.grad_accum=2"])
    setup = RunSetup(config)
    assert setup.seq_len == 32 and setup.tokens_per_step == 8 * 2 * 32
