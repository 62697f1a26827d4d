"""A finished simulated run's summary: what the nodes, the ledger and the links measured,
in the schema every runtime writes (:mod:`ddiloco.report.summary`)."""

from __future__ import annotations

from typing import Any, Protocol

from ddiloco.checkpoints.write import CheckpointWriter
from ddiloco.config import RunConfig
from ddiloco.core.ledger import TokenLedger
from ddiloco.core.plans import FragmentPlan
from ddiloco.core.syncer_state import SyncerState
from ddiloco.data.info import bits_per_byte
from ddiloco.methods.base import Method
from ddiloco.report.summary import Uptime, fragment_goodput, summary
from ddiloco.runtime.run import RunSetup
from ddiloco.runtime.sim.clock import EventQueue
from ddiloco.runtime.sim.node import Node
from ddiloco.runtime.sim.world import StepTimes


class Finished(Protocol):
    """What the summary reads of a finished run (``FragmentSim`` is one; this module never
    imports the engine)."""

    setup: RunSetup
    config: RunConfig
    method: Method
    plan: FragmentPlan
    syncer: SyncerState
    ledger: TokenLedger
    clock: EventQueue
    nodes: list[Node]
    step_times: StepTimes
    checkpoints: CheckpointWriter | None
    uptime: Uptime
    tokens: int
    idle_seconds: float
    bytes_up: int
    bytes_down: int
    bytes_peer: int


def summarize(sim: Finished, final_loss: float) -> dict[str, Any]:
    """The summary.json of one method. The capacity lost is what the learners could have
    trained while down or waiting in lock-step (goodput's denominator)."""
    ledger = sim.ledger.summary()
    now = sim.clock.now
    per_step = sim.setup.tokens_per_step
    lost_capacity = 0.0
    for n in sim.nodes:
        down = n.down_seconds + (now - n.down_since if n.down_since is not None else 0.0)
        step = sim.config.hardware.step_seconds * sim.step_times.speed[n.id]
        lost_capacity += down / step * per_step
    mean_step = sim.config.hardware.step_seconds
    lost_capacity += sim.idle_seconds / mean_step * per_step
    wasted: dict[str, float] = ledger["tokens_wasted"]  # type: ignore[assignment]
    return summary(
        method=sim.method.name,
        runtime="sim",
        eval_loss=final_loss,
        eval_bpb=bits_per_byte(final_loss, sim.config.data.source),
        checkpoint=sim.checkpoints.relative() if sim.checkpoints is not None else None,
        tokens=sim.tokens,
        tokens_merged=float(ledger["tokens_merged"]),  # type: ignore[arg-type]
        tokens_wasted=wasted,
        tokens_carried=ledger["tokens_carried"],
        ledger_balanced=bool(ledger["balanced"]),
        goodput=fragment_goodput(sim.tokens, wasted, lost_capacity),
        uptime=sim.uptime.share(now),
        idle_seconds=sim.idle_seconds,
        seconds=now,
        bytes_sent=sim.bytes_up,
        bytes_received=sim.bytes_down,
        bytes_peer_recovery=sim.bytes_peer,
        rounds=sim.syncer.counts.get("merged_rounds", 0),
        answers=dict(sorted(sim.syncer.counts.items())),
        plan={
            "fragments": sim.plan.num_fragments,
            "imbalance": sim.plan.imbalance,
            "peak_bytes_per_step": sim.plan.peak_bytes_per_step,
        },
    )
