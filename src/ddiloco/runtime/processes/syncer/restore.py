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

from ddiloco.core.restart_ledger import RestartLedger
from ddiloco.core.syncer_state import SyncerState
from ddiloco.errors import ConfigError
from ddiloco.runtime.processes.syncer.store_format import FragmentRecord, Key, StoreError


def record_of(
    syncer: SyncerState,
    p: int,
    tokens: int,
    applied: list[Key],
    ledger: dict[str, Any] | None = None,
) -> FragmentRecord:
    """Fragment ``p``'s durable record, right after a merge. ``applied`` is every answer key
    merged into it so far (the service keeps that list: the core forgets merged ids);
    ``ledger`` the ledger's state counting this merge and no later one."""
    return FragmentRecord(
        fragment=p,
        version=syncer.versions[p],
        next_round_id=syncer.next_round_id(p),
        global_step=syncer.global_step,
        tokens=tokens,
        values=syncer.fragments[p],
        outer=syncer.outer[p].state_dict(),
        applied=applied,
        merged_base=syncer.merged_bases(p),
        ledger=ledger,
        norm_window=list(syncer.norm_windows[p].values),
    )


@torch.no_grad()
def restore(syncer: SyncerState, records: dict[int, FragmentRecord]) -> tuple[int, int]:
    """Load durable records into a freshly built syncer; returns (global step, tokens)."""
    step, tokens = 0, 0
    for p, rec in sorted(records.items()):
        if not 0 <= p < len(syncer.fragments):
            raise StoreError("fragment", p, f"the plan has {len(syncer.fragments)} fragments")
        try:
            syncer.restore_fragment(
                p,
                rec.values,
                rec.outer,
                rec.version,
                rec.next_round_id,
                rec.applied,
                rec.merged_base,
                norm_window=rec.norm_window,
            )
        except ConfigError as exc:
            raise StoreError(exc.field, exc.value, exc.why) from None
        step = max(step, rec.global_step)
        tokens = max(tokens, rec.tokens)
    syncer.load_clock(step)
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
