"""A finished simulated run's summary: what the nodes, the ledger and the links measured,
in the schema every runtime writes (:mod:`ddiloco.report.summary`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ddiloco.data.info import bits_per_byte
from ddiloco.report.summary import fragment_goodput, summary

if TYPE_CHECKING:
    from ddiloco.runtime.sim.engine import FragmentSim


def summarize(sim: FragmentSim, final_loss: float) -> dict[str, Any]:
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
