"""Moving a fragment's data: gather its pieces from, and scatter values into, named tensors.

Owns only the tensor side of a :class:`~ddiloco.core.plans.FragmentPlan` (views of dim-0 row
slices, validated in-place copies). It never decides what a fragment contains (that is
:mod:`ddiloco.core.plans`) and does no I/O; the only mutation is the copy in :func:`scatter`.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence

import torch

from ddiloco.core.plans import Fragment, FragmentPlan, Slice
from ddiloco.errors import ConfigError, require

__all__ = ["gather", "scatter"]


def _fragment(plan: FragmentPlan, fragment: int) -> Fragment:
    require(
        isinstance(fragment, numbers.Integral)
        and not isinstance(fragment, bool)
        and 0 <= fragment < plan.num_fragments,
        "fragment",
        fragment,
        f"must be an int in [0, {plan.num_fragments})",
    )
    return plan.fragments[int(fragment)]


def _view(plan: FragmentPlan, s: Slice, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
    if s.name not in tensors:
        raise ConfigError("tensors", s.name, "missing a tensor the plan needs")
    t = tensors[s.name]
    spec = plan.spec(s.name)
    require(
        tuple(t.shape) == spec.shape,
        "tensors",
        s.name,
        f"shape {tuple(t.shape)} does not match the plan's {spec.shape}",
    )
    view = t.detach()
    return view if s.rows is None else view[s.rows[0] : s.rows[1]]


def gather(
    plan: FragmentPlan, fragment: int, tensors: Mapping[str, torch.Tensor]
) -> list[torch.Tensor]:
    """The fragment's pieces in slice order, as detached views sharing the tensors' storage.

    Views, not copies, so callers decide when to copy (e.g. a snapshot before a push) and
    writes through them land in the model.
    """
    frag = _fragment(plan, fragment)
    return [_view(plan, s, tensors) for s in frag.slices]


def scatter(
    plan: FragmentPlan,
    fragment: int,
    tensors: Mapping[str, torch.Tensor],
    values: Sequence[torch.Tensor],
) -> None:
    """Copy ``values`` (one per slice, in slice order) into the fragment's place in ``tensors``.

    Everything is validated before anything is written, so a bad call leaves the model intact.
    """
    frag = _fragment(plan, fragment)
    require(
        len(values) == len(frag.slices),
        "values",
        len(values),
        f"fragment {frag.index} has {len(frag.slices)} slices",
    )
    targets = [_view(plan, s, tensors) for s in frag.slices]
    for s, dst, src in zip(frag.slices, targets, values, strict=True):
        require(isinstance(src, torch.Tensor), "values", s.name, "must be a torch.Tensor")
        require(
            tuple(src.shape) == tuple(dst.shape),
            "values",
            s.name,
            f"shape {tuple(src.shape)} != expected {tuple(dst.shape)}",
        )
        require(
            torch.can_cast(src.dtype, dst.dtype),
            "values",
            s.name,
            f"dtype {src.dtype} cannot be cast to {dst.dtype}",
        )
    with torch.no_grad():
        for dst, src in zip(targets, values, strict=True):
            if _same_memory(dst, src):  # the values live there already (a shared model)
                continue
            dst.copy_(src)


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.device == b.device
        and a.dtype == b.dtype
        and a.data_ptr() == b.data_ptr()
        and a.stride() == b.stride()
    )
