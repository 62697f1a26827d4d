"""Training strategies as small plug-ins: each turns a run config into engine settings.

Decoupled DiLoCo, Streaming DiLoCo and DiLoCo are the same fragment-sync engine with
different knobs (how many fragments, the quorum, grace, merge rule, and whether a learner
waits for merged fragments); data-parallel is its own loop. Adding a strategy means adding a
function here, not forking the loop.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from ddiloco.config import RunConfig, SyncConfig


@dataclass(frozen=True)
class SimSettings:
    """How a fragment-sync method runs on the simulated engine."""

    name: str
    sync: SyncConfig
    lockstep: bool  # learners wait for a fragment tau steps after pushing it


def decoupled(config: RunConfig) -> SimSettings:
    """Decoupled DiLoCo: exactly the config's sync settings, learners never wait."""
    return SimSettings("decoupled", config.sync, lockstep=False)


def decoupled_sync(config: RunConfig) -> SimSettings:
    """Decoupled DiLoCo's synchronous corner (K = M): the same fragments, weights and RDA,
    but every merge waits for all learners and each learner waits for its merged fragment
    tau steps after pushing it, so a straggler idles everyone (the paper's "K = 8" row)."""
    sync = dataclasses.replace(config.sync, quorum=config.train.learners, grace=False)
    return SimSettings("decoupled_sync", sync, lockstep=True)


def streaming(config: RunConfig) -> SimSettings:
    """Streaming DiLoCo: same fragments, H and tau; all learners in every merge (K = M), a
    plain average with its own outer learning rate, and lock-step per fragment."""
    sync = dataclasses.replace(
        config.sync,
        quorum=config.train.learners,
        grace=False,
        merge_rule="mean",
        outer_lr=config.sync.mean_outer_lr,
    )
    return SimSettings("streaming", sync, lockstep=True)


def diloco(config: RunConfig) -> SimSettings:
    """DiLoCo: one fragment (the whole model) every ``diloco_inner_steps`` steps, all
    learners, plain average, and every learner waits for the merge before going on."""
    sync = dataclasses.replace(
        config.sync,
        fragments=1,
        sync_every=config.sync.diloco_inner_steps,
        strategy="tensor",
        split_rows=False,
        overlap=0,
        quorum=config.train.learners,
        grace=False,
        merge_rule="mean",
        outer_lr=config.sync.mean_outer_lr,
    )
    return SimSettings("diloco", sync, lockstep=True)


FRAGMENT_STRATEGIES: dict[str, Callable[[RunConfig], SimSettings]] = {
    "decoupled": decoupled,
    "decoupled_sync": decoupled_sync,
    "streaming": streaming,
    "diloco": diloco,
}
