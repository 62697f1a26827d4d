"""One fragment's durable syncer state: what both clocks save and restore.

A restarted syncer (the processes' store, ``runtime/processes/syncer/store.py``) and a resumed
simulated run (``runtime/sim/engine.py``) put a fragment back from the same record, built by
:meth:`SyncerState.fragment_state <ddiloco.core.syncer_state.SyncerState.fragment_state>` and
loaded by ``SyncerState.load_fragment``; how each writes it down (a fragment file, a
checkpoint's resume state) is the runtime's business, what it holds is not.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

Key = tuple[int, int, int]  # an answer's (learner, incarnation, seq)


@dataclass
class FragmentState:
    """Everything a fragment's syncer state is between two merges."""

    version: int
    next_round_id: int
    values: list[torch.Tensor]  # the global fragment
    outer: dict[str, Any]  # its outer optimizer's state_dict: ints, None, lists of tensors
    applied: list[Key] = field(default_factory=list)  # answers merged so far (none twice)
    # (learner, incarnation) -> the highest base merged from that life: an answer on a base
    # at most that is "base already merged", before and after a restart alike
    merged_base: dict[tuple[int, int], int] = field(default_factory=dict)
    norm_window: list[float] = field(default_factory=list)  # robust merging's recent paces
    # the step the last merged round opened at: the outer step's period clock (None: never)
    merged_opened: int | None = None
