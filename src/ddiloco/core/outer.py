"""Outer optimizers: apply a merged outer gradient to one fragment's global parameters.

One optimizer instance per fragment, state in fp32 on the syncer whatever the wire dtype.
The outer gradient is Delta = Theta_base - theta_learner (so a step *subtracts* it). The
state is plain tensors and ints, saved and restored with ``state_dict`` so a syncer can be
killed and restarted without losing momentum.

``step`` takes a ``scale``: the inner learning-rate factor (lr / peak lr) of the steps the
outer gradient covers (1.0 when the outer step does not follow the schedule). An outer
gradient is a sum of inner steps, so it shrinks with the inner learning rate; momentum kept
on it raw holds the large deltas of the peak while the schedule decays, and keeps pushing
with them after the direction has changed (the divergence of docs/decisions.md 69). The
momentum optimizers therefore keep their buffer in peak-lr units (Delta / scale) and apply
it at the current scale: ``buf <- mu buf + Delta / s; Theta <- Theta - lr (Delta + mu s buf)``.
With s = 1 it is plain Nesterov, bit for bit; with mu = 0 the scale changes nothing.

``step`` also takes a ``fraction``: the share of a sync period (H inner steps of the run)
the outer step covers, in [0, 1]. Momentum is a velocity per period, so an outer step that
comes sooner than a period after the fragment's previous one (the final rounds at the end
of a wall-clock run, which merge what was trained since the last round) must not push by a
whole period's velocity: the buffer decays by mu^f and pushes mu f s buf
(docs/decisions.md 73). With f = 1 it is the rule above, bit for bit.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ddiloco.errors import ConfigError, require

OUTER_OPTIMIZERS = ("nesterov", "sgd", "delayed_nesterov")
Tensors = Sequence[torch.Tensor]


@dataclass(frozen=True)
class OuterConfig:
    """Outer-optimizer settings. Defaults: RDA's eta 0.5, mu 0.9 (docs/design.md §3.9)."""

    name: str = "nesterov"
    lr: float = 0.5
    momentum: float = 0.9
    delay: int = 1  # delayed_nesterov: momentum refresh every ``delay`` outer steps
    interim_scale: float | None = None  # delayed_nesterov: c, default 1/delay
    warmup: int = 0  # nesterov: momentum ramps from 0 to ``momentum`` over this many steps
    warmup_lr: bool = False  # ... and the rate from 1 (the merged delta as it is) to ``lr``

    def __post_init__(self) -> None:
        require(
            self.name in OUTER_OPTIMIZERS,
            "outer.name",
            self.name,
            f"unknown outer optimizer; known: {', '.join(OUTER_OPTIMIZERS)}",
        )
        require(self.lr > 0.0, "outer.lr", self.lr, "must be > 0")
        require(0.0 <= self.momentum < 1.0, "outer.momentum", self.momentum, "must be in [0, 1)")
        require(self.delay >= 1, "outer.delay", self.delay, "must be >= 1")
        require(self.warmup >= 0, "outer.warmup", self.warmup, "must be >= 0")
        if self.interim_scale is not None:
            require(
                0.0 <= self.interim_scale <= 1.0,
                "outer.interim_scale",
                self.interim_scale,
                "must be in [0, 1]",
            )


class OuterOptimizer(Protocol):
    """What the syncer needs from an outer optimizer for one fragment.

    ``step`` consumes ``grads``: it may use them as scratch space (the syncer hands over its
    merge workspace, so the step needs no fresh allocation).
    """

    def step(
        self, params: Tensors, grads: Tensors, scale: float = 1.0, fraction: float = 1.0
    ) -> None: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def _check(params: Tensors, grads: Tensors, scale: float, fraction: float) -> None:
    """One outer gradient per parameter, of its shape; fp32 parameters; a sane scale and
    fraction."""
    if not (math.isfinite(scale) and scale > 0.0):
        raise ConfigError("scale", scale, "the inner learning-rate factor must be finite and > 0")
    if not 0.0 <= fraction <= 1.0:
        raise ConfigError("fraction", fraction, "the share of a sync period must be in [0, 1]")
    if len(params) != len(grads):
        raise ConfigError("grads", len(grads), f"expected one per parameter ({len(params)})")
    for i, (p, g) in enumerate(zip(params, grads, strict=True)):
        if p.shape != g.shape:
            raise ConfigError(f"grads[{i}].shape", tuple(g.shape), f"expected {tuple(p.shape)}")
        if p.dtype != torch.float32:
            raise ConfigError(f"params[{i}].dtype", p.dtype, "global parameters must be float32")


