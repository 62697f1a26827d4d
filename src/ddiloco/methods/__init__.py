"""Training methods as small plug-ins: each is one file declaring what the method *does*.

A :class:`Method` is a policy over the same core, read by every runtime:

- the fragment-sync knobs it runs with (:attr:`Method.sync`: fragments, the quorum K, the
  grace window, the merge rule, the outer optimizer; K = M with no grace: every learner
  joins every merge);
- whether a learner waits for its merged fragment ``tau`` steps after pushing it
  (:attr:`Method.waits_for_merge`, lock-step) or never waits (Decoupled DiLoCo);
- or, for the data-parallel family, whether the job shrinks and grows (:attr:`elastic`).

The runtimes never test a method's name: the simulated engine and the learner processes run
the core's step boundary (:mod:`ddiloco.core.boundary`) with ``waits_for_merge``; the
data-parallel family has its own loop on each clock. Adding a method is adding a file here
and a line in :data:`REGISTRY` (docs/extending.md).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ddiloco.config import METHODS, RunConfig, SyncConfig
from ddiloco.errors import ConfigError

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


def method_for(config: RunConfig, name: str) -> Method:
    """The method ``name`` as ``config`` sets it up."""
    build = REGISTRY.get(name)
    if build is None:
        raise ConfigError("methods", name, f"known: {', '.join(REGISTRY)}")
    return build(config)


def _registry() -> dict[str, Callable[[RunConfig], Method]]:
    from ddiloco.methods import data_parallel, decoupled, diloco, streaming

    return {
        "decoupled": decoupled.decoupled,
        "decoupled_sync": decoupled.decoupled_sync,
        "streaming": streaming.streaming,
        "diloco": diloco.diloco,
        "data_parallel": data_parallel.data_parallel,
        "elastic_dp": data_parallel.elastic_dp,
    }


REGISTRY: dict[str, Callable[[RunConfig], Method]] = _registry()
assert tuple(REGISTRY) == METHODS, "config.METHODS lists the registry's names, in order"
