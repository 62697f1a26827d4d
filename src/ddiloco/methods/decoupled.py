"""Decoupled DiLoCo, and its synchronous corner (K = M) as a baseline."""

from __future__ import annotations

from ddiloco.config import RunConfig
from ddiloco.methods.base import FRAGMENTS, Method


def decoupled(config: RunConfig) -> Method:
    """Decoupled DiLoCo: exactly the config's sync settings; learners never wait."""
    return Method("decoupled", FRAGMENTS, config.sync)


def decoupled_sync(config: RunConfig) -> Method:
    """The synchronous corner (K = M): the same fragments, weights and RDA, but every merge
    waits for all learners and each learner waits for its merged fragment tau steps after
    pushing it, so a straggler idles everyone (the paper's "K = 8" row)."""
    sync = config.sync.replace_rounds(quorum=config.train.learners, grace=False)
    return Method("decoupled_sync", FRAGMENTS, sync, waits_for_merge=True)
