"""A fragment plan seen from one rank of a sharded (FSDP) learner.

A learner whose ranks shard every parameter on dim 0 (FSDP2's ``Shard(0)``: rank r of R
holds rows ``[r*c, min((r+1)*c, n))`` of an n-row tensor, ``c = ceil(n / R)``, possibly
none) keeps one fragment plan over the full parameters — the same for any R, so the syncer
and every learner agree on it — and each rank works on its part of it:
:func:`local_plan` is the plan of the rows it holds (same fragments, same offsets; each
slice cut to the rank's rows and counted from its first row), so the core's learner state
and step boundary run unchanged on a rank's local tensors. :func:`split` cuts a full
fragment's values (a merged fragment) into a rank's part; :class:`Assembled` puts the R parts
of an answer back together. Pure: no I/O, no clock, no process group.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch

from ddiloco.core.plans import Fragment, FragmentPlan, Slice, TensorSpec
from ddiloco.errors import ConfigError, require

__all__ = ["Assembled", "assemble", "local_plan", "shard_rows", "split"]


def shard_rows(rows: int, world: int, rank: int) -> tuple[int, int]:
    """The rows ``[lo, hi)`` of an n-row tensor that rank ``rank`` of ``world`` holds."""
    require(world >= 1 and 0 <= rank < world, "rank", rank, f"must be in [0, {world})")
    chunk = -(-rows // world)
    return min(rank * chunk, rows), min((rank + 1) * chunk, rows)


def _cut(s: Slice, spec: TensorSpec, world: int, rank: int) -> tuple[int, int] | None:
    """The global rows of slice ``s`` that ``rank`` holds, or None when it holds none."""
    if not spec.shape:
        raise ConfigError(
            "train.parallel",
            "fsdp",
            f"parameter {spec.name!r} is a scalar: a sharded learner splits every parameter "
            "on its first dim",
        )
    a, b = s.rows if s.rows is not None else (0, spec.shape[0])
    lo, hi = shard_rows(spec.shape[0], world, rank)
    start, stop = max(a, lo), min(b, hi)
    return (start, stop) if start < stop else None


def local_plan(plan: FragmentPlan, world: int, rank: int) -> FragmentPlan:
    """``plan`` over the rows rank ``rank`` of ``world`` holds: the same fragments and
    offsets, each slice cut to those rows (and dropped where it has none), rows counted
    from the rank's first; the specs are the local tensors' shapes."""
    specs = {spec.name: spec for spec in plan.specs}
    local_specs = []
    for spec in plan.specs:
        lo, hi = shard_rows(spec.shape[0], world, rank) if spec.shape else (0, 0)
        local_specs.append(replace(spec, shape=(hi - lo, *spec.shape[1:])))
    fragments = []
    for f in plan.fragments:
        slices = []
        for s in f.slices:
            spec = specs[s.name]
            rows = _cut(s, spec, world, rank)
            if rows is None:
                continue
            first = shard_rows(spec.shape[0], world, rank)[0]
            numel = (rows[1] - rows[0]) * spec.row_numel
            slices.append(
                Slice(s.name, (rows[0] - first, rows[1] - first), numel, numel * spec.itemsize)
            )
        numel = sum(s.numel for s in slices)
        nbytes = sum(s.nbytes for s in slices)
        fragments.append(Fragment(f.index, f.offset, tuple(slices), nbytes, numel))
    return FragmentPlan(plan.partition, plan.sync_every, tuple(fragments), tuple(local_specs))


def split(
    plan: FragmentPlan, fragment: int, values: Sequence[torch.Tensor], world: int, rank: int
) -> list[torch.Tensor]:
    """Rank ``rank``'s part of a full fragment's ``values`` (one tensor per slice of the
    global plan): views, in the local plan's slice order."""
    f = plan.fragments[fragment]
    require(len(values) == len(f.slices), "values", len(values), f"fragment {fragment} slices")
    specs = {spec.name: spec for spec in plan.specs}
    out = []
    for s, value in zip(f.slices, values, strict=True):
        rows = _cut(s, specs[s.name], world, rank)
        if rows is not None:
            out.append(value[rows[0] - s.row_start : rows[1] - s.row_start])
    return out


class Assembled(Sequence[torch.Tensor]):
    """A full fragment from its ``parts``, one per rank in rank order (each in its local
    plan's slice order): every global slice is its ranks' pieces, concatenated on dim 0 when
    it is read. Parts held as they came (core/codec.PackedTensors) stay packed until then:
    a sharded learner's answer waiting for its round costs the syncer its encoded size, not
    fp32, as a whole answer does (issue 28). Checked against the plan on construction."""

    def __init__(
        self, plan: FragmentPlan, fragment: int, parts: Sequence[Sequence[torch.Tensor]]
    ) -> None:
        world = len(parts)
        f = plan.fragments[fragment]
        specs = {spec.name: spec for spec in plan.specs}
        cursors = [0] * world
        self.pieces: list[list[tuple[int, int]]] = []  # per global slice: (rank, its index)
        for s in f.slices:
            pieces = []
            for rank in range(world):
                if _cut(s, specs[s.name], world, rank) is None:
                    continue
                if cursors[rank] >= len(parts[rank]):
                    raise ConfigError("parts", rank, f"too few pieces for fragment {fragment}")
                pieces.append((rank, cursors[rank]))
                cursors[rank] += 1
            self.pieces.append(pieces)
        for rank in range(world):
            require(
                cursors[rank] == len(parts[rank]),
                "parts",
                rank,
                f"{len(parts[rank])} pieces where fragment {fragment} has {cursors[rank]} here",
            )
        self.parts = parts

    def __len__(self) -> int:
        return len(self.pieces)

    def __getitem__(self, i):  # type: ignore[no-untyped-def]  # (Sequence's two overloads)
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        pieces = [self.parts[rank][k] for rank, k in self.pieces[i]]
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces)


def assemble(
    plan: FragmentPlan, fragment: int, parts: Sequence[Sequence[torch.Tensor]]
) -> list[torch.Tensor]:
    """:class:`Assembled`'s tensors, every one read now."""
    return list(Assembled(plan, fragment, parts))
