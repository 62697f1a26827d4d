"""A sharded learner's answer put together from its ranks' parts (core/parts.py): counted only
whole, in any arrival order; parts whose siblings do not come in time are dropped together,
never merged half; late and contradicting parts start nothing."""

from __future__ import annotations

import itertools

import pytest
import torch

from ddiloco.core.parts import PartAssembler, PartError
from ddiloco.core.plans import TensorSpec, build_plan
from ddiloco.core.shards import local_plan, split

PLAN = build_plan([TensorSpec("a", (5, 3), 4), TensorSpec("b", (4,), 4)], 1, "balanced")
KEY = (1, 0, 7)


def parts_of(values: list[torch.Tensor], world: int) -> list[list[torch.Tensor]]:
    return [split(PLAN, 0, values, world, r) for r in range(world)]


@pytest.mark.parametrize("world", [2, 3, 4])
def test_an_answer_is_whole_only_when_every_rank_came_in_any_order(world):
    full = [torch.randn(5, 3), torch.randn(4)]
    for order in itertools.permutations(range(world)):
        asm: PartAssembler[str] = PartAssembler(bound_seconds=5.0)
        done = None
        for i, r in enumerate(order):
            head = "meta" if r == 0 else None
            done = asm.add(KEY, 0, r, world, parts_of(full, world)[r], float(i), head)
            if i < world - 1:
                assert done is None  # never half
        assert done is not None and done.head == "meta"
        assert all(torch.equal(x, y) for x, y in zip(done.values(PLAN), full, strict=True))
        assert asm.counts["answers_assembled"] == 1 and not asm.open


def test_parts_without_their_siblings_in_time_are_dropped_together_and_late_ones_ignored():
    asm: PartAssembler[str] = PartAssembler(bound_seconds=2.0)
    parts = parts_of([torch.ones(5, 3), torch.ones(4)], 2)
    assert asm.add(KEY, 0, 0, 2, parts[0], 10.0, "meta") is None  # rank 1's part was lost
    assert asm.expire(11.9) == []  # within the bound: still waiting
    (dropped,) = asm.expire(12.1)
    assert dropped.key == KEY and dropped.missing == [1] and dropped.head == "meta"
    assert asm.counts["answers_incomplete"] == 1 and not asm.open
    assert asm.add(KEY, 0, 1, 2, parts[1], 12.2) is None  # late: its answer was dropped
    assert asm.counts["parts_late"] == 1 and not asm.open
    assert asm.expire(100.0) == []


def test_a_whole_answer_needs_rank_zeros_metadata_and_a_repeated_part_is_taken_once():
    asm: PartAssembler[str] = PartAssembler(bound_seconds=2.0)
    parts = parts_of([torch.ones(5, 3), torch.ones(4)], 2)
    assert asm.add(KEY, 0, 1, 2, parts[1], 0.0) is None
    assert asm.add(KEY, 0, 1, 2, parts[1], 0.1) is None  # a re-push
    assert asm.counts["parts_repeated"] == 1
    assert asm.add(KEY, 0, 0, 2, parts[0], 0.2, "meta") is not None


def test_a_part_that_contradicts_its_siblings_is_refused_by_name():
    asm: PartAssembler[str] = PartAssembler(bound_seconds=2.0)
    parts = parts_of([torch.ones(5, 3), torch.ones(4)], 2)
    asm.add(KEY, 0, 0, 2, parts[0], 0.0, "meta")
    with pytest.raises(PartError, match="fragment 0 of 2"):
        asm.add(KEY, 0, 1, 3, parts[1], 0.1)
    with pytest.raises(PartError, match=">= 2 ranks"):
        asm.add((1, 0, 8), 0, 1, 1, parts[1], 0.1)
    with pytest.raises(PartError, match=">= 2 ranks"):
        asm.add((1, 0, 8), 0, 2, 2, parts[1], 0.1)


def test_open_assemblies_are_bounded_oldest_dropped_first():
    asm: PartAssembler[str] = PartAssembler(bound_seconds=60.0, max_open=3)
    rows = local_plan(PLAN, 2, 1)
    assert rows.fragments[0].numel > 0
    part = parts_of([torch.ones(5, 3), torch.ones(4)], 2)[1]
    for seq in range(5):
        asm.add((1, 0, seq), 0, 1, 2, part, float(seq))
    dropped = asm.expire(5.0)
    assert [a.key[2] for a in dropped] == [0, 1] and len(asm.open) == 3
