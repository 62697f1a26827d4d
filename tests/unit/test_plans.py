"""Fragment plans and the sync schedule: coverage, determinism, balance bounds, gather/scatter."""

from __future__ import annotations

import itertools
import json
import math
import random
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from ddiloco.core.fragments import gather, scatter
from ddiloco.core.plans import (
    PARTITIONS,
    FragmentPlan,
    TensorSpec,
    build_plan,
    layer_key,
    tensor_specs,
)
from ddiloco.errors import ConfigError

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# ---------------------------------------------------------------- strategies and helpers


@st.composite
def spec_lists(draw: st.DrawFn, max_n: int = 9, allow_empty: bool = True) -> list[TensorSpec]:
    """Random parameter lists with layer-style names (blocks.k.*, top-level tensors)."""
    n = draw(st.integers(1, max_n))
    lo = 0 if allow_empty else 1
    specs = []
    for i in range(n):
        ndim = draw(st.integers(0, 3))
        shape = tuple(
            draw(st.integers(lo, 7)) if d == 0 else draw(st.integers(1, 4)) for d in range(ndim)
        )
        itemsize = draw(st.sampled_from([1, 2, 4]))
        kind = draw(st.integers(0, 2))
        if kind == 0:
            name = f"blocks.{draw(st.integers(0, 3))}.w{i}"
        elif kind == 1:
            name = f"top{draw(st.integers(0, 2))}.p{i}"
        else:
            name = f"t{i}"
        specs.append(TensorSpec(name, shape, itemsize))
    return specs


def coverage_ok(plan: FragmentPlan, specs: list[TensorSpec]) -> None:
    """Every element of every spec is in exactly one slice, and the byte counts add up."""
    by_name = {s.name: s for s in specs}
    rows = {s.name: [0] * (s.shape[0] if s.shape else 1) for s in specs}
    wholes = dict.fromkeys(by_name, 0)
    parted = set()
    for f in plan.fragments:
        assert f.slices, "empty fragment"
        assert f.nbytes == sum(s.nbytes for s in f.slices)
        assert f.numel == sum(s.numel for s in f.slices)
        for s in f.slices:
            spec = by_name[s.name]
            if s.rows is None:
                wholes[s.name] += 1
                rows[s.name] = [c + 1 for c in rows[s.name]]
                assert s.numel == spec.numel
            else:
                a, b = s.rows
                assert 0 <= a < b <= spec.shape[0]
                parted.add(s.name)
                for r in range(a, b):
                    rows[s.name][r] += 1
                assert s.numel == (b - a) * spec.row_numel
            assert s.nbytes == s.numel * spec.itemsize
    for name in by_name:
        assert all(c == 1 for c in rows[name]), (name, rows[name])
        assert wholes[name] + (name in parted) == 1, name  # whole once, or only row parts
    assert plan.total_bytes == sum(s.nbytes for s in specs)


def coverage_by_gather(plan: FragmentPlan, specs: list[TensorSpec]) -> None:
    """Same check through real tensors: adding 1 through every gathered view gives all ones."""
    tensors = {s.name: torch.zeros(s.shape) for s in specs}
    for p in range(plan.num_fragments):
        for view in gather(plan, p, tensors):
            view.add_(1)
    for name, t in tensors.items():
        assert torch.all(t == 1), name


def build_or_none(
    specs: list[TensorSpec], p: int, partition: str, **kw: Any
) -> FragmentPlan | None:
    """Build, or check that the only refusal is 'too few pieces/groups for P'."""
    try:
        return build_plan(specs, p, partition, **kw)
    except ConfigError as e:
        assert e.field == "num_fragments"
        if partition == "layer":
            assert p > len({layer_key(s.name) for s in specs})
        else:  # tensors, or balanced pieces (row splitting only adds pieces)
            assert p > len(specs)
        return None


def opt_makespan(sizes: list[int], p: int) -> int:
    """Brute-force optimal max bin load (branch and bound; small instances only)."""
    sizes = sorted(sizes, reverse=True)
    best = [sum(sizes)]
    loads = [0] * p

    def go(i: int) -> None:
        if max(loads) >= best[0]:
            return
        if i == len(sizes):
            best[0] = max(loads)
            return
        seen = set()
        for j in range(p):
            if loads[j] in seen:  # symmetric bins
                continue
            seen.add(loads[j])
            loads[j] += sizes[i]
            go(i + 1)
            loads[j] -= sizes[i]

    go(0)
    return best[0]


# ---------------------------------------------------------------- properties


ANY_PLAN = {
    "specs": spec_lists(),
    "p": st.integers(1, 7),
    "partition": st.sampled_from(PARTITIONS),
    "split": st.booleans(),
}


