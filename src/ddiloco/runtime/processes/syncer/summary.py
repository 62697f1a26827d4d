"""What a syncer reports at the end of a run: the summary of ``report/summary.py``'s schema
(the launcher adds the runtime's keys) plus what the service counted on the way — a pure
function of the service's last :class:`~.view.SyncerView`.

Call order: build that view after the last merge, the final evaluation and
``ledger.close()``, so the ledger balances and the goodput counts every outage up to its
``t``.
"""

from __future__ import annotations

from typing import Any

from ddiloco.data.info import bits_per_byte
from ddiloco.report.summary import fragment_goodput
from ddiloco.runtime.processes.syncer.view import SyncerView


def service_summary(view: SyncerView, final: float) -> dict[str, Any]:
    """The run's summary; ``final`` is the global model's last eval loss. Learner time lost
    to outages (down since detected, until back or the view's ``t``) is counted as lost
    capacity at the run's step time."""
    ledger = view.ledger
    lost_capacity = view.down_seconds / view.step_seconds * view.tokens_per_step
    wasted: dict[str, float] = dict(ledger["tokens_wasted"])
    return {
        "eval_loss": final,
        "eval_bpb": bits_per_byte(final, view.data_source),
        "checkpoint": view.checkpoint,
        "checkpoint_writes": dict(view.checkpoint_writes),
        "tokens": view.tokens,
        "tokens_merged": ledger["tokens_merged"],
        "tokens_wasted": wasted,
        "tokens_carried": ledger["tokens_carried"],
        "ledger_balanced": ledger["balanced"] and not view.ledger_errors,
        "ledger_errors": view.ledger_errors,
        "ledger_contradictions": list(view.ledger_contradictions),
        "ledger_restart": dict(view.ledger_restart),
        "ledger_late_answers": view.ledger_late_answers,
        "goodput": fragment_goodput(view.tokens, wasted, lost_capacity),
        "uptime": view.uptime,
        "learner_uptime": view.learner_uptime,
        "bytes_sent": view.bytes_sent,
        "bytes_received": view.bytes_received,
        "rounds": view.answers.get("merged_rounds", 0),
        "answers": dict(view.answers),
        "refused": dict(view.refused),
        "service": dict(view.service),
        "gatekeeper": dict(view.gatekeeper),
        "evaluations": dict(view.evaluations),
        "store_writes": view.store_writes,
        "versions": list(view.versions),
    }
