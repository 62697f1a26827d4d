"""Merge rules: turn several learners' outer gradients for one fragment into one.

Owns the token weight, the weighted mean and radial-directional averaging (RDA). Inputs are
lists of tensors (one list per learner, the fragment's pieces in plan order); outputs are new
fp32 tensors. Nothing here knows about rounds, versions or the network.

Why RDA: learners' outer gradients are nearly orthogonal, so a plain mean shrinks like
1/sqrt(M) and the outer learning rate would need retuning for every M. RDA averages norms
and directions separately, so the merged step keeps the learners' typical length.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ddiloco.errors import ConfigError

MERGE_RULES = ("rda", "mean")

# Below this fraction of the mean norm, the direction sum is treated as zero (the learners
# cancel each other out) and RDA falls back to the weighted mean.
DEGENERATE_DIRECTION = 1e-6


def token_weight(c_tokens: int, c_steps: int) -> float:
    """Weight of one learner's answer: tokens x tokens-per-step (quantity times batch size).

    A learner that took more steps on bigger batches since its base counts for more; zero
    steps means nothing to contribute, so weight 0.
    """
    if c_tokens < 0:
        raise ConfigError("c_tokens", c_tokens, "token counter must be >= 0")
    if c_steps < 0:
        raise ConfigError("c_steps", c_steps, "step counter must be >= 0")
    if c_steps == 0 or c_tokens == 0:
        return 0.0
    return float(c_tokens) * (float(c_tokens) / float(c_steps))


def merge(
    updates: Sequence[Sequence[torch.Tensor]],
    weights: Sequence[float],
    rule: str = "rda",
    plain_mask: Sequence[bool] | None = None,
    *,
    norms: Sequence[Sequence[float]] | None = None,
    out: Sequence[torch.Tensor] | None = None,
    scale: float = 1.0,
) -> list[torch.Tensor]:
    """Merge per-learner outer gradients with ``rule`` ("rda" or "mean"), times ``scale``.

    ``plain_mask[i]`` marks tensor i (e.g. an embedding) as merged by the weighted mean even
    under RDA. Learners with weight 0 are ignored; at least one positive weight is required.
    ``norms[m][i]`` (from :func:`tensor_norms`) lets the syncer compute each input's norms when
    it arrives, off the merge's critical path; ``out`` is a reusable fp32 workspace (fresh
    large allocations cost page faults on every merge); ``scale = -1`` turns deltas into outer
    gradients without another pass (both rules are odd-symmetric).
    """
    if rule not in MERGE_RULES:
        raise ConfigError(
            "merge_rule", rule, f"unknown merge rule; known: {', '.join(MERGE_RULES)}"
        )
    keep = _validate(updates, weights)
    total = float(sum(weights))
    kept = [updates[m] for m in keep]
    norm_weights = [weights[m] / total for m in keep]
    num_tensors = len(kept[0])
    mask = [False] * num_tensors if plain_mask is None else list(plain_mask)
    if len(mask) != num_tensors:
        raise ConfigError("plain_mask", len(mask), f"needs one flag per tensor ({num_tensors})")
    if norms is not None and (
        len(norms) != len(updates) or any(len(n) != num_tensors for n in norms)
    ):
        raise ConfigError("norms", len(norms), "need one norm per tensor per update")
    if out is not None and len(out) != num_tensors:
        raise ConfigError("out", len(out), f"need one workspace tensor per tensor ({num_tensors})")
    result = []
    for i in range(num_tensors):  # one tensor of every update at a time (each may be
        # decoded only now: a held answer keeps its wire bytes, core/codec.PackedTensors)
        column = _column(updates, i, keep)
        dst = torch.empty_like(column[0], dtype=torch.float32) if out is None else out[i]
        if dst.shape != column[0].shape or dst.dtype != torch.float32:
            raise ConfigError(
                f"out[{i}]", (tuple(dst.shape), dst.dtype), "need float32 of the input shape"
            )
        if rule == "mean" or mask[i]:
            result.append(_weighted_mean_tensor(column, norm_weights, dst, scale))
        else:
            col_norms = None if norms is None else [float(norms[m][i]) for m in keep]
            result.append(_rda_tensor(column, norm_weights, dst, scale, col_norms))
    return result


def tensor_norms(tensors: Sequence[torch.Tensor]) -> list[float]:
    """L2 norm of each tensor in fp32 (a dot product: cheaper than ``vector_norm`` on CPU)."""
    out = []
    for t in tensors:
        flat = t.reshape(-1)
        if flat.dtype != torch.float32:
            flat = flat.float()
        out.append(math.sqrt(max(float(torch.dot(flat, flat)), 0.0)))
    return out


def weighted_mean(
    updates: Sequence[Sequence[torch.Tensor]], weights: Sequence[float]
) -> list[torch.Tensor]:
    """Per tensor: sum_m w_m v_m / sum_m w_m."""
    return merge(updates, weights, rule="mean")


def radial_directional_average(
    updates: Sequence[Sequence[torch.Tensor]],
    weights: Sequence[float],
    plain_mask: Sequence[bool] | None = None,
) -> list[torch.Tensor]:
    """Per tensor: (sum w ||v|| / sum w) * phi(sum w phi(v) / sum w), phi(x) = x/||x||."""
    return merge(updates, weights, rule="rda", plain_mask=plain_mask)


def _validate(updates: Sequence[Sequence[torch.Tensor]], weights: Sequence[float]) -> list[int]:
    """Check shapes and weights; return the indices of the positive-weight learners."""
    if len(updates) == 0:
        raise ConfigError("updates", 0, "need at least one learner's update")
    if len(weights) != len(updates):
        raise ConfigError(
            "weights", len(weights), f"need one weight per update ({len(updates)} updates)"
        )
    for m, w in enumerate(weights):
        if not (w >= 0.0 and w < float("inf")):
            raise ConfigError(f"weights[{m}]", w, "weights must be finite and >= 0")
    reference = updates[0]
    for m, update in enumerate(updates):
        if len(update) != len(reference):
            raise ConfigError(
                f"updates[{m}]", len(update), f"expected {len(reference)} tensors like updates[0]"
            )
    if float(sum(weights)) <= 0.0:
        raise ConfigError("weights", list(weights), "at least one weight must be positive")
    return [m for m, w in enumerate(weights) if w > 0.0]


def _column(
    updates: Sequence[Sequence[torch.Tensor]], i: int, keep: Sequence[int]
) -> list[torch.Tensor]:
    """Tensor ``i`` of the kept updates, every update's checked against the first's."""
    tensors = [u[i] for u in updates]
    for m, t in enumerate(tensors):
        if t.shape != tensors[0].shape:
            raise ConfigError(
                f"updates[{m}][{i}].shape", tuple(t.shape), f"expected {tuple(tensors[0].shape)}"
            )
        if not t.is_floating_point():
            raise ConfigError(f"updates[{m}][{i}].dtype", t.dtype, "expected a float tensor")
    return [tensors[m] for m in keep]


def _weighted_mean_tensor(
    column: Sequence[torch.Tensor], weights: Sequence[float], out: torch.Tensor, scale: float
) -> torch.Tensor:
    torch.mul(column[0], weights[0] * scale, out=out)
    for t, w in zip(column[1:], weights[1:], strict=True):
        out.add_(t, alpha=w * scale)
    return out


def _rda_tensor(
    column: Sequence[torch.Tensor],
    weights: Sequence[float],
    out: torch.Tensor,
    scale: float,
    norms: Sequence[float] | None,
) -> torch.Tensor:
    """RDA of one tensor, written into ``out``: one read of each input plus two passes."""
    if norms is None:
        norms = tensor_norms(column)
    radius = sum(w * n for w, n in zip(weights, norms, strict=True))
    if norms[0] > 0.0:
        torch.mul(column[0], weights[0] / norms[0], out=out)
    else:
        out.zero_()
    for t, w, n in zip(column[1:], weights[1:], norms[1:], strict=True):
        if n > 0.0:
            out.add_(t, alpha=w / n)
    if radius == 0.0:
        return out  # every input is zero
    (direction_norm,) = tensor_norms([out])
    if direction_norm <= DEGENERATE_DIRECTION * radius:
        return _weighted_mean_tensor(column, weights, out, scale)
    return out.mul_(scale * radius / direction_norm)
