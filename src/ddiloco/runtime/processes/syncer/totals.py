"""Each learner life's running totals, so a progress report lost on the way costs nothing.

A progress report says what one step added (its tokens, the fragments rebased since the last
report), and the ledger adds it up. A report that never arrives (dropped or damaged on the
way, held by a proxy that died, queued in a connection that reset) or that arrives after a
later one (a delayed frame) would lose those tokens and rebases for good, and the learner's
next answer would then claim more tokens than the ledger saw it train (a contradiction).

So every report and every answer also carries the life's running totals: the tokens it
reported since it started, and how many times it rebased each fragment. The syncer counts
what a message adds over the last totals it counted for that life: a lost report is counted
by the next message, an answer included (it is counted before the answer is recorded); a late
one adds nothing. A life whose totals are not known from its start (one the syncer restored
from its store, which counted part of it) counts its first message's own increment and takes
its totals from there; the restart ledger covers that gap (core/restart_ledger.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from ddiloco.runtime.processes.protocol import Totals  # tokens, rebases per fragment


@dataclass
class Counted:
    """The last totals counted for one learner life."""

    incarnation: int
    tokens: int  # reported since the life started
    rebases: list[int]  # per fragment: rebases reported since the life started


class RunningTotals:
    """The last totals counted per learner (see the module)."""

    def __init__(self, num_fragments: int) -> None:
        self.num_fragments = num_fragments
        self.last: dict[int, Counted] = {}

    def start(self, learner: int, incarnation: int, from_zero: bool) -> None:
        """A hello of ``incarnation``: a life counted from its start (``from_zero``) begins at
        zero; any other life not known yet is taken up at its first message."""
        last = self.last.get(learner)
        if last is not None and last.incarnation == incarnation:
            return
        if from_zero:
            self.last[learner] = Counted(incarnation, 0, [0] * self.num_fragments)
        else:
            self.last.pop(learner, None)

    def reported(
        self,
        learner: int,
        incarnation: int,
        totals: Totals | None,
        tokens: int,
        rebased: list[int],
    ) -> tuple[int, list[int]]:
        """(tokens, fragments rebased) a progress report adds: over the last totals of its
        life when they are known, else its own increment (``tokens``, ``rebased``), its
        totals then the life's from here on."""
        last = self.last.get(learner)
        if totals is None:
            return tokens, rebased
        if last is None or last.incarnation != incarnation:
            self.last[learner] = Counted(incarnation, totals[0], list(totals[1]))
            return tokens, rebased
        return self._add(last, totals)

    def caught_up(
        self, learner: int, incarnation: int, totals: Totals | None
    ) -> tuple[int, list[int]]:
        """(tokens, fragments rebased) an answer's totals hold beyond the last counted: the
        reports it was sent after that never arrived (nothing when the life's totals are
        not known: an answer may be an old one, re-pushed)."""
        last = self.last.get(learner)
        if totals is None or last is None or last.incarnation != incarnation:
            return 0, []
        return self._add(last, totals)

    def overtaken(
        self, learner: int, incarnation: int, totals: Totals | None, fragment: int
    ) -> bool:
        """True for an answer sent before a rebase of its ``fragment`` already counted (it
        arrived late: its tokens were counted at that rebase)."""
        last = self.last.get(learner)
        if totals is None or last is None or last.incarnation != incarnation:
            return False
        return totals[1][fragment] < last.rebases[fragment]

    @staticmethod
    def _add(last: Counted, totals: Totals) -> tuple[int, list[int]]:
        total, rebases = totals
        added = max(0, total - last.tokens)
        pairs = list(zip(rebases, last.rebases, strict=True))
        rebased = [p for p, (new, old) in enumerate(pairs) if new > old]
        last.tokens = max(last.tokens, total)
        last.rebases = [max(new, old) for new, old in pairs]
        return added, rebased
