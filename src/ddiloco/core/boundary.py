"""The step boundary: what a learner does between two inner steps, for every clock.

Call order, once per boundary (the simulated engine and the learner processes both do it):

1. :meth:`StepBoundary.answers` with the asks that arrived: it snapshots the fragments to
   send (after the step that just ended) and returns them, to encode and send in order;
2. :meth:`StepBoundary.apply` with the merged fragments that arrived: it overwrites (or
   blends) them and returns the fragments rebased, for the progress report and the ledger.
   Answers come first, so an answer keeps the progress a merged fragment overwrites;
3. :meth:`StepBoundary.must_wait`: whether the learner may start its next step.

A learner that never waits (Decoupled DiLoCo) answers exactly what it was asked. A lock-step
learner (``waits_for_merge``: Streaming DiLoCo, DiLoCo, Decoupled's K = M corner) also pushes
each fragment on its own schedule (when the plan says it is due, unasked), answers an ask
only for a fragment it has not pushed on its current base (a newcomer owes the rounds that
opened while it was away), and waits until the merged fragment of every push made ``tau``
steps ago has arrived. A waiting learner calls the boundary again (``step_end=False``) when
something arrives. No I/O and no clock: the runtime decides when.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from ddiloco.core.learner_state import Answer, LearnerSync
from ddiloco.core.rounds import UNSOLICITED


class StepBoundary:
    """One learner's boundary policy, around its :class:`LearnerSync`."""

    def __init__(self, sync: LearnerSync, *, overlap: int, waits_for_merge: bool) -> None:
        self.sync = sync
        self.overlap = overlap
        self.waits_for_merge = waits_for_merge
        self.sent: dict[int, tuple[int, int]] = {}  # fragment -> (step, base) of its last push

    def answers(
        self,
        asks: Mapping[int, int],
        params: Mapping[str, torch.Tensor],
        step_end: bool = True,
        final: bool = False,
    ) -> list[Answer]:
        """The answers to send now, in order: a lock-step learner's own pushes of the
        fragments due at this step (``step_end``: once per step), then the asks (fragment ->
        round id) it owes; ``final`` (the syncer's final rounds): every ask is owed."""
        out: list[Answer] = []
        sync = self.sync
        if self.waits_for_merge and step_end and sync.step > 0:
            for p in sync.plan.due(sync.step):
                if p not in self.sent:
                    out.append(self._answer(p, UNSOLICITED, params))
        for p, round_id in sorted(asks.items()):
            if final or not (self.waits_for_merge and p in self.sent):
                out.append(self._answer(p, round_id, params))
        return out

    def _answer(self, p: int, round_id: int, params: Mapping[str, torch.Tensor]) -> Answer:
        answer = self.sync.answer(p, round_id, params)
        self.sent[p] = (self.sync.step, self.sync.versions[p])
        return answer

    def apply(
        self,
        inbox: Mapping[int, tuple[int, Sequence[torch.Tensor]]],
        params: Mapping[str, torch.Tensor],
    ) -> list[int]:
        """Apply the merged fragments that arrived (fragment -> (version, values)); returns
        the fragments rebased (an older version than the one held is ignored)."""
        rebased = []
        for p, (version, values) in sorted(inbox.items()):
            if self.sync.apply(p, version, values, params):
                self.sent.pop(p, None)
                rebased.append(p)
        return rebased

    def must_wait(self) -> bool:
        """Lock-step only: a fragment pushed ``tau`` or more steps ago has not come back."""
        if not self.waits_for_merge:
            return False
        step = self.sync.step
        return any(step - pushed >= self.overlap for pushed, _ in self.sent.values())

    def forget(self) -> None:
        """The learner's state was replaced (a crash, a copy from a peer): nothing is owed."""
        self.sent.clear()
