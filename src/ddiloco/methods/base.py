"""What a training method is: the :class:`Method` record every method file builds, and the
helpers they share. The package (``ddiloco.methods``) holds the registry of method files."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ddiloco.config import RUNTIMES, RunConfig, SyncConfig

FRAGMENTS = "fragments"
DATA_PARALLEL = "data_parallel"


@dataclass(frozen=True)
class Method:
    """How one training method runs; built from the run config by its file's function."""

    name: str
    family: str  # FRAGMENTS (a syncer merges fragments) or DATA_PARALLEL (one global model)
    sync: SyncConfig  # the fragment-sync knobs this method runs with (the config's, adjusted)
    waits_for_merge: bool = False  # lock-step: wait for a fragment tau steps after pushing it
    elastic: bool = False  # data-parallel: shrink and grow on failures instead of restarting
    runtimes: tuple[str, ...] = RUNTIMES  # where it runs (``config.RUNTIMES``' names)

    @property
    def fragments(self) -> bool:
        return self.family == FRAGMENTS


def published_mean_step(config: RunConfig) -> dict[str, Any]:
    """The plain-mean baselines' merge and outer step as DiLoCo and Streaming DiLoCo publish
    them (a plain average; Nesterov at ``sync.mean_outer_lr`` and ``mean_outer_momentum``):
    ``SyncConfig`` fields to replace."""
    sync = config.sync
    return {
        "merge_rule": "mean",
        "outer_lr": sync.mean_outer_lr,
        "outer_momentum": sync.mean_outer_momentum,
    }
