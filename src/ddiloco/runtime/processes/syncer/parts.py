"""The syncer's side of a sharded learner's answers: its ranks' parts, each on the rank's own
link, put together all or nothing (core/parts.py) before the service sees a whole answer.

Rank 0's part is the ``answer`` message on the learner's link (``ranks`` > 1, its payload
its rows), rank r's an ``answer_part`` on link ``L{m}r{r}`` (:mod:`.connections`). Each part
is decoded against its rank's rows of the fragment (core/shards.py's local plan): a part that
does not decode, or contradicts its siblings, is refused and counted, and its answer can then
only be dropped whole. An answer whose parts do not all come within ``bound_seconds`` of the
first is dropped (``answers_incomplete``) and said, naming the learner, the fragment and the
ranks missing. Every rank link hears the verdict on its parts (merged, or dropped and why),
so no rank keeps a part pending that the syncer is done with.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, MutableMapping, Sequence
from dataclasses import dataclass

import torch

from ddiloco.core.codec import CodecSpec, PackedTensors, encode_tensors
from ddiloco.core.parts import Assembly, PartAssembler, PartError
from ddiloco.core.plans import FragmentPlan
from ddiloco.core.rounds import AnswerMeta
from ddiloco.core.shards import Assembled, local_plan
from ddiloco.errors import ConfigError, DDiLoCoError
from ddiloco.runtime.processes import protocol
from ddiloco.runtime.processes.syncer.connections import Incoming
from ddiloco.runtime.processes.transport.ratelog import RateLimitedLog
from ddiloco.runtime.processes.transport.wire import WireError, decode_update

log = logging.getLogger(__name__)

Key = tuple[int, int, int]
JOURNAL_CODEC = CodecSpec("fp32")  # an assembled answer as the journal keeps it (lossless)


@dataclass(frozen=True)
class Head:
    """What rank 0's part said, as the service checked it when it came."""

    answer: AnswerMeta
    overtaken: bool


class AnswerParts:
    """Open assemblies, and which assembled answers' ranks still await a verdict.

    ``send(m, rank, message)`` reaches learner ``m``'s rank link ``rank`` (dropped when it has
    none); ``counts`` is the service's tally."""

    def __init__(
        self,
        plan: FragmentPlan,
        bound_seconds: float,
        send: Callable[[int, int, protocol.Message], None],
        counts: MutableMapping[str, int],
    ) -> None:
        self.plan = plan
        self.send = send
        self.assembler: PartAssembler[Head] = PartAssembler(bound_seconds, counts=counts)
        self.rows: dict[tuple[int, int], list[list[tuple[int, ...]]]] = {}  # (R, r) -> shapes
        self.ranks: dict[Key, int] = {}  # assembled answers awaiting their verdict -> R
        self.say = RateLimitedLog(log)

    def shapes(self, ranks: int, rank: int, fragment: int) -> list[tuple[int, ...]]:
        """Rank ``rank`` of ``ranks``' rows of ``fragment``: the shapes its part decodes to."""
        held = self.rows.get((ranks, rank))
        if held is None:
            held = self.rows[(ranks, rank)] = local_plan(self.plan, ranks, rank).shapes()
        return held[fragment]

    def add(
        self,
        key: Key,
        fragment: int,
        rank: int,
        ranks: int,
        payload: memoryview,
        now: float,
        head: Head | None = None,
    ) -> tuple[Head, Assembled] | None:
        """One part (``head``: rank 0's); the head and the whole fragment's values once this
        was the last one missing. Raises ``WireError`` (a part that does not decode) or
        ``PartError`` (one that contradicts its siblings): refused, not kept. A part is
        decoded here once (it must decode, finite) and held as it came: the whole answer
        decodes each tensor when it is read (issue 28)."""
        shapes = self.shapes(ranks, rank, fragment)
        decode_update(payload, shapes)  # (its values are read again from the bytes)
        packed = PackedTensors(bytes(payload), expected_shapes=shapes)
        whole = self.assembler.add(key, fragment, rank, ranks, packed, now, head)
        if whole is None:
            return None
        assert whole.head is not None
        self.ranks[key] = ranks
        return whole.head, whole.values(self.plan)

    def is_open(self, key: Key) -> bool:
        """Whether answer ``key`` is being put together (a part came, not all of them)."""
        return key in self.assembler.open

    def receive(
        self, msg: Incoming, refuse: Callable[[str, int, str], None]
    ) -> tuple[Head, Assembled] | None:
        """A message on rank ``msg.rank``'s link of sharded learner ``msg.learner``: its part
        of an answer (the whole answer when this part completed it), or a beat; anything else
        is refused (``refuse(reason, learner, why)``), as is a part that is not this rank's
        of this learner's answer, does not decode, or contradicts its siblings."""
        m, rank = msg.learner, msg.rank
        if msg.kind == protocol.Beat.KIND:
            return None
        if msg.kind != protocol.AnswerPart.KIND:
            refuse("refused_kind", m, f"{msg.kind[:32]!r} on rank {rank}'s link")
            return None
        try:
            part = protocol.AnswerPart.parse(msg.meta, self.plan.num_fragments)
            if part.key[0] != m or part.rank != rank:
                raise ConfigError("meta.key", part.key, f"not rank {rank} of learner {m}")
            return self.add(part.key, part.fragment, rank, part.ranks, msg.payload, msg.at)
        except (DDiLoCoError, WireError, PartError) as exc:
            refuse("refused_part", m, f"rank {rank}'s part: {exc}")
            return None

    def expire(self, now: float, ended: bool = False) -> list[Assembly[Head]]:
        """Answers whose parts did not all come in time: dropped whole, said, and their rank
        links told; the caller tells rank 0 (when its part came: ``head``). ``ended``: the
        run is over, so every answer still missing a part is dropped now (counted and said,
        not left open and unsaid)."""
        dropped = self.assembler.expire(math.inf if ended else now)
        for a in dropped:
            m = a.key[0]
            self.say(
                f"incomplete-{m}",
                "syncer: dropped learner %d's answer to fragment %d: rank(s) %s of its %d "
                + ("sent no part before the run ended" if ended else "sent no part within %.0fs")
                + " (lost on the way, or a rank gone); never merged half (answers_incomplete)",
                m,
                a.fragment,
                ",".join(map(str, a.missing)),
                a.ranks,
                *(() if ended else (self.assembler.bound,)),
            )
            self.tell(a.key, a.ranks, "incomplete")
        return dropped

    def judged(self, key: Key, verdict: str) -> None:
        """An assembled answer was merged or dropped: its rank links hear it (no-op for an
        answer of one link)."""
        ranks = self.ranks.pop(key, None)
        if ranks is not None:
            self.tell(key, ranks, verdict)

    def tell(self, key: Key, ranks: int, verdict: str) -> None:
        for rank in range(1, ranks):
            self.send(key[0], rank, protocol.Verdict(key, verdict))

    @staticmethod
    def journal(values: Sequence[torch.Tensor]) -> bytes:
        """An assembled answer's payload as the journal keeps it (no one sent it whole)."""
        return encode_tensors(values, JOURNAL_CODEC)
