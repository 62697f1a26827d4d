"""A sharded learner's answer, put together from its ranks' parts: all or nothing.

A learner of R ranks that shard its parameters (core/shards.py) answers fragment p as R
parts, each sent by its rank on the rank's own connection: rank 0's carries the answer's
metadata (the *head*) and its rows, rank r's its rows and the answer's key. To the syncer
the learner stays one learner: the answer counts only once all R parts have come
(:meth:`PartAssembler.add` then returns the whole), and parts whose siblings do not come
within ``bound_seconds`` of the first are dropped together (:meth:`PartAssembler.expire`):
never merged half. A key assembled or dropped is remembered (a bounded number of them), so a
late or re-pushed part of it starts nothing.

Pure: the caller passes the time and checked values; no I/O, no clock.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import MutableMapping, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import torch

from ddiloco.core.plans import FragmentPlan
from ddiloco.core.shards import Assembled

__all__ = ["Assembly", "PartAssembler", "PartError"]

Key = tuple[int, int, int]  # an answer's (learner, incarnation, seq)
H = TypeVar("H")  # what rank 0's part says about the answer (its metadata)

MAX_OPEN = 4096  # assemblies waiting at once (the oldest is dropped first beyond it)
REMEMBERED = 4096  # keys assembled or dropped, remembered to ignore their late parts


class PartError(ValueError):
    """A part that contradicts its siblings (another rank count or fragment)."""


@dataclass
class Assembly(Generic[H]):
    """The parts of one answer that have come so far."""

    key: Key
    fragment: int
    ranks: int
    first_at: float
    parts: dict[int, Sequence[torch.Tensor]] = field(default_factory=dict)
    head: H | None = None  # rank 0's metadata, once its part came

    @property
    def missing(self) -> list[int]:
        return [r for r in range(self.ranks) if r not in self.parts]

    def values(self, plan: FragmentPlan) -> Assembled:
        """The whole fragment's values (every part has come), each put together when read."""
        return Assembled(plan, self.fragment, [self.parts[r] for r in range(self.ranks)])


class PartAssembler(Generic[H]):
    """The open assemblies of every sharded learner's answers (see the module doc).

    Call order: :meth:`add` for every checked part, :meth:`expire` every turn of the loop.
    """

    def __init__(
        self,
        bound_seconds: float,
        max_open: int = MAX_OPEN,
        counts: MutableMapping[str, int] | None = None,
    ) -> None:
        self.bound = bound_seconds
        self.max_open = max_open
        self.open: OrderedDict[Key, Assembly[H]] = OrderedDict()  # oldest first
        self.closed: OrderedDict[Key, None] = OrderedDict()
        self.counts: MutableMapping[str, int] = Counter() if counts is None else counts

    def add(
        self,
        key: Key,
        fragment: int,
        rank: int,
        ranks: int,
        values: Sequence[torch.Tensor],
        now: float,
        head: H | None = None,
    ) -> Assembly[H] | None:
        """One rank's part (``head``: rank 0's metadata); the whole answer when this was its
        last missing part, else None. A part contradicting its siblings raises
        :class:`PartError` (and is not kept)."""
        if not ranks >= 2 or not 0 <= rank < ranks:
            raise PartError(f"rank {rank} of {ranks}: a part is one of >= 2 ranks")
        if key in self.closed:
            self.counts["parts_late"] += 1  # its answer was assembled or dropped already
            return None
        a = self.open.get(key)
        if a is None:
            a = self.open[key] = Assembly(key, fragment, ranks, now)
        elif (a.ranks, a.fragment) != (ranks, fragment):
            raise PartError(
                f"answer {key}: rank {rank}'s part says fragment {fragment} of {ranks} ranks, "
                f"its siblings fragment {a.fragment} of {a.ranks}"
            )
        if rank in a.parts:
            self.counts["parts_repeated"] += 1  # a re-push: the same values again
        a.parts[rank] = values
        if head is not None:
            a.head = head
        if len(a.parts) < ranks or a.head is None:
            return None
        del self.open[key]
        self._close(key)
        self.counts["answers_assembled"] += 1
        return a

    def expire(self, now: float) -> list[Assembly[H]]:
        """The assemblies whose first part came more than ``bound_seconds`` ago without all
        its siblings (and the oldest beyond ``max_open``): dropped whole, never merged."""
        out = []
        while self.open:
            key, a = next(iter(self.open.items()))
            if now - a.first_at <= self.bound and len(self.open) <= self.max_open:
                break
            del self.open[key]
            self._close(key)
            self.counts["answers_incomplete"] += 1
            out.append(a)
        return out

    def _close(self, key: Key) -> None:
        self.closed[key] = None
        while len(self.closed) > REMEMBERED:
            self.closed.popitem(last=False)
