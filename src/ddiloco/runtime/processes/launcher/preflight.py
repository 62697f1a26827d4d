"""Pre-flight for ``--runtime processes``: refuse a run that cannot train, before any
process starts.

A broken model or data set otherwise shows only as processes that crash and are restarted
until the launcher gives up, with the cause buried in their logs. Here the launcher's own
process builds what every process builds (:class:`RunSetup`: the model, its fragment plan,
the shards and the eval batches, with the validation those already do) and checks the model
contract on it (:mod:`ddiloco.runtime.contract`, as the simulated clock does): the device,
the precision, the vocabulary against the data's, the context against ``train.seq_len``,
one training forward/backward on a real batch and one evaluation batch. About 1.5 s for
gpt-1m on 2 CPU cores, most of it splitting the corpus.
"""

from __future__ import annotations

import gc
import os
import time
from dataclasses import dataclass, replace

from ddiloco.config import RunConfig
from ddiloco.core.shards import local_plan
from ddiloco.runtime.contract import assemble, check_contract
from ddiloco.runtime.processes.launcher.devices import assign_gpus, visible_gpus
from ddiloco.runtime.processes.memory import trim_heap


@dataclass(frozen=True)
class Report:
    seq_len: int
    seconds: float


def check(config: RunConfig, method: str = "decoupled") -> Report:
    """Raise a :class:`DDiLoCoError` naming why ``config`` cannot train as processes. The
    model and data it built are given back to the system before it returns: the launcher
    lives as long as the run (issue 28)."""
    started = time.monotonic()
    try:
        seq_len = _check(config, method)
    finally:
        gc.collect()
        trim_heap()
    return Report(seq_len, time.monotonic() - started)


def _check(config: RunConfig, method: str) -> int:
    if config.runtime == "ray":  # the learners' device is on their nodes, not this driver's:
        # a learner that cannot use it exits naming the cause (78), and the run stops
        config = replace(config, train=replace(config.train, device="cpu"))
    if config.train.entry:  # the user's loop must be there before any learner starts
        from ddiloco.runtime.processes.learner.own_loop import resolve_entry

        resolve_entry(config.train.entry)
    setup = assemble(config, method)
    check_contract(setup)  # (first: it says when the device does not exist at all)
    if config.train.parallel == "fsdp":  # every parameter split on its first dim, or refused
        local_plan(setup.plan, config.processes.ranks, 0)  # naming the one that cannot be
    if setup.method.fragments and config.runtime == "processes":  # (Ray: num_gpus; a
        # data-parallel job checks its ranks' devices itself)
        assign_gpus(config, setup.slots, visible_gpus(os.environ))
    return setup.seq_len