class PlainSGD:
    """Theta <- Theta - lr * Delta. With lr = 1 this is plain model averaging."""

    def __init__(self, lr: float) -> None:
        self.lr = lr
        self.steps = 0

    @torch.no_grad()
    def step(
        self, params: Tensors, grads: Tensors, scale: float = 1.0, fraction: float = 1.0
    ) -> None:
        _check(params, grads, scale, fraction)  # (no momentum: scale and fraction do nothing)
        for p, g in zip(params, grads, strict=True):
            p.add_(g, alpha=-self.lr)
        self.steps += 1

    def state_dict(self) -> dict[str, Any]:
        return {"steps": self.steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.steps = int(state["steps"])


class NesterovSGD:
    """SGD with Nesterov momentum, identical to ``torch.optim.SGD(nesterov=True)``.

    buf <- mu * buf + Delta (buf = Delta on the first step); Theta <- Theta - lr (Delta + mu buf).
    With mu = 0 (the merged delta as it is, at lr 1) that is Theta - lr Delta and no buffer is
    kept: one fp32 copy of the model less in the syncer's memory (torch's SGD keeps none).

    ``warmup = W`` (Decoupled's default: 30, decision 116): the k-th step (from 0) uses
    mu k / W until k = W, so the first outer steps, whose deltas are the largest, are not
    multiplied by lr / (1 - mu); ``warmup_lr`` ramps the rate from 1 to ``lr`` as well.
    The step count is in the state, so a restarted syncer goes on where the ramp was.
    """

    def __init__(
        self, lr: float, momentum: float, warmup: int = 0, warmup_lr: bool = False
    ) -> None:
        self.lr = lr
        self.momentum = momentum
        self.warmup = warmup  # outer steps over which mu ramps from 0 (0: none)
        self.warmup_lr = warmup_lr  # ... and lr from 1
        self.buffers: list[torch.Tensor] | None = None
        self.steps = 0

    @torch.no_grad()
    def step(
        self, params: Tensors, grads: Tensors, scale: float = 1.0, fraction: float = 1.0
    ) -> None:
        _check(params, grads, scale, fraction)
        if self.momentum == 0.0:  # (exactly torch's SGD without momentum)
            for p, g in zip(params, grads, strict=True):
                p.add_(g, alpha=-self.lr)
            self.steps += 1
            return
        # (x * 1.0 and x / 1.0 are exact, and mu ** 1.0 is mu: s = f = 1 is plain Nesterov)
        momentum, lr = self.momentum, self.lr
        if self.warmup and self.steps < self.warmup:
            ramp = self.steps / self.warmup
            momentum *= ramp
            if self.warmup_lr:
                lr += (1.0 - lr) * (1.0 - ramp)
        decay = momentum if fraction == 1.0 else momentum**fraction
        if self.buffers is None:
            self.buffers = [g.to(torch.float32, copy=True).div_(scale) for g in grads]
        else:
            for buf, g in zip(self.buffers, grads, strict=True):
                buf.mul_(decay).add_(g, alpha=1.0 / scale)
        mu = momentum * scale * fraction
        for p, g, buf in zip(params, grads, self.buffers, strict=True):
            p.add_(g.add_(buf, alpha=mu), alpha=-lr)  # as torch's SGD, in place
        self.steps += 1

    def state_dict(self) -> dict[str, Any]:
        return {"steps": self.steps, "buffers": self.buffers}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.steps = int(state["steps"])
        # (a buffer saved by an older build under mu = 0 is never read: not kept)
        self.buffers = None if self.momentum == 0.0 else _copy(state["buffers"])


class DelayedNesterov:
    """Delayed Nesterov (Liu et al. 2024, asynchronous Local-SGD).

    Asynchronous outer updates arrive one learner at a time; refreshing momentum on every one
    of them makes the momentum run away. Here every outer gradient is applied at once without
    momentum, scaled by c, and the momentum buffer is refreshed only every ``delay`` updates,
    with the mean of the gradients buffered since the last refresh:
    ``buf <- mu buf + mean(Delta); Theta <- Theta - lr (c Delta + mu buf)`` on the N-th update,
    ``Theta <- Theta - lr c Delta`` on the others. With delay 1 and c = 1 it is exactly
    Nesterov.
    """

    def __init__(self, lr: float, momentum: float, delay: int, interim_scale: float) -> None:
        self.lr = lr
        self.momentum = momentum
        self.delay = delay
        self.scale = interim_scale
        self.buffers: list[torch.Tensor] | None = None
        self.pending: list[torch.Tensor] | None = None
        self.steps = 0

    @torch.no_grad()
    def step(
        self, params: Tensors, grads: Tensors, scale: float = 1.0, fraction: float = 1.0
    ) -> None:
        _check(params, grads, scale, fraction)  # (its refresh every N updates ignores fraction)
        if self.pending is None:
            self.pending = [torch.zeros_like(p) for p in params]
        for acc, g in zip(self.pending, grads, strict=True):
            acc.add_(g, alpha=1.0 / scale)
        self.steps += 1
        for p, g in zip(params, grads, strict=True):
            p.add_(g, alpha=-self.lr * self.scale)
        if self.steps % self.delay != 0:
            return
        if self.buffers is None:
            self.buffers = [torch.zeros_like(p) for p in params]
        for p, buf, acc in zip(params, self.buffers, self.pending, strict=True):
            buf.mul_(self.momentum).add_(acc, alpha=1.0 / self.delay)
            p.add_(buf, alpha=-self.lr * self.momentum * scale)
            acc.zero_()

    def state_dict(self) -> dict[str, Any]:
        return {"steps": self.steps, "buffers": self.buffers, "pending": self.pending}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.steps = int(state["steps"])
        self.buffers = _copy(state["buffers"])
        self.pending = _copy(state["pending"])


def _copy(tensors: Sequence[torch.Tensor] | None) -> list[torch.Tensor] | None:
    """Restored state never aliases the caller's tensors."""
    return None if tensors is None else [t.to(torch.float32, copy=True) for t in tensors]


def make_outer_optimizer(config: OuterConfig) -> OuterOptimizer:
    """Build one fragment's outer optimizer from its config."""
    if config.name == "sgd":
        return PlainSGD(config.lr)
    if config.name == "nesterov":
        return NesterovSGD(config.lr, config.momentum, config.warmup, config.warmup_lr)
    scale = config.interim_scale if config.interim_scale is not None else 1.0 / config.delay
    return DelayedNesterov(config.lr, config.momentum, config.delay, scale)
