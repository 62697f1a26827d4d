"""What a training method is: the :class:`Method` record every method file builds, and the
helpers they share. The package (``ddiloco.methods``) holds the registry of method files."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ddiloco.config import RUNTIMES
from ddiloco.config_sync import MeanStepConfig, SyncConfig

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


def published_mean_step(sync: SyncConfig, mean: MeanStepConfig) -> SyncConfig:
    """``sync`` with a plain-mean baseline's merge and outer step, as DiLoCo and Streaming
    DiLoCo publish them: a plain average, the outer step at the method table's ``outer_lr`` and
    ``outer_momentum`` (``[diloco]``, ``[streaming]``), its momentum from the first step."""
    outer = dataclasses.replace(
        sync.outer, lr=mean.outer_lr, momentum=mean.outer_momentum, warmup=0
    )  # (the published step has no momentum warmup)
    return dataclasses.replace(sync, merge_rule="mean", outer=outer)