@SETTINGS
@given(**ANY_PLAN)
def test_every_element_is_covered_exactly_once_by_a_deterministic_plan(
    specs: list[TensorSpec], p: int, partition: str, split: bool
) -> None:
    split = split and partition == "balanced"
    plan = build_or_none(specs, p, partition, split_rows=split)
    if plan is None:
        return
    assert plan.num_fragments == p
    coverage_ok(plan, specs)
    coverage_by_gather(plan, specs)
    order = {s.name: i for i, s in enumerate(specs)}
    for f in plan.fragments:  # slices listed in model order
        keys = [(order[s.name], s.row_start) for s in f.slices]
        assert keys == sorted(keys)
    for s in specs:
        assert plan.fragment_of(s.name)
    # deterministic: the same specs give the same plan, to the byte of its JSON
    again = build_plan(
        [TensorSpec(s.name, s.shape, s.itemsize) for s in specs], p, partition, split_rows=split
    )
    assert again == plan
    assert json.dumps(again.to_dict()) == json.dumps(plan.to_dict())


@SETTINGS
@given(specs=spec_lists(), p=st.integers(1, 7), split=st.booleans(), seed=st.integers(0, 2**16))
def test_balanced_contents_do_not_depend_on_input_order(
    specs: list[TensorSpec], p: int, split: bool, seed: int
) -> None:
    plan = build_or_none(specs, p, "balanced", split_rows=split)
    if plan is None:
        return
    shuffled = list(specs)
    random.Random(seed).shuffle(shuffled)
    other = build_plan(shuffled, p, "balanced", split_rows=split)

    def contents(pl: FragmentPlan) -> list[tuple[int, int, frozenset[tuple[str, object]]]]:
        return [
            (f.offset, f.nbytes, frozenset((s.name, s.rows) for s in f.slices))
            for f in pl.fragments
        ]

    assert contents(other) == contents(plan)


@SETTINGS
@given(
    sizes=st.lists(st.integers(1, 40), min_size=1, max_size=8),
    p=st.integers(1, 3),
    itemsize=st.sampled_from([1, 2, 4]),
)
def test_balanced_meets_lpt_bound(sizes: list[int], p: int, itemsize: int) -> None:
    if len(sizes) < p:
        with pytest.raises(ConfigError) as e:
            build_plan([TensorSpec(f"t{i}", (n,), itemsize) for i, n in enumerate(sizes)], p)
        assert e.value.field == "num_fragments" and "split_rows" in str(e.value)
        return
    specs = [TensorSpec(f"t{i}", (n,), itemsize) for i, n in enumerate(sizes)]
    plan = build_plan(specs, p)
    worst = max(f.nbytes for f in plan.fragments)
    opt = opt_makespan([s.nbytes for s in specs], p)
    # Graham: LPT <= (4/3 - 1/(3P)) * OPT, in integers.
    assert 3 * p * worst <= (4 * p - 1) * opt
    assert plan.imbalance >= 1.0


@SETTINGS
@given(specs=spec_lists(max_n=6, allow_empty=False), p=st.integers(1, 12))
def test_split_rows_bound(specs: list[TensorSpec], p: int) -> None:
    """Greedy bound: the fullest fragment's last piece x went to a least-loaded fragment, so
    max <= (total - x)/P + x <= total/P + (1 - 1/P) * max_piece. Pieces exceed cap = ceil(total/P)
    only when they are a single row (or an unsplittable 0-d / 1-row tensor) bigger than cap."""
    plan = build_or_none(specs, p, "balanced", split_rows=True)
    if plan is None:
        return
    by_name = {s.name: s for s in specs}
    total = plan.total_bytes
    cap = math.ceil(total / p)
    pieces = [s for f in plan.fragments for s in f.slices]
    for s in pieces:
        spec = by_name[s.name]
        unsplittable = not spec.shape or spec.shape[0] <= 1
        one_row = s.rows is not None and s.rows[1] - s.rows[0] == 1
        assert s.nbytes <= cap or unsplittable or one_row
    biggest = max(s.nbytes for s in pieces)
    worst = max(f.nbytes for f in plan.fragments)
    assert p * worst <= total + (p - 1) * biggest
    if biggest <= cap:
        assert worst < total / p + cap <= 2 * cap


