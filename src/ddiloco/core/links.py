"""The network model both clocks share: each learner's links to the syncer and its peers.

A link carries one transfer at a time, in order: a transfer queued behind another starts when
the link frees up (how a large fragment delays the next one on a slow link). ``link_slow``
divides a learner's bandwidth by a factor, ``link_cut`` stops its links until a time (transfers
wait, none is dropped). Pure bookkeeping on the times handed in: the simulated clock's
``Network`` computes arrivals with it, the real-process proxy decides when to release frames.
"""

from __future__ import annotations

Link = tuple[str, int]  # (kind, learner), kind e.g. "up", "down", "peer"


class Links:
    """When each link is free, each learner's bandwidth divisor and the end of its cut."""

    def __init__(self) -> None:
        self.free_at: dict[Link, float] = {}
        self.factor: dict[int, float] = {}  # learner -> bandwidth divisor (link_slow)
        self.cut_until: dict[int, float] = {}  # learner -> its links carry nothing until

    @staticmethod
    def seconds(nbytes: int, gbps: float) -> float:
        return nbytes * 8.0 / (gbps * 1e9)

    def start(self, link: Link, ready: float) -> float:
        """When a transfer ready at ``ready`` can start: the link free and not cut."""
        return max(ready, self.free_at.get(link, 0.0), self.cut_until.get(link[1], 0.0))

    def carry(self, link: Link, start: float, nbytes: int, gbps: float) -> float:
        """Occupy ``link`` from ``start`` with ``nbytes`` at ``gbps`` / the learner's factor;
        return when the last byte is through."""
        done = start + self.seconds(nbytes, gbps) * self.factor_of(link[1])
        self.free_at[link] = done
        return done

    def slow(self, learner: int, factor: float) -> None:
        """Divide the learner's bandwidth by ``factor`` (1.0 restores it)."""
        self.factor[learner] = factor

    def factor_of(self, learner: int) -> float:
        return self.factor.get(learner, 1.0)

    def cut(self, learner: int, until: float) -> None:
        """The learner's links carry nothing until ``until`` (a shorter cut does not end a
        longer one); transfers resume after."""
        self.cut_until[learner] = max(until, self.cut_until.get(learner, 0.0))

    def is_cut(self, learner: int, now: float) -> bool:
        return now < self.cut_until.get(learner, 0.0)

    def reset(
        self, learner: int, now: float, kinds: tuple[str, ...] = ("up", "down", "peer")
    ) -> None:
        """A dead learner's queued transfers die with it."""
        for kind in kinds:
            self.free_at[(kind, learner)] = now
