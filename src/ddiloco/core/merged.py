"""What one merge produced: the merged fragment to broadcast, what went into it, and the
ledger credits its caller books (:meth:`MergeResult.book`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ddiloco.core.ledger import SyncerLedger
from ddiloco.core.rounds import ClosedRound


@dataclass(frozen=True)
class MergeResult:
    """A merged fragment to broadcast, and what went into it."""

    fragment: int
    version: int
    tensors: list[torch.Tensor]  # the new global fragment (the syncer's own tensors: copy to send)
    round: ClosedRound
    weights: dict[int, float]  # learner -> summed weight in this merge
    update_norm: float  # L2 norm of the merged outer gradient
    # per answer (in round order): the factor its delta was scaled by (< 1: norm-clipped).
    # A replay of the merge applies ``robust.scaled`` with it; the round's answers already
    # carry the credited counters the weights came from.
    scales: tuple[float, ...] = ()
    schedule_scale: float = 1.0  # the inner learning-rate factor of the outer step
    fraction: float = 1.0  # the share of a sync period the outer step covers
    credits: tuple[tuple[Any, float], ...] = ()  # (answer key, weight) for the ledger
    # per answer: re-taken against the current value (core/stale.py); empty: the option is off
    anchored: tuple[bool, ...] = ()

    def book(self, ledger: SyncerLedger | None) -> None:
        """Count this merge's answers as merged in ``ledger``. The caller books a merge
        once it stands: the simulated clock at once, the processes' syncer right before it
        writes the merge to disk (the file's ledger counts this merge and no later one)."""
        if ledger is not None:
            for key, weight in self.credits:
                ledger.merged_answer(key, weight)

    def staleness(self) -> float:
        """Versions behind, on average over the round's answers: 0 when every answer's base
        is the version this merge replaced."""
        answers = self.round.answers
        if not answers:
            return 0.0
        return sum(self.version - 1 - a.base_version for a in answers) / len(answers)

    def record(self, broadcast_bytes: int) -> dict[str, Any]:
        """The ``round`` record every runtime writes to metrics.jsonl (without its time)."""
        rnd = self.round
        return {
            "kind": "round",
            "fragment": self.fragment,
            "version": self.version,
            "opened_at": rnd.opened_at,
            "quorum_at": rnd.quorum_at,
            "grace": rnd.grace,
            "answers": len(rnd.answers),
            "asked": rnd.asked,
            "weights": {str(k): v for k, v in sorted(self.weights.items())},
            "update_norm": self.update_norm,
            "schedule_scale": self.schedule_scale,
            "fraction": self.fraction,
            "staleness": self.staleness(),
            "broadcast_bytes": broadcast_bytes,
        }
