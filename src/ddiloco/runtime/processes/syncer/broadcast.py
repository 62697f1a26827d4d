"""Merged fragments on their way to the learners (decision 121).

A learner of one link gets each merged fragment whole. A sharded learner (its hello says
``ranks`` = R > 1) gets it rank by rank: rank r only its rows (core/shards.py's ``split``),
rank 0 on the learner's link, rank r >= 1 on its own (``L{m}r{r}``), so no rank receives or
holds another's rows and each rank's NIC carries 1/R of the learner's downlink. A rank link
routed after a broadcast (a learner starting, a syncer restarted) says which versions its
learner holds (:class:`~ddiloco.runtime.processes.protocol.PartHello`) and gets its rows of
every newer fragment (:meth:`Broadcast.catch_up`). Which version each rank applies, and when,
the learner's ranks agree among themselves (learner/sharded_engine.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ddiloco.core.codec import CodecSpec, encode_tensors
from ddiloco.core.plans import FragmentPlan
from ddiloco.core.shards import split
from ddiloco.runtime.processes import protocol

# (learner, rank, message, payload, fragment): rank 0 is the learner's own link
Send = Callable[[int, int, protocol.Message, bytes, int], None]


class Broadcast:
    """Each learner's rank count (from its hello), and the sending of merged fragments.

    ``send`` puts one frame on one rank's link (dropped, and counted, when it has none)."""

    def __init__(self, plan: FragmentPlan, codec: CodecSpec, send: Send) -> None:
        self.plan = plan
        self.codec = codec
        self.send = send
        self.ranks: dict[int, int] = {}  # learner -> R, as its latest hello said

    def hello(self, m: int, ranks: int) -> None:
        """Learner ``m``'s life has ``ranks`` ranks (1: one link, whole fragments)."""
        self.ranks[m] = ranks

    def fragment(
        self,
        to: Sequence[int],
        p: int,
        version: int,
        values: Sequence[torch.Tensor],
        keys: list[tuple[int, int, int]],
    ) -> int:
        """Fragment ``p`` at ``version`` to the learners ``to``, each rank its rows; each
        encoding made once per (R, rank). Returns the bytes one learner receives (the first
        one's; a whole fragment's when ``to`` is empty)."""
        message = protocol.Fragment(version, keys)
        payloads: dict[tuple[int, int], bytes] = {}

        def payload(ranks: int, rank: int) -> bytes:
            if (ranks, rank) not in payloads:
                rows = values if ranks == 1 else split(self.plan, p, values, ranks, rank)
                payloads[(ranks, rank)] = encode_tensors(list(rows), self.codec)
            return payloads[(ranks, rank)]

        nbytes = None
        for m in to:
            ranks = self.ranks.get(m, 1)
            for rank in range(ranks):
                self.send(m, rank, message, payload(ranks, rank), p)
            if nbytes is None:
                nbytes = sum(len(payload(ranks, r)) for r in range(ranks))
        return nbytes if nbytes is not None else len(payload(1, 0))

    def catch_up(
        self,
        m: int,
        hello: protocol.PartHello,
        versions: Sequence[int],
        fragments: Sequence[Sequence[torch.Tensor]],
    ) -> bool:
        """Rank ``hello.rank`` of learner ``m`` says which versions its learner holds: send
        it its rows of every fragment this syncer holds newer (``versions``/``fragments``:
        the global ones). False (nothing sent) when the rank count is not the one its
        learner's latest hello said: a rank link that beat its learner's hello is routed by
        then, and the hello's own catch-up (:meth:`fragment`) reaches it."""
        ranks = self.ranks.get(m)
        if ranks != hello.ranks:
            return False
        for p, version in enumerate(versions):
            if version > max(0, hello.versions[p]):
                rows = split(self.plan, p, fragments[p], ranks, hello.rank)
                payload = encode_tensors(rows, self.codec)
                self.send(m, hello.rank, protocol.Fragment(version, []), payload, p)
        return True
