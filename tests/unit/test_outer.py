"""Outer optimizers against torch's own SGD, and their state round trip."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ddiloco.core.outer import OuterConfig, make_outer_optimizer
from ddiloco.errors import ConfigError


def _grads(steps: int, shapes: list[tuple[int, ...]], seed: int) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(s, generator=g) for s in shapes] for _ in range(steps)]


@settings(max_examples=30, deadline=None)
@given(
    lr=st.floats(0.05, 1.5),
    momentum=st.floats(0.0, 0.95),
    steps=st.integers(1, 8),
    seed=st.integers(0, 10_000),
)
def test_nesterov_matches_torch_sgd(lr, momentum, steps, seed):
    shapes = [(5, 3), (7,)]
    grads = _grads(steps, shapes, seed)
    ours = [torch.randn(s, generator=torch.Generator().manual_seed(seed + 1)) for s in shapes]
    theirs = [p.clone().requires_grad_(True) for p in ours]
    reference = torch.optim.SGD(theirs, lr=lr, momentum=momentum, nesterov=momentum > 0)
    opt = make_outer_optimizer(OuterConfig("nesterov", lr=lr, momentum=momentum))
    for g in grads:
        for p, gi in zip(theirs, g, strict=True):
            p.grad = gi.clone()
        opt.step(ours, g)
        reference.step()
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b.detach(), rtol=0, atol=0)


def test_plain_sgd_with_lr_one_is_averaging():
    theta = [torch.tensor([1.0, 2.0])]
    make_outer_optimizer(OuterConfig("sgd", lr=1.0)).step(theta, [torch.tensor([0.5, -1.0])])
    torch.testing.assert_close(theta[0], torch.tensor([0.5, 3.0]))


def test_delayed_nesterov_with_delay_one_is_nesterov():
    grads = _grads(6, [(4, 4)], seed=3)
    a = [torch.zeros(4, 4)]
    b = [torch.zeros(4, 4)]
    dn = make_outer_optimizer(OuterConfig("delayed_nesterov", lr=0.7, momentum=0.9, delay=1))
    nest = make_outer_optimizer(OuterConfig("nesterov", lr=0.7, momentum=0.9))
    for g in grads:
        dn.step(a, [x.clone() for x in g])
        nest.step(b, [x.clone() for x in g])
    torch.testing.assert_close(a[0], b[0], rtol=1e-5, atol=1e-6)


def test_delayed_nesterov_refreshes_momentum_every_delay_steps():
    opt = make_outer_optimizer(OuterConfig("delayed_nesterov", lr=1.0, momentum=0.5, delay=2))
    theta = [torch.zeros(1)]
    opt.step(theta, [torch.ones(1)])  # interim: -c*g with c = 1/2
    torch.testing.assert_close(theta[0], torch.tensor([-0.5]))
    opt.step(theta, [torch.ones(1)])  # refresh: buf = mean(g) = 1; -c*g - mu*buf
    torch.testing.assert_close(theta[0], torch.tensor([-0.5 - 0.5 - 0.5]))


@pytest.mark.parametrize("name", ["nesterov", "sgd", "delayed_nesterov"])
def test_state_dict_round_trip_continues_identically(name):
    cfg = OuterConfig(name, lr=0.5, momentum=0.9, delay=3)
    grads = _grads(7, [(3, 2)], seed=5)
    a, b = [torch.zeros(3, 2)], [torch.zeros(3, 2)]
    first, second = make_outer_optimizer(cfg), make_outer_optimizer(cfg)
    for g in grads[:4]:
        first.step(a, [x.clone() for x in g])
        second.step(b, [x.clone() for x in g])
    restored = make_outer_optimizer(cfg)
    restored.load_state_dict(second.state_dict())
    for g in grads[4:]:
        first.step(a, [x.clone() for x in g])
        restored.step(b, [x.clone() for x in g])
    torch.testing.assert_close(a[0], b[0], rtol=0, atol=0)


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"name": "adam"}, "outer.name"),
        ({"lr": 0.0}, "outer.lr"),
        ({"momentum": 1.0}, "outer.momentum"),
        ({"delay": 0}, "outer.delay"),
        ({"interim_scale": 2.0}, "outer.interim_scale"),
    ],
)
def test_bad_config_names_the_field(kwargs, field):
    with pytest.raises(ConfigError, match=field):
        OuterConfig(**kwargs)


def test_mismatched_shapes_and_dtypes_are_refused():
    opt = make_outer_optimizer(OuterConfig())
    with pytest.raises(ConfigError, match=r"grads\[0\].shape"):
        opt.step([torch.zeros(3)], [torch.zeros(4)])
    with pytest.raises(ConfigError, match="grads"):
        opt.step([torch.zeros(3)], [])
    with pytest.raises(ConfigError, match=r"params\[0\].dtype"):
        opt.step([torch.zeros(3, dtype=torch.bfloat16)], [torch.zeros(3)])


# -- the outer momentum following the inner learning-rate schedule (scale) ----------------------
def _steps(name: str, scales: list[float], grads: list[float], momentum: float = 0.9):
    opt = make_outer_optimizer(OuterConfig(name, lr=0.5, momentum=momentum))
    theta = [torch.zeros(3)]
    out = []
    for s, g in zip(scales, grads, strict=True):
        opt.step(theta, [torch.full((3,), g)], s)
        out.append(theta[0].clone())
    return out


@pytest.mark.parametrize("name", ["nesterov", "delayed_nesterov"])
def test_a_constant_scale_or_no_momentum_is_the_plain_step(name):
    grads = [1.0, -0.5, 2.0, 0.25]
    plain = _steps(name, [1.0] * 4, grads)
    for a, b in zip(_steps(name, [0.3] * 4, grads), plain, strict=True):
        assert torch.allclose(a, b, atol=1e-6)  # the buffer's units cancel
    for a, b in zip(
        _steps(name, [1.0, 0.1, 0.5, 0.2], grads, 0.0),
        _steps(name, [1] * 4, grads, 0.0),
        strict=True,
    ):
        assert torch.allclose(a, b, atol=1e-6)


def test_a_decaying_scale_shrinks_the_momentum_of_the_peak_by_hand():
    # step 1 at the peak (s = 1), step 2 at half the learning rate (s = 0.5), mu 0.9, lr 0.5:
    # buf = 0.9 * g1 + g2 / 0.5; update 2 = lr * (g2 + 0.9 * 0.5 * buf)
    g1, g2 = 1.0, 0.5
    first, second = _steps("nesterov", [1.0, 0.5], [g1, g2])
    assert torch.allclose(first, torch.full((3,), -0.5 * (g1 + 0.9 * g1)))
    buf = 0.9 * g1 + g2 / 0.5
    assert torch.allclose(second - first, torch.full((3,), -0.5 * (g2 + 0.9 * 0.5 * buf)))


@pytest.mark.parametrize("scale", [0.0, -1.0, float("nan"), float("inf")])
def test_an_impossible_scale_is_refused(scale):
    opt = make_outer_optimizer(OuterConfig("nesterov"))
    with pytest.raises(ConfigError, match="scale"):
        opt.step([torch.zeros(2)], [torch.ones(2)], scale)


def test_a_rounds_scale_is_the_weighted_mean_factor_of_the_steps_its_answers_cover():
    from ddiloco.core.rounds import AnswerMeta
    from ddiloco.core.syncer_state import schedule_scale

    def answer(local_step: int, c_steps: int) -> AnswerMeta:
        return AnswerMeta(0, 0, 0, 0, 0, 0, local_step, c_steps, 10 * c_steps)

    def factor(step: int) -> float:
        return 1.0 if step < 10 else 0.5

    a, b = answer(10, 4), answer(14, 4)  # steps 6-9 (factor 1), steps 10-13 (factor 0.5)
    assert schedule_scale(factor, [a], [1.0]) == 1.0
    assert schedule_scale(factor, [a, b], [1.0, 3.0]) == pytest.approx((1.0 + 3 * 0.5) / 4)
    assert schedule_scale(factor, [answer(12, 4)], [1.0]) == pytest.approx(0.75)
    assert schedule_scale(None, [a], [1.0]) == 1.0 and schedule_scale(factor, [a], [0.0]) == 1.0
    assert schedule_scale(lambda s: 0.0, [a], [1.0]) > 0.0  # never a division by zero
    long = answer(100_000, 100_000)  # a delta of many steps is sampled, not summed step by step
    assert schedule_scale(lambda s: 1.0, [long], [1.0]) == 1.0


def test_a_whole_period_is_the_plain_step_and_no_period_pushes_no_momentum():
    # fraction 1 is the rule of every other test, bit for bit
    g1, g2 = 1.0, 0.5
    whole = make_outer_optimizer(OuterConfig("nesterov", lr=0.5, momentum=0.9))
    plain = make_outer_optimizer(OuterConfig("nesterov", lr=0.5, momentum=0.9))
    a, b = torch.zeros(3), torch.zeros(3)
    for g in (g1, g2):
        whole.step([a], [torch.full((3,), g)], 1.0, 1.0)
        plain.step([b], [torch.full((3,), g)])
    assert torch.equal(a, b)
    # fraction 0 (a final round): the buffer takes the gradient undecayed, the step is lr * g
    opt = make_outer_optimizer(OuterConfig("nesterov", lr=0.5, momentum=0.9))
    theta = torch.zeros(3)
    opt.step([theta], [torch.full((3,), g1)])
    before = theta.clone()
    opt.step([theta], [torch.full((3,), g2)], 1.0, 0.0)
    assert torch.allclose(theta - before, torch.full((3,), -0.5 * g2))
    assert torch.allclose(opt.state_dict()["buffers"][0], torch.full((3,), g1 + g2))


def test_half_a_period_decays_the_momentum_by_its_square_root_and_pushes_half():
    # buf = mu^0.5 * g1 + g2; update 2 = lr * (g2 + mu * 0.5 * buf)
    opt = make_outer_optimizer(OuterConfig("nesterov", lr=0.5, momentum=0.9))
    theta = torch.zeros(2)
    opt.step([theta], [torch.ones(2)])
    before = theta.clone()
    opt.step([theta], [torch.full((2,), 0.5)], 1.0, 0.5)
    buf = 0.9**0.5 * 1.0 + 0.5
    assert torch.allclose(theta - before, torch.full((2,), -0.5 * (0.5 + 0.9 * 0.5 * buf)))


@pytest.mark.parametrize("fraction", [-0.1, 1.5, float("nan")])
def test_an_impossible_fraction_is_refused(fraction):
    opt = make_outer_optimizer(OuterConfig("nesterov"))
    with pytest.raises(ConfigError, match="fraction"):
        opt.step([torch.zeros(2)], [torch.ones(2)], 1.0, fraction)


def test_no_momentum_keeps_no_buffer_and_a_saved_one_is_not_loaded():
    """mu = 0 (Decoupled's default outer step) holds no copy of the model beside it."""
    opt = make_outer_optimizer(OuterConfig("nesterov", lr=1.0, momentum=0.0))
    theta = [torch.zeros(4)]
    opt.step(theta, [torch.ones(4)], scale=0.5, fraction=0.25)  # (nothing for them to scale)
    assert torch.equal(theta[0], -torch.ones(4))
    assert opt.state_dict() == {"steps": 1, "buffers": None}
    opt.load_state_dict({"steps": 3, "buffers": [torch.ones(4)]})
    assert opt.state_dict() == {"steps": 3, "buffers": None}


def test_a_momentum_warmup_ramps_mu_from_zero_and_is_plain_nesterov_after_it():
    """``warmup = W``: the k-th outer step (from 0) uses mu k / W, then mu; W = 0 is plain."""
    g = [torch.tensor([1.0, -2.0])]
    warm = make_outer_optimizer(OuterConfig("nesterov", lr=0.5, momentum=0.9, warmup=2))
    plain = make_outer_optimizer(OuterConfig("nesterov", lr=0.5, momentum=0.9))
    p_warm, p_plain = [torch.zeros(2)], [torch.zeros(2)]
    buf = torch.zeros(2)
    want = torch.zeros(2)
    for k in range(4):
        mu = 0.9 * min(1.0, k / 2)
        buf = g[0].clone() if k == 0 else buf * mu + g[0]
        want -= 0.5 * (g[0] + mu * buf)
        warm.step(p_warm, [t.clone() for t in g])
        plain.step(p_plain, [t.clone() for t in g])
        torch.testing.assert_close(p_warm[0], want)
    assert not torch.allclose(p_warm[0], p_plain[0])  # (the plain one pushed harder early)
    with pytest.raises(ConfigError, match=r"outer\.warmup"):
        OuterConfig(warmup=-1)
