"""Merged fragments rank by rank (syncer/broadcast.py, learner/sharded_engine.py's ``agreed``),
without a network: a sharded learner's every rank receives exactly its rows, which put back
together are the fragment; a learner of one link receives it whole; a rank link new to the
syncer gets only the fragments newer than its learner holds; ranks apply only the versions
all of them hold."""

from __future__ import annotations

import pytest
import torch

from ddiloco.core.codec import CodecSpec, decode_tensors
from ddiloco.core.plans import TensorSpec, build_plan
from ddiloco.core.shards import assemble, local_plan
from ddiloco.runtime.processes import protocol
from ddiloco.runtime.processes.learner.sharded_engine import agreed
from ddiloco.runtime.processes.syncer.broadcast import Broadcast

PLAN = build_plan([TensorSpec("w", (7, 3), 4), TensorSpec("b", (5,), 4)], 2, "balanced")
FP32 = CodecSpec("fp32")
Sent = list[tuple[int, int, protocol.Message, bytes, int]]


def rig() -> tuple[Broadcast, Sent]:
    sent: Sent = []
    return Broadcast(PLAN, FP32, lambda *frame: sent.append(frame)), sent


def values_of(p: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g) for shape in PLAN.shapes()[p]]


@pytest.mark.parametrize("ranks", [2, 3])
def test_each_rank_of_a_sharded_learner_gets_only_its_rows_and_a_plain_learner_all(ranks):
    out, sent = rig()
    out.hello(0, 1)
    out.hello(1, ranks)
    p, values = 0, values_of(0)
    nbytes = out.fragment([0, 1], p, 5, values, [(1, 2, 3)])
    whole = [f for f in sent if f[0] == 0]
    assert [(m, r, f) for m, r, _, _, f in whole] == [(0, 0, p)]
    got = decode_tensors(whole[0][3], expected_shapes=PLAN.shapes()[p])
    assert all(torch.equal(a, b) for a, b in zip(got, values, strict=True))
    rows = sorted((f for f in sent if f[0] == 1), key=lambda f: f[1])
    assert [r for _, r, _, _, _ in rows] == list(range(ranks))  # one frame per rank
    assert all(msg == protocol.Fragment(5, [(1, 2, 3)]) for _, _, msg, _, _ in rows)
    parts = [
        decode_tensors(payload, expected_shapes=local_plan(PLAN, ranks, r).shapes()[p])
        for _, r, _, payload, _ in rows
    ]
    back = assemble(PLAN, p, parts)  # each rank's rows, put back together: the fragment
    assert all(torch.equal(a, b) for a, b in zip(back, values, strict=True))
    assert nbytes == len(whole[0][3])  # the first learner's bytes
    assert sum(len(payload) for _, _, _, payload, _ in rows) < 2 * nbytes


def test_a_rank_link_new_to_the_syncer_gets_only_the_fragments_newer_than_its_learner_holds():
    out, sent = rig()
    fragments = [values_of(0, 1), values_of(1, 2)]
    hello = protocol.PartHello(1, 2, [3, 0])
    assert not out.catch_up(4, hello, [3, 2], fragments)  # its learner's hello not yet heard
    assert not sent
    out.hello(4, 3)
    assert not out.catch_up(4, hello, [3, 2], fragments)  # not the rank count its learner said
    out.hello(4, 2)
    assert out.catch_up(4, hello, [3, 2], fragments)
    assert [(m, r, msg, f) for m, r, msg, _, f in sent] == [(4, 1, protocol.Fragment(2, []), 1)]
    rows = decode_tensors(sent[0][3], expected_shapes=local_plan(PLAN, 2, 1).shapes()[1])
    assert sum(t.numel() for t in rows) == local_plan(PLAN, 2, 1).fragments[1].numel


def test_ranks_apply_only_the_versions_every_rank_holds():
    assert agreed([]) == []
    assert agreed([[3, -1, 2]]) == [(0, 3), (2, 2)]  # one rank: what it holds
    held = [[3, 4, -1, 2], [3, 3, -1, 2], [3, 4, 1, 2]]
    assert agreed(held) == [(0, 3), (3, 2)]  # a rank behind, or one holding none, holds it back
