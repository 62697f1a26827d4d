"""What a learner's hello may claim, checked against what the syncer knows (decision 89).

A hello says which fragment versions the learner holds and the step it stands at. A merge
is durable before it is broadcast, so an honest learner never holds a version the syncer's
store lacks: a learner that does was trained against another store (lost, restored from an
older backup, another run's), and its answers could never merge; it is refused, told why.
(The step a hello claims is bounded by the service itself: ``SyncerService.bounded_step``.)
Pure: the service passes what it knows.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path


def ahead_of_store(m: int, held: Sequence[int], have: Sequence[int], store: Path) -> str | None:
    """Why learner ``m``, holding fragment versions ``held``, cannot take part in a run
    whose store (at ``store``) has ``have``; None when it holds no version the store lacks."""
    ahead = [p for p, v in enumerate(held) if v > have[p]]
    if not ahead:
        return None
    if not any(have):
        return (
            f"learner {m} holds fragment versions up to {max(held)} but this "
            f"syncer's store {store} is empty: was the syncer started with "
            "another --store, or was its store lost? Restore it, or start the run anew"
        )
    p = ahead[0]
    return (
        f"learner {m} holds fragment {p} at version {held[p]} but this syncer's store "
        f"{store} has it at version {have[p]}: the store is older than the run "
        "(restored from an older backup, or another run's store?). Restore the newest "
        "store, or start the run anew"
    )
