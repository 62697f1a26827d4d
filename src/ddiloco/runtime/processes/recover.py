"""The global model of a processes run from the state its processes keep, for a run that
stopped (crashed, killed) before its last checkpoint.

A fragment method's syncer keeps every merge in its durable store
(``<run>/processes[/<method>]/syncer_state``); the data-parallel job keeps rollback
checkpoints (``<run>/processes/data_parallel/checkpoints/ckpt-*.bin``). Either is read
through the runtime's own reader, every byte checked, and the store from a copy, so
recovering never touches a store a syncer may still be using.
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ddiloco.config import RunConfig
from ddiloco.core.fragments import scatter
from ddiloco.core.syncer_state import SyncerState
from ddiloco.errors import ConfigError
from ddiloco.methods import method_for
from ddiloco.runtime.layout import STORE, processes_home, rollback_checkpoints, syncer_store
from ddiloco.runtime.processes.launcher.data_parallel_worker import latest, read_checkpoint
from ddiloco.runtime.processes.syncer.store import SyncerStore, fingerprint_of, restore
from ddiloco.runtime.run import RunSetup


@dataclass
class Recovered:
    """The global model as the processes left it."""

    setup: RunSetup
    model: nn.Module  # the setup's reference model, holding the global parameters
    tokens: int
    source: Path  # the store directory or the rollback checkpoint read


def state_of(run: Path, config: RunConfig, method: str) -> Path | None:
    """Where ``method``'s processes kept the global model in run ``run``, if they did."""
    if method_for(config, method).fragments:
        store = syncer_store(run, method)
        return store if store.is_dir() else None
    found = latest(rollback_checkpoints(run, method))
    return found[1] if found else None


def recover(run: Path, config: RunConfig, method: str) -> Recovered:
    """The global model of ``method`` from its processes' state; refused (naming where it
    looked) when there is none."""
    source = state_of(run, config, method)
    if source is None:
        where = processes_home(run, method) if method_for(config, method).fragments else run
        why = "no syncer store or data-parallel checkpoint to recover the model from"
        raise ConfigError("run", str(where), why)
    setup = RunSetup(config, method)
    if source.is_dir():
        return Recovered(setup, setup.model, _from_store(setup, source), source)
    state = read_checkpoint(source)
    try:
        setup.model.load_state_dict(state["weights"])
    except (RuntimeError, KeyError, ValueError, TypeError) as exc:
        raise ConfigError(
            "checkpoint", str(source), f"does not fit the run's model: {exc}"
        ) from exc
    return Recovered(setup, setup.model, int(state["tokens"]), source)


def _from_store(setup: RunSetup, store: Path) -> int:
    """Scatter the store's fragments into the setup's model; returns their tokens."""
    plan = setup.plan
    with tempfile.TemporaryDirectory(prefix="ddiloco-recover-") as tmp:
        copy = Path(tmp) / STORE  # load() tidies what it reads: never the live store
        shutil.copytree(store, copy)
        records = SyncerStore(
            copy, fingerprint=fingerprint_of(setup), fragments=plan.num_fragments
        ).load()
    syncer = SyncerState(
        plan, setup.initial, setup.method.sync.syncer_config(), plain_tensors=setup.plain
    )
    restore(syncer, records)
    params = dict(setup.model.named_parameters())
    with torch.no_grad():
        for p, values in enumerate(syncer.fragments):
            scatter(plan, p, params, values)
    return max((r.tokens for r in records.values()), default=0)
