"""The syncer's side of a sharded learner's answer parts (syncer/parts.py), without a network:
each part decoded against its rank's rows and the whole put together only when every rank's
part came; a rank link may send only its own parts; verdicts reach every rank link."""

from __future__ import annotations

from collections import defaultdict

import torch

from ddiloco.core.codec import CodecSpec, PackedTensors, decode_tensors, encode_tensors
from ddiloco.core.plans import TensorSpec, build_plan
from ddiloco.core.rounds import AnswerMeta
from ddiloco.core.shards import Assembled, assemble, split
from ddiloco.runtime.processes import protocol
from ddiloco.runtime.processes.syncer.connections import Incoming
from ddiloco.runtime.processes.syncer.parts import AnswerParts, Head

PLAN = build_plan([TensorSpec("w", (7, 3), 4), TensorSpec("b", (5,), 4)], 2, "balanced")
META = AnswerMeta(1, 9, 4, 0, 2, 3, 40, 8, 512)
FP32 = CodecSpec("fp32")


def parts_of(values: list[torch.Tensor], world: int) -> list[memoryview]:
    return [
        memoryview(encode_tensors(split(PLAN, 0, values, world, r), FP32)) for r in range(world)
    ]


def rig() -> tuple[AnswerParts, list[tuple[int, int, protocol.Message]], dict[str, int]]:
    sent: list[tuple[int, int, protocol.Message]] = []
    counts: dict[str, int] = defaultdict(int)
    parts = AnswerParts(PLAN, 4.0, lambda m, r, msg: sent.append((m, r, msg)), counts)
    return parts, sent, counts


def on_link(rank: int, part: protocol.Message, payload: memoryview, at: float = 0.0) -> Incoming:
    return Incoming(1, part.KIND, part.meta(), payload, at, rank)


def test_parts_from_three_ranks_make_the_whole_answer_and_every_rank_hears_its_verdict():
    parts, sent, counts = rig()
    full = [torch.randn(shape) for shape in PLAN.shapes()[0]]
    payloads = parts_of(full, 3)
    refused: list[tuple[str, int, str]] = []
    for rank in (2, 1):
        msg = on_link(rank, protocol.AnswerPart(META.key, 0, rank, 3), payloads[rank])
        assert parts.receive(msg, lambda *a: refused.append(a)) is None  # not whole yet
    head, values = parts.add(META.key, 0, 0, 3, payloads[0], 0.5, Head(META, False)) or (None, [])
    assert head == Head(META, False) and not refused
    assert all(torch.equal(a, b) for a, b in zip(values, full, strict=True))
    assert counts["answers_assembled"] == 1
    parts.judged(META.key, "merged")  # both other ranks' links are told
    assert [(m, r, msg.verdict) for m, r, msg in sent] == [(1, 1, "merged"), (1, 2, "merged")]
    parts.judged(META.key, "merged")  # once
    assert len(sent) == 2


def test_an_assembled_answer_holds_its_parts_as_they_came_and_decodes_a_tensor_when_read():
    parts, _, _ = rig()
    full = [torch.randn(shape) for shape in PLAN.shapes()[0]]
    bf16 = CodecSpec("bf16")
    payloads = [memoryview(encode_tensors(split(PLAN, 0, full, 2, r), bf16)) for r in range(2)]
    assert parts.add(META.key, 0, 1, 2, payloads[1], 0.0) is None
    _, values = parts.add(META.key, 0, 0, 2, payloads[0], 0.1, Head(META, False)) or (None, [])
    assert isinstance(values, Assembled)  # held: bf16 bytes, half of the fp32 fragment
    assert all(isinstance(p, PackedTensors) for p in values.parts)
    assert sum(p.nbytes for p in values.parts) == sum(p.nbytes for p in payloads)
    expected = assemble(PLAN, 0, [decode_tensors(bytes(p)) for p in payloads])
    assert len(values) == len(expected) == len(values[:])
    assert all(torch.equal(a, b) for a, b in zip(values, expected, strict=True))
    assert torch.equal(values[-1], expected[-1])


def test_a_rank_link_may_send_only_its_own_parts_of_its_learners_answers():
    parts, _, _ = rig()
    full = [torch.randn(shape) for shape in PLAN.shapes()[0]]
    payloads = parts_of(full, 2)
    refused: list[tuple[str, int, str]] = []

    def refuse(*why: object) -> None:
        refused.append(why)  # type: ignore[arg-type]

    beat = Incoming(1, "beat", {}, memoryview(b""), 0.0, 1)
    assert parts.receive(beat, refuse) is None and not refused  # a beat: nothing to do
    hello = Incoming(1, "hello", {}, memoryview(b""), 0.0, 1)
    parts.receive(hello, refuse)  # only parts and beats on a rank link
    other = protocol.AnswerPart((2, 9, 4), 0, 1, 2)  # learner 2's answer on learner 1's link
    parts.receive(on_link(1, other, payloads[1]), refuse)
    wrong_rank = protocol.AnswerPart(META.key, 0, 1, 2)
    parts.receive(Incoming(1, "answer_part", wrong_rank.meta(), payloads[1], 0.0, 3), refuse)
    garbage = protocol.AnswerPart(META.key, 0, 1, 2)
    parts.receive(on_link(1, garbage, memoryview(b"DDQB" + bytes(20))), refuse)
    short = memoryview(encode_tensors([torch.randn(2, 2)], FP32))  # not rank 1's rows
    parts.receive(on_link(1, garbage, short), refuse)
    assert [r[0] for r in refused] == ["refused_kind"] + ["refused_part"] * 4, refused
    assert not parts.assembler.open  # nothing refused was kept


def test_an_answer_missing_a_part_is_dropped_whole_and_its_ranks_told():
    parts, sent, counts = rig()
    payloads = parts_of([torch.randn(shape) for shape in PLAN.shapes()[0]], 2)
    parts.add(META.key, 0, 0, 2, payloads[0], 10.0, Head(META, False))
    assert parts.expire(13.9) == []
    (dropped,) = parts.expire(14.1)
    assert dropped.missing == [1] and dropped.head == Head(META, False)
    assert counts["answers_incomplete"] == 1
    assert [(m, r, msg.verdict) for m, r, msg in sent] == [(1, 1, "incomplete")]


def test_at_the_runs_end_every_answer_still_missing_a_part_is_dropped_and_said(caplog):
    parts, sent, counts = rig()
    payloads = parts_of([torch.randn(shape) for shape in PLAN.shapes()[0]], 2)
    parts.add(META.key, 0, 0, 2, payloads[0], 10.0, Head(META, False))
    assert parts.expire(10.5) == []  # well within its bound
    (dropped,) = parts.expire(10.5, ended=True)  # but the run is over: it can never complete
    assert dropped.missing == [1] and counts["answers_incomplete"] == 1
    assert [(m, r, msg.verdict) for m, r, msg in sent] == [(1, 1, "incomplete")]
    assert "before the run ended" in caplog.text and not parts.assembler.open
