"""DiLoCo (Douillard et al. 2023): the whole model every H steps, everyone waits."""

from __future__ import annotations

import dataclasses

from ddiloco.config import RunConfig
from ddiloco.methods.base import FRAGMENTS, Method, published_mean_step


def diloco(config: RunConfig) -> Method:
    """One fragment (the whole model) every ``diloco.inner_steps`` steps, all learners, a
    plain average, and every learner waits for the merge before going on (tau = 0)."""
    sync = dataclasses.replace(
        config.sync,
        fragments=1,
        sync_every=config.diloco.inner_steps,
        partition="tensor",
        split_rows=False,
    ).replace_rounds(overlap=0, quorum=config.train.learners, grace=False)
    return Method(
        "diloco", FRAGMENTS, published_mean_step(sync, config.diloco), waits_for_merge=True
    )
