"""A finished simulated run's summary: quality, tokens by fate, goodput, uptime, bytes."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ddiloco.core import ledger as reasons

if TYPE_CHECKING:
    from ddiloco.runtime.sim.engine import FragmentSim

# Waste caused by failures; the rest is the algorithm's own (overlap overwrites, staleness).
FAILURE_REASONS = (reasons.CRASH, reasons.LOST_IN_FLIGHT)


def summarize(sim: FragmentSim, final_loss: float) -> dict[str, Any]:
    """The summary.json of one method.

    goodput = (tokens trained - tokens lost to failures) / (tokens trained + tokens the
    learners could have trained while down or waiting in lock-step): the paper's "useful
    compute over allocated compute". token_efficiency = merged / trained is the algorithm's
    own share, reported apart so the two effects are not mixed (docs/decisions.md).
    """
    ledger = sim.ledger.summary()
    now = sim.clock.now
    per_step = sim.config.train.batch_size * sim.seq_len
    lost_capacity = 0.0
    for n in sim.nodes:
        down = n.down_seconds + (now - n.down_since if n.down_since is not None else 0.0)
        step = sim.config.hardware.step_seconds * sim.step_times.speed[n.id]
        lost_capacity += down / step * per_step
    mean_step = sim.config.hardware.step_seconds
    lost_capacity += sim.idle_seconds / mean_step * per_step
    merged = float(ledger["tokens_merged"])  # type: ignore[arg-type]
    wasted: dict[str, float] = ledger["tokens_wasted"]  # type: ignore[assignment]
    lost_to_failures = sum(wasted.get(r, 0.0) for r in FAILURE_REASONS)
    return {
        "method": sim.method.name,
        "eval_loss": final_loss,
        "tokens": sim.tokens,
        "tokens_merged": merged,
        "tokens_wasted": wasted,
        "ledger_balanced": ledger["balanced"],
        "goodput": (sim.tokens - lost_to_failures) / max(sim.tokens + lost_capacity, 1.0),
        "token_efficiency": merged / max(sim.tokens, 1),
        "uptime": sim.up_seconds / now if now > 0 else 1.0,
        "idle_seconds": sim.idle_seconds,
        "virtual_seconds": now,
        "bytes_sent": sim.bytes_up,
        "bytes_received": sim.bytes_down,
        "bytes_peer_recovery": sim.bytes_peer,
        "bytes_per_token": (sim.bytes_up + sim.bytes_down) / max(sim.tokens, 1),
        "rounds": sim.syncer.counts.get("merged_rounds", 0),
        "answers": dict(sorted(sim.syncer.counts.items())),
        "plan": {
            "fragments": sim.plan.num_fragments,
            "imbalance": sim.plan.imbalance,
            "peak_bytes_per_step": sim.plan.peak_bytes_per_step,
        },
    }
