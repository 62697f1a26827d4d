"""Data-parallel training, the baseline users run today: one global model, a synchronous
all-reduce every step; a lost replica restarts the job from its last checkpoint, or (elastic)
the job shrinks without it and grows back when it returns."""

from __future__ import annotations

from ddiloco.config import RunConfig
from ddiloco.methods.base import DATA_PARALLEL, Method


def data_parallel(config: RunConfig) -> Method:
    # a torchrun job on real processes; not on Ray yet
    return Method("data_parallel", DATA_PARALLEL, config.sync, runtimes=("sim", "processes"))


def elastic_dp(config: RunConfig) -> Method:
    # shrinking and growing a real job is torchft's work: the simulated clock only
    return Method("elastic_dp", DATA_PARALLEL, config.sync, elastic=True, runtimes=("sim",))
