"""A fragment plan seen from one rank of a sharded learner (core/shards.py): for any plan and
any number of ranks, the ranks' local plans cover each fragment exactly once, gathering on
a rank's shard tensors is the split of gathering on the full tensors, and assembling the
ranks' parts gives the full fragment back."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ddiloco.core.fragments import gather, scatter
from ddiloco.core.plans import PARTITIONS, TensorSpec, build_plan
from ddiloco.core.shards import assemble, local_plan, shard_rows, split
from ddiloco.errors import ConfigError

SETTINGS = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def plans(draw: st.DrawFn):
    n = draw(st.integers(1, 7))
    specs = []
    for i in range(n):
        rows = draw(st.integers(1, 9))
        rest = draw(st.lists(st.integers(1, 4), max_size=2))
        specs.append(TensorSpec(f"blocks.{i // 2}.w{i}", (rows, *rest), 4))
    p = draw(st.integers(1, min(4, len(specs) + 3)))
    partition = draw(st.sampled_from(PARTITIONS))
    split_rows = draw(st.booleans())
    try:
        plan = build_plan(specs, p, partition, split_rows=split_rows)
    except ConfigError:  # more fragments than the partition can make non-empty
        plan = build_plan(specs, 1, partition)
    world = draw(st.integers(1, 5))
    return plan, world


def full_tensors(plan) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {s.name: torch.randn(s.shape) for s in plan.specs}


def shards_of(tensors: dict[str, torch.Tensor], world: int, rank: int) -> dict[str, torch.Tensor]:
    out = {}
    for name, t in tensors.items():
        lo, hi = shard_rows(t.shape[0], world, rank)
        out[name] = t[lo:hi]
    return out


@given(plans())
@SETTINGS
def test_the_ranks_parts_of_every_fragment_assemble_into_it(case):
    plan, world = case
    full = full_tensors(plan)
    locals_ = [local_plan(plan, world, r) for r in range(world)]
    for lp in locals_:
        assert [f.offset for f in lp.fragments] == [f.offset for f in plan.fragments]
    for p in range(plan.num_fragments):
        values = gather(plan, p, full)
        parts = [gather(locals_[r], p, shards_of(full, world, r)) for r in range(world)]
        for r in range(world):  # gathering a shard is splitting the full fragment
            cut = split(plan, p, values, world, r)
            assert len(cut) == len(parts[r])
            assert all(torch.equal(a, b) for a, b in zip(cut, parts[r], strict=True))
        together = assemble(plan, p, parts)
        assert all(torch.equal(a, b) for a, b in zip(together, values, strict=True))
        assert sum(lp.fragments[p].numel for lp in locals_) == plan.fragments[p].numel


@given(plans())
@SETTINGS
def test_scattering_each_ranks_part_writes_the_whole_fragment(case):
    plan, world = case
    full = full_tensors(plan)
    target = {n: torch.zeros_like(t) for n, t in full.items()}
    for p in range(plan.num_fragments):
        values = gather(plan, p, full)
        for r in range(world):  # each rank writes its part into its shard (views: in place)
            scatter(local_plan(plan, world, r), p, shards_of(target, world, r),
                    split(plan, p, values, world, r))  # fmt: skip
    assert all(torch.equal(target[n], full[n]) for n in full)


def test_a_rank_may_hold_no_rows_and_a_scalar_cannot_be_sharded():
    assert shard_rows(5, 4, 3) == (5, 5)  # chunks of 2: ranks 0..2 hold 2, 2, 1; rank 3 none
    assert [shard_rows(7, 3, r) for r in range(3)] == [(0, 3), (3, 6), (6, 7)]
    plan = build_plan([TensorSpec("scale", (), 4), TensorSpec("w", (4, 2), 4)], 1)
    with pytest.raises(ConfigError, match="scalar"):
        local_plan(plan, 2, 0)


def test_a_sharded_learner_is_refused_where_it_cannot_run():
    import dataclasses

    from ddiloco.config import ProcessesConfig, RunConfig, TrainConfig, load_config
    from ddiloco.launch import check_parallel

    with pytest.raises(ConfigError, match=r"train.parallel.*known: ddp, fsdp"):
        load_config(None, ["train.parallel='tp'"])
    with pytest.raises(ConfigError, match=r"train.parallel.*processes.ranks >= 2"):
        load_config(None, ["runtime='processes'", "train.parallel='fsdp'"])
    fsdp = RunConfig(model="gpt-tiny", runtime="processes", methods=("decoupled",),
                     train=TrainConfig(learners=2, parallel="fsdp"),
                     processes=ProcessesConfig(ranks=2))  # fmt: skip
    with pytest.raises(ConfigError, match=r"train.parallel.*runtime"):  # no ranks in the sim
        check_parallel(dataclasses.replace(fsdp, runtime="sim"))
    with pytest.raises(ConfigError, match=r"data_parallel.*DDP job"):
        check_parallel(dataclasses.replace(fsdp, methods=("decoupled", "data_parallel")))
    check_parallel(fsdp)  # processes, decoupled: fine (ranks checked with the config above)


def test_a_model_with_a_parameter_fsdp_cannot_split_is_refused_before_anything_starts(
    tmp_path, monkeypatch
):
    from ddiloco.config import load_config
    from ddiloco.runtime.processes.launcher import preflight

    (tmp_path / "scalar_model.py").write_text(
        "import torch\n"
        "from ddiloco.models.registry import build_model\n"
        "def build():\n"
        "    model = build_model('gpt-tiny')\n"
        "    model.temperature = torch.nn.Parameter(torch.tensor(1.0))  # a scalar\n"
        "    return model\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    sets = ["model='scalar_model:build'", "runtime='processes'", "methods=['decoupled']",
            "processes.ranks=2", "train.parallel='fsdp'"]  # fmt: skip
    with pytest.raises(ConfigError, match=r"'temperature' is a scalar"):
        preflight.check(load_config(None, sets))


def test_a_peer_ranks_snapshot_of_other_rows_is_refused_naming_the_parameter():
    from ddiloco.runtime.processes.learner.sharded import rows_refusal

    rows = {"w": (3, 4), "b": (3,)}
    good = {"trainer": {"model": {"w": torch.zeros(3, 4), "b": torch.zeros(3)}}}
    assert rows_refusal(good, rows) is None
    other = {"trainer": {"model": {"w": torch.zeros(2, 4), "b": torch.zeros(3)}}}  # R = 3's
    assert rows_refusal(other, rows) == "its 'w' has shape (2, 4); this rank holds (3, 4)"
    assert "lacks" in (rows_refusal({"trainer": {"model": {"w": torch.zeros(3, 4)}}}, rows) or "")
    assert "lacks" in (rows_refusal({"trainer": 7}, rows) or "")
