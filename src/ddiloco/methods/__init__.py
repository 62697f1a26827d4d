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

from ddiloco.config import METHODS, RunConfig
from ddiloco.errors import ConfigError
from ddiloco.methods import data_parallel, decoupled, diloco, streaming
from ddiloco.methods.base import DATA_PARALLEL, FRAGMENTS, Method, published_mean_step

__all__ = ["DATA_PARALLEL", "FRAGMENTS", "REGISTRY", "Method", "method_for", "published_mean_step"]


def method_for(config: RunConfig, name: str) -> Method:
    """The method ``name`` as ``config`` sets it up."""
    build = REGISTRY.get(name)
    if build is None:
        raise ConfigError("methods", name, f"known: {', '.join(REGISTRY)}")
    return build(config)


REGISTRY: dict[str, Callable[[RunConfig], Method]] = {
    "decoupled": decoupled.decoupled,
    "decoupled_sync": decoupled.decoupled_sync,
    "streaming": streaming.streaming,
    "diloco": diloco.diloco,
    "data_parallel": data_parallel.data_parallel,
    "elastic_dp": data_parallel.elastic_dp,
}
assert tuple(REGISTRY) == METHODS, "config.METHODS lists the registry's names, in order"
