"""The bridge between the core's :class:`SyncerState` and the store's durable records.

:func:`record_of` is what a merge writes (before its broadcast); :func:`restore` loads the
records into a freshly built syncer; :func:`restore_service` is a restarted syncer's whole
restore: the records, the answer keys merged into each fragment, and the ledger snapshot
that counts exactly the durable merges (docs/decisions.md 33).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch

from ddiloco.core.fragment_state import Key
from ddiloco.core.restart_ledger import RestartLedger
from ddiloco.core.syncer_state import SyncerState
from ddiloco.errors import ConfigError
from ddiloco.runtime.processes.syncer.store_format import FragmentRecord, StoreError


def record_of(
    syncer: SyncerState,
    p: int,
    tokens: int,
    applied: list[Key],
    ledger: dict[str, Any] | None = None,
) -> FragmentRecord:
    """Fragment ``p``'s durable record, right after a merge: the core's fragment state and
    where the run stands. ``applied`` is every answer key merged into it so far (the service
    keeps that list: the core forgets merged ids); ``ledger`` the ledger's state counting
    this merge and no later one."""
    state = syncer.fragment_state(p, applied)
    step, step_seconds, sync_seconds = syncer.clock_state()
    return FragmentRecord(
        **vars(state),
        fragment=p,
        global_step=step,
        tokens=tokens,
        ledger=ledger,
        ema=(step_seconds, sync_seconds),
    )


@torch.no_grad()
def restore(syncer: SyncerState, records: dict[int, FragmentRecord]) -> tuple[int, int]:
    """Load durable records into a freshly built syncer; returns (global step, tokens). The
    syncer clock comes back from the newest record (the highest global step)."""
    step, tokens = 0, 0
    ema: tuple[float | None, float | None] = (None, None)
    for p, rec in sorted(records.items()):
        if not 0 <= p < len(syncer.fragments):
            raise StoreError("fragment", p, f"the plan has {len(syncer.fragments)} fragments")
        try:
            syncer.load_fragment(p, rec)
        except ConfigError as exc:
            raise StoreError(exc.field, exc.value, exc.why) from None
        if rec.global_step >= step:
            step, ema = rec.global_step, rec.ema
        tokens = max(tokens, rec.tokens)
    syncer.load_clock(step, *ema)
    return step, tokens


@dataclass
class Restored:
    """What a syncer starts from: ``restored`` is False for an empty store (a new run)."""

    restored: bool = False
    step: int = 0
    tokens: int = 0
    applied: dict[int, list[Key]] = field(default_factory=lambda: defaultdict(list))


def restore_service(
    syncer: SyncerState,
    ledger: RestartLedger,
    records: dict[int, FragmentRecord],
    ledger_state: dict[str, Any] | None,
) -> Restored:
    """Load a store's ``records`` and ``ledger_state`` (``SyncerStore.load`` and its
    ``ledger_state`` after) into a fresh ``syncer`` and ``ledger`` (nothing for an empty
    store)."""
    out = Restored(restored=bool(records))
    if records:
        out.step, out.tokens = restore(syncer, records)
        for p, rec in records.items():
            out.applied[p] = list(rec.applied)
    if ledger_state is not None:  # the snapshot counting the durable merges
        ledger.load_state(ledger_state)
        out.tokens = max(out.tokens, ledger.trained_tokens)
    return out
