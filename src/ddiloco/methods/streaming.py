"""Streaming DiLoCo (Douillard et al. 2025): fragments in lock-step, a plain average."""

from __future__ import annotations

from ddiloco.config import RunConfig
from ddiloco.methods.base import FRAGMENTS, Method, published_mean_step


def streaming(config: RunConfig) -> Method:
    """The same fragments, H and tau as Decoupled; every learner in every merge (K = M), a
    plain average with its own outer learning rate, and each learner waits for its merged
    fragment tau steps after pushing it."""
    sync = config.sync.replace_rounds(quorum=config.train.learners, grace=False)
    sync = published_mean_step(sync, config.streaming)
    return Method("streaming", FRAGMENTS, sync, waits_for_merge=True)
