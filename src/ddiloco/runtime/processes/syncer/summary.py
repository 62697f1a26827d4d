"""What a syncer reports at the end of a run: the summary of ``report/summary.py``'s schema
(the launcher adds the runtime's keys) plus what the service counted on the way.

Call order: after the last merge, the final evaluation and ``ledger.close()``, so the
ledger balances and the goodput counts every outage up to ``now``.
"""

from __future__ import annotations

from typing import Any, Protocol

from ddiloco.checkpoints.write import CheckpointWriter
from ddiloco.config import RunConfig
from ddiloco.core.restart_ledger import RestartLedger
from ddiloco.core.syncer_state import SyncerState
from ddiloco.data.info import bits_per_byte
from ddiloco.report.summary import fragment_goodput
from ddiloco.runtime.processes.syncer.attendance import Attendance
from ddiloco.runtime.processes.syncer.connections import Connections
from ddiloco.runtime.processes.syncer.evaluator import Evaluator
from ddiloco.runtime.processes.syncer.store import SyncerStore
from ddiloco.runtime.run import RunSetup


class Summarised(Protocol):
    """What the summary reads of the service (``SyncerService`` is one; this module never
    imports the service)."""

    setup: RunSetup
    config: RunConfig
    syncer: SyncerState
    ledger: RestartLedger
    attendance: Attendance
    conn: Connections
    checkpoints: CheckpointWriter
    evaluator: Evaluator
    store: SyncerStore
    tokens: int
    bytes_received: int
    counts: dict[str, int]


def service_summary(svc: Summarised, final: float, now: float) -> dict[str, Any]:
    """The run's summary; ``final`` is the global model's last eval loss. Learner time lost
    to outages (down since detected, until back or ``now``) is counted as lost capacity at
    the run's step time."""
    ledger = svc.ledger.summary()
    down = svc.attendance.down_total(now)
    step = svc.syncer.step_seconds or 1.0
    per_step = svc.setup.tokens_per_step
    lost_capacity = down / step * per_step
    wasted: dict[str, float] = ledger["tokens_wasted"]  # type: ignore[assignment]
    return {
        "eval_loss": final,
        "eval_bpb": bits_per_byte(final, svc.config.data.source),
        "checkpoint": svc.checkpoints.relative(),
        "checkpoint_writes": svc.checkpoints.summary(),
        "tokens": svc.tokens,
        "tokens_merged": ledger["tokens_merged"],
        "tokens_wasted": wasted,
        "tokens_carried": ledger["tokens_carried"],
        "ledger_balanced": ledger["balanced"] and not svc.ledger.errors,
        "ledger_errors": svc.ledger.errors,
        "ledger_contradictions": svc.ledger.contradictions,
        "ledger_restart": dict(svc.ledger.restart),
        "ledger_late_answers": svc.ledger.late_answers,
        "goodput": fragment_goodput(svc.tokens, wasted, lost_capacity),
        "uptime": svc.attendance.uptime.share(now),
        "learner_uptime": svc.attendance.learner_uptime(now, svc.config.train.learners),
        "bytes_sent": svc.conn.bytes_sent,
        "bytes_received": svc.bytes_received,
        "rounds": svc.syncer.counts.get("merged_rounds", 0),
        "answers": dict(sorted(svc.syncer.counts.items())),
        "refused": dict(sorted(svc.conn.wire.refused.items())),
        "service": dict(sorted(svc.counts.items())),
        "gatekeeper": dict(sorted(svc.conn.gate.counts.items())),
        "evaluations": svc.evaluator.summary(),
        "store_writes": svc.store.writes,
        "versions": list(svc.syncer.versions),
    }