@SETTINGS
@given(
    specs=spec_lists(),
    p=st.integers(1, 6),
    partition=st.sampled_from(PARTITIONS),
    h_extra=st.integers(-5, 8),
    data=st.data(),
)
def test_schedule_lists_every_fragment_once_per_period(
    specs: list[TensorSpec], p: int, partition: str, h_extra: int, data: st.DataObject
) -> None:
    h = max(1, p + h_extra)
    explicit = data.draw(st.booleans())
    offsets = (
        data.draw(st.lists(st.integers(0, h - 1), min_size=p, max_size=p)) if explicit else None
    )
    plan = build_or_none(specs, p, partition, sync_every=h, offsets=offsets)
    if plan is None:
        return
    assert plan.sync_every == h
    expected = offsets if explicit else [i * h // p for i in range(p)]
    assert [f.offset for f in plan.fragments] == expected
    seen: list[int] = []
    for t in range(h):
        due = plan.due(t)
        assert list(due) == sorted(due)
        assert plan.due(t + 3 * h) == due
        assert all(plan.fragments[i].offset == t for i in due)
        seen.extend(due)
    assert sorted(seen) == list(range(p))
    assert plan.imbalance >= 1.0
    assert plan.peak_bytes_per_step >= plan.mean_bytes_per_step
    assert sum(plan.bytes_per_step) == plan.total_bytes
    d = plan.to_dict()
    assert json.loads(json.dumps(d)) == d
    assert d["num_fragments"] == p and len(d["fragments"]) == p


def test_default_offsets_spread_fragments() -> None:
    specs = [TensorSpec(f"t{i}", (4,), 4) for i in range(8)]
    assert [f.offset for f in build_plan(specs, 4).fragments] == [0, 1, 2, 3]
    assert [f.offset for f in build_plan(specs, 4, sync_every=8).fragments] == [0, 2, 4, 6]
    plan = build_plan(specs, 4, sync_every=8)
    assert [plan.due(t) for t in range(8)] == [(0,), (), (1,), (), (2,), (), (3,), ()]
    assert plan.peak_bytes_per_step == 32 and plan.mean_bytes_per_step == 16.0


# ---------------------------------------------------------------- a small model


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.attn = nn.Linear(d, d)
        self.mlp = nn.Linear(d, 2 * d)


class Tiny(nn.Module):
    def __init__(self, d: int = 8, vocab: int = 50, layers: int = 3) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.tok_emb.weight  # tied


def test_tensor_specs_model_order_and_tied_weights() -> None:
    model = Tiny()
    specs = tensor_specs(model)
    names = [s.name for s in specs]
    assert names[0] == "tok_emb.weight" and "head.weight" not in names
    assert names == [n for n, _ in model.named_parameters()]
    assert specs[0] == TensorSpec("tok_emb.weight", (50, 8), 4)
    t = torch.zeros(3, dtype=torch.bfloat16)
    assert tensor_specs([("a", t), ("b", t), ("c", torch.zeros(()))]) == [
        TensorSpec("a", (3,), 2),
        TensorSpec("c", (), 4),
    ]
    with pytest.raises(ConfigError) as e:
        tensor_specs([("a", torch.zeros(1)), ("a", torch.zeros(1))])
    assert e.value.field == "named"


def test_layer_partition_groups_per_block() -> None:
    assert layer_key("blocks.3.attn.w") == "blocks.3"
    assert layer_key("tok_emb.weight") == "tok_emb"
    assert layer_key("ln_f.bias") == "ln_f"
    assert layer_key("0.weight") == "0"
    specs = tensor_specs(Tiny())
    plan = build_plan(specs, 2, "layer")
    keys = [sorted({layer_key(s.name) for s in f.slices}) for f in plan.fragments]
    assert keys == [["blocks.1", "ln_f", "tok_emb"], ["blocks.0", "blocks.2"]]
    plan5 = build_plan(specs, 5, "layer")
    assert [{layer_key(s.name) for s in f.slices} for f in plan5.fragments] == [
        {"tok_emb"},
        {"blocks.0"},
        {"blocks.1"},
        {"blocks.2"},
        {"ln_f"},
    ]
    assert plan5.fragment_of("blocks.1.mlp.bias") == (2,)
    with pytest.raises(ConfigError) as e:
        build_plan(specs, 6, "layer")
    assert e.value.field == "num_fragments" and "5" in str(e.value)


def test_tensor_partition_round_robin() -> None:
    specs = tensor_specs(Tiny())
    plan = build_plan(specs, 4, "tensor")
    for i, s in enumerate(specs):
        assert plan.fragment_of(s.name) == (i % 4,)
    with pytest.raises(ConfigError) as e:
        build_plan(specs, len(specs) + 1, "tensor")
    assert e.value.field == "num_fragments"


def gpt_specs(layers: int = 4, d: int = 128, vocab: int = 256, ctx: int = 256) -> list[TensorSpec]:
    specs = [TensorSpec("tok_emb.weight", (vocab, d), 4), TensorSpec("pos_emb.weight", (ctx, d), 4)]
    for i in range(layers):
        b = f"blocks.{i}."
        specs += [
            TensorSpec(b + "ln1.weight", (d,), 4),
            TensorSpec(b + "ln1.bias", (d,), 4),
            TensorSpec(b + "attn.qkv.weight", (3 * d, d), 4),
            TensorSpec(b + "attn.qkv.bias", (3 * d,), 4),
            TensorSpec(b + "attn.proj.weight", (d, d), 4),
            TensorSpec(b + "attn.proj.bias", (d,), 4),
            TensorSpec(b + "ln2.weight", (d,), 4),
            TensorSpec(b + "ln2.bias", (d,), 4),
            TensorSpec(b + "mlp.fc.weight", (4 * d, d), 4),
            TensorSpec(b + "mlp.fc.bias", (4 * d,), 4),
            TensorSpec(b + "mlp.proj.weight", (d, 4 * d), 4),
            TensorSpec(b + "mlp.proj.bias", (d,), 4),
        ]
    return [*specs, TensorSpec("ln_f.weight", (d,), 4), TensorSpec("ln_f.bias", (d,), 4)]


def test_split_rows_fixes_small_model_imbalance() -> None:
    """docs/design.md §3.1: 24 fragments of a 4-layer ~0.8M GPT are badly skewed unless rows
    split."""
    specs = gpt_specs()
    whole = build_plan(specs, 24, "balanced")
    split = build_plan(specs, 24, "balanced", split_rows=True)
    layer = build_plan(specs, 6, "layer")
    assert whole.imbalance > 1.8  # 1.2K..65K params per fragment
    assert split.imbalance < 1.15  # big tensors cut into quarter-fragment row chunks
    assert layer.imbalance > split.imbalance
    coverage_ok(split, specs)
    assert len(split.fragment_of("blocks.0.mlp.fc.weight")) > 1


# ---------------------------------------------------------------- gather / scatter


def test_gather_returns_views_and_scatter_round_trips() -> None:
    torch.manual_seed(0)
    model = Tiny()
    tensors = dict(model.named_parameters())
    plan = build_plan(tensor_specs(model), 5, split_rows=True)
    original = {n: t.detach().clone() for n, t in tensors.items()}
    gen = torch.Generator().manual_seed(1)
    for p in range(plan.num_fragments):
        pieces = gather(plan, p, tensors)
        assert [tuple(x.shape) for x in pieces] == [
            (
                (s.rows[1] - s.rows[0], *plan.spec(s.name).shape[1:])
                if s.rows
                else plan.spec(s.name).shape
            )
            for s in plan.fragments[p].slices
        ]
        saved = [x.clone() for x in pieces]
        new = [torch.randn(x.shape, generator=gen) for x in pieces]
        scatter(plan, p, tensors, new)
        for x, v in zip(gather(plan, p, tensors), new, strict=True):
            assert torch.equal(x, v)
        scatter(plan, p, tensors, saved)
    for n, t in tensors.items():
        assert torch.equal(t, original[n])
    # writing through a gathered view changes the model (also for a row slice)
    first = plan.fragments[0].slices[0]
    view = gather(plan, 0, tensors)[0]
    view.fill_(7.0)
    target = (
        tensors[first.name]
        if first.rows is None
        else tensors[first.name][first.rows[0] : first.rows[1]]
    )
    assert torch.all(target == 7.0)


def test_scatter_casts_and_validates_before_writing() -> None:
    specs = [TensorSpec("a", (4, 3), 4), TensorSpec("b", (5,), 4)]
    plan = build_plan(specs, 1)
    tensors = {"a": torch.zeros(4, 3), "b": torch.zeros(5)}
    scatter(plan, 0, tensors, [torch.ones(4, 3, dtype=torch.bfloat16), torch.arange(5)])
    assert torch.all(tensors["a"] == 1) and torch.equal(tensors["b"], torch.arange(5.0))
    before = {n: t.clone() for n, t in tensors.items()}
    bad_calls = [
        [torch.zeros(4, 3)],  # count
        [torch.zeros(4, 3), torch.zeros(6)],  # shape
        [torch.zeros(4, 3), torch.zeros(5, dtype=torch.complex64)],  # dtype
    ]
    for values in bad_calls:
        with pytest.raises(ConfigError) as e:
            scatter(plan, 0, tensors, values)
        assert e.value.field == "values"
        for n, t in tensors.items():
            assert torch.equal(t, before[n])  # nothing written
    int_tensors = {
        "a": torch.zeros(4, 3, dtype=torch.int32),
        "b": torch.zeros(5, dtype=torch.int32),
    }
    with pytest.raises(ConfigError) as e:
        scatter(plan, 0, int_tensors, [torch.zeros(4, 3), torch.zeros(5)])
    assert e.value.field == "values"
    with pytest.raises(ConfigError) as e:
        gather(plan, 1, tensors)
    assert e.value.field == "fragment"
    with pytest.raises(ConfigError) as e:
        gather(plan, 0, {"a": tensors["a"]})
    assert e.value.field == "tensors"
    with pytest.raises(ConfigError) as e:
        gather(plan, 0, {"a": torch.zeros(3, 4), "b": tensors["b"]})
    assert e.value.field == "tensors"


# ---------------------------------------------------------------- bad input


SPECS = [TensorSpec("a", (4,), 4), TensorSpec("b", (2, 2), 4), TensorSpec("c", (), 2)]


@pytest.mark.parametrize(
    ("call", "field"),
    [
        (lambda: build_plan(SPECS, 0), "num_fragments"),
        (lambda: build_plan(SPECS, -1), "num_fragments"),
        (lambda: build_plan(SPECS, 1.5), "num_fragments"),  # type: ignore[arg-type]
        (lambda: build_plan(SPECS, True), "num_fragments"),
        (lambda: build_plan(SPECS, 2, sync_every=0), "sync_every"),
        (lambda: build_plan(SPECS, 2, sync_every=-3), "sync_every"),
        (lambda: build_plan(SPECS, 2, "rows"), "partition"),
        (lambda: build_plan([], 1), "specs"),
        (lambda: build_plan([*SPECS, TensorSpec("a", (1,), 4)], 1), "specs"),
        (lambda: build_plan([*SPECS, ("d", (1,), 4)], 1), "specs"),  # type: ignore[list-item]
        (lambda: build_plan(SPECS, 4), "num_fragments"),
        (lambda: build_plan(SPECS, 4, "tensor"), "num_fragments"),
        (lambda: build_plan(SPECS, 4, "layer"), "num_fragments"),
        (lambda: build_plan(SPECS, 2, offsets=[0]), "offsets"),
        (lambda: build_plan(SPECS, 2, offsets=[0, 2]), "offsets"),
        (lambda: build_plan(SPECS, 2, offsets=[-1, 0]), "offsets"),
        (lambda: build_plan(SPECS, 2, "layer", split_rows=True), "split_rows"),
        (lambda: build_plan(SPECS, 1).due(-1), "step"),
        (lambda: build_plan(SPECS, 1).fragment_of("zz"), "name"),
        (lambda: TensorSpec("x", (2,), 0), "itemsize"),
        (lambda: TensorSpec("x", (2,), -4), "itemsize"),
        (lambda: TensorSpec("x", (2, -1), 4), "shape"),
        (lambda: TensorSpec("x", (2.0,), 4), "shape"),  # type: ignore[arg-type]
        (lambda: TensorSpec("", (2,), 4), "name"),
    ],
)
def test_bad_input_raises_config_error(call: object, field: str) -> None:
    with pytest.raises(ConfigError) as e:
        call()  # type: ignore[operator]
    assert e.value.field == field
    assert isinstance(e.value, ValueError)
    assert field in str(e.value)


def test_error_messages_are_helpful() -> None:
    with pytest.raises(ConfigError, match="balanced"):
        build_plan(SPECS, 1, "nope")
    with pytest.raises(ConfigError, match="split_rows"):
        build_plan(SPECS, 4)
    with pytest.raises(ConfigError, match="'a'"):
        build_plan([*SPECS, TensorSpec("a", (1,), 4)], 1)
    # with split_rows the same request works: 'a' has 4 rows
    plan = build_plan(SPECS, 4, split_rows=True)
    coverage_ok(plan, SPECS)


def test_zero_size_tensors_never_leave_fragments_empty() -> None:
    specs = [TensorSpec("a", (0, 3), 4), TensorSpec("b", (0,), 4), TensorSpec("c", (2,), 4)]
    plan = build_plan(specs, 3)
    assert all(f.slices for f in plan.fragments)
    coverage_ok(plan, specs)
    allzero = build_plan(specs[:2], 2)
    assert allzero.imbalance == 1.0 and all(f.slices for f in allzero.fragments)


def test_brute_force_opt_helper() -> None:
    assert opt_makespan([3, 3, 2, 2, 2], 2) == 6
    for sizes in itertools.product([1, 2, 5], repeat=4):
        assert opt_makespan(list(sizes), 1) == sum(sizes)
