"""A frozen view of the syncer service: what the status page and the summary read.

The service builds one each beat (:func:`view_of`, on its own thread), and again at the end
of the run; ``status.snapshot_of`` and ``summary.service_summary`` are pure functions of it.
So neither reads the service's live objects, a page request never races the loop, and both
are tested from a view built by hand. Every mapping in a view is a copy: the service may go
on changing its own.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from ddiloco.checkpoints.write import CheckpointWriter
from ddiloco.config import RunConfig
from ddiloco.core.restart_ledger import RestartLedger
from ddiloco.core.syncer_state import SyncerState
from ddiloco.report.summary import Uptime
from ddiloco.runtime.processes.syncer.actions import ActionGate
from ddiloco.runtime.processes.syncer.attendance import Attendance
from ddiloco.runtime.processes.syncer.connections import Connections
from ddiloco.runtime.processes.syncer.evaluator import Evaluator
from ddiloco.runtime.processes.syncer.roster import Roster
from ddiloco.runtime.processes.syncer.store import SyncerStore
from ddiloco.runtime.run import RunSetup


@dataclass(frozen=True)
class LearnerView:
    learner: int
    presence: str  # roster.Presence's value: up, down, left
    step: int | None  # its step if live
    incarnation: int | None
    address: str
    silent_seconds: float | None  # since its last message (None: never heard)
    last_merged: Mapping[str, float] | None  # its last merged answer (status.StatusBoard)


@dataclass(frozen=True)
class SyncerView:
    run: str
    t: float  # the service clock's now
    data_source: str
    tokens: int
    budget: int
    time_limit: float  # train.max_virtual_seconds on this clock (0: none)
    global_step: int
    versions: tuple[int, ...]
    learners: tuple[LearnerView, ...]
    answers: Mapping[str, int]  # the core's counts (merged_rounds among them)
    ledger: Mapping[str, Any]  # RestartLedger.summary()
    ledger_errors: int
    ledger_contradictions: tuple[str, ...]
    ledger_restart: Mapping[str, int]
    ledger_late_answers: int
    refused: Mapping[str, int]  # frames the wire refused, by reason
    gatekeeper: Mapping[str, int]
    actions: Mapping[str, Any]  # the status page's actions: enabled, and their counts
    service: Mapping[str, int]  # the service's own counts
    bytes_sent: int
    bytes_received: int
    uptime: float  # the share of time a quorum was live
    learner_uptime: float
    down_seconds: float  # learner-seconds lost to outages, the open ones up to t
    step_seconds: float  # the run's step time, as the syncer clock measures it
    tokens_per_step: int
    checkpoint: str | None  # the latest checkpoint, relative to the run
    checkpoint_writes: Mapping[str, Any]
    evaluations: Mapping[str, Any]
    store_writes: int


class Board(Protocol):
    """What a view reads of the status board (``status.StatusBoard``)."""

    run_id: str

    @property
    def last_merged(self) -> Mapping[int, Mapping[str, float]]: ...


class Viewed(Protocol):
    """What a view is built from (``SyncerService`` is one; this module never imports it)."""

    setup: RunSetup
    config: RunConfig
    syncer: SyncerState
    ledger: RestartLedger
    attendance: Attendance
    conn: Connections
    actions: ActionGate
    roster: Roster
    checkpoints: CheckpointWriter
    evaluator: Evaluator
    store: SyncerStore
    tokens: int
    bytes_received: int

    @property
    def counts(self) -> Mapping[str, int]: ...

    @property
    def status(self) -> Board: ...


def uptime_at(up: Uptime, now: float, live: int) -> float:
    """The uptime's share at ``now``, the stretch since its last account included (``live``
    learners until now): ``Uptime.share`` counts only the accounted stretches, which the
    service closes at a membership change and at the end, so mid-run, with nobody joining
    or leaving, a page would see the run's uptime fall (81% of a run up all the time)."""
    if up.first is None:
        return 1.0
    elapsed = now - up.first
    if elapsed <= 0:
        return 1.0
    open_ = now - up.mark if up.mark is not None and live >= up.quorum else 0.0
    return min(1.0, (up.seconds + max(0.0, open_)) / elapsed)


def view_of(svc: Viewed, now: float) -> SyncerView:
    """The service as it stands at ``now`` (call it on the service's thread)."""
    live, heard = svc.syncer.live, svc.attendance.last_heard
    learners = tuple(
        LearnerView(
            learner=member.learner,
            presence=member.presence.value,
            step=live.get(member.learner),
            incarnation=member.incarnation,
            address=member.address,
            silent_seconds=(
                None if member.learner not in heard else round(now - heard[member.learner], 3)
            ),
            last_merged=svc.status.last_merged.get(member.learner),
        )
        for member in svc.roster.members()
    )
    config, ledger = svc.config, svc.ledger
    return SyncerView(
        run=svc.status.run_id,
        t=now,
        data_source=config.data.source,
        tokens=svc.tokens,
        budget=config.train.tokens,
        time_limit=config.train.max_virtual_seconds,
        global_step=svc.syncer.global_step,
        versions=tuple(svc.syncer.versions),
        learners=learners,
        answers=dict(sorted(svc.syncer.counts.items())),
        ledger=ledger.summary(),
        ledger_errors=ledger.errors,
        ledger_contradictions=tuple(ledger.contradictions),
        ledger_restart=dict(ledger.restart),
        ledger_late_answers=ledger.late_answers,
        refused=dict(sorted(svc.conn.wire.refused.items())),
        gatekeeper=dict(sorted(svc.conn.gate.counts.items())),
        actions={"enabled": svc.actions.enabled, **svc.actions.counts},
        service=dict(sorted(svc.counts.items())),
        bytes_sent=svc.conn.bytes_sent,
        bytes_received=svc.bytes_received,
        uptime=uptime_at(svc.attendance.uptime, now, len(live)),
        learner_uptime=svc.attendance.learner_uptime(now, config.train.learners),
        down_seconds=svc.attendance.down_total(now),
        step_seconds=svc.syncer.step_seconds or 1.0,
        tokens_per_step=svc.setup.tokens_per_step,
        checkpoint=svc.checkpoints.relative(),
        checkpoint_writes=svc.checkpoints.summary(),
        evaluations=svc.evaluator.summary(),
        store_writes=svc.store.writes,
    )
