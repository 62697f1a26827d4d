"""Restarting a simulated method from one of its checkpoints (``ddiloco train --resume``).

Every checkpoint the simulated clock writes carries a resume state
(:mod:`ddiloco.checkpoints.sim_state`) beside the global model: :func:`fragment_state` and
:func:`dp_state` take it, reading only, so writing it never changes a run. :func:`find_resume`
picks a method's newest checkpoint, checks every file of it and refuses one that is damaged,
naming the file; :func:`restore_fragments` and :func:`restore_dp` put a freshly built engine
back at it. What is restored and what is lost: :mod:`ddiloco.runtime.resume`.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ddiloco.chaos.plan import ChaosEvent
from ddiloco.checkpoints.format import MANIFEST, CheckpointError, home_of, step_name, steps_in
from ddiloco.checkpoints.load import load_checkpoint
from ddiloco.checkpoints.sim_state import STATE, ResumeState, has_state, pack, read_state, unpack
from ddiloco.config import RunConfig
from ddiloco.core.fragments import gather, scatter
from ddiloco.core.learner_state import LearnerSync
from ddiloco.methods import method_for
from ddiloco.runtime.sim.node import NodeState

if TYPE_CHECKING:
    from ddiloco.runtime.sim.data_parallel import DataParallelSim
    from ddiloco.runtime.sim.engine import FragmentSim

# Ledger reason: trained but not yet merged at the checkpoint a resumed run restarted from
# (the learners' local progress and the answers in flight then; the resumed learners start
# from the global model).
RESUMED = "resumed"
# Chaos that changes the world rather than a learner's life: still in effect at the
# checkpoint, it is struck again at the resume for the rest of its duration.
LASTING = ("slow", "link_slow", "link_cut")


@dataclass
class Resume:
    """A method's checkpoint to continue from, checked and loaded."""

    checkpoint: Path
    manifest: dict[str, Any]
    state: ResumeState
    model: nn.Module  # the global model
    chaos: tuple[ChaosEvent, ...]  # the plan's events from the checkpoint's time on
    finished: bool  # a final checkpoint at the budget: nothing left to train

    @property
    def values(self) -> dict[str, Any]:
        return self.state.values

    @property
    def t(self) -> float:
        return float(self.values["t"])

    @property
    def tokens(self) -> int:
        """The engine's token count (data-parallel: rolled-back steps included)."""
        return int(self.values["tokens"])

    @property
    def step(self) -> int:
        return int(self.manifest["step"])

    @property
    def eval_loss(self) -> float:
        return float(self.manifest["eval_loss"])

    def where(self, run: Path) -> str:
        try:
            return self.checkpoint.relative_to(run).as_posix()
        except ValueError:
            return str(self.checkpoint)

    def note(self, run: Path) -> dict[str, Any]:
        """The ``resume`` metrics record (without the method) and the summary's
        ``resumed_from``."""
        return {
            "checkpoint": self.where(run),
            "step": self.step,
            "tokens": self.tokens,
            "t": self.t,
            "finished": self.finished,
        }


def find_resume(
    run: Path, config: RunConfig, method: str, plan: Sequence[ChaosEvent]
) -> Resume | None:
    """``method``'s newest checkpoint in ``run``, every file checked; None when it has none.
    A damaged one (or one without a resume state) is refused naming the file, with what to
    do: it is never skipped silently for an older one."""
    home = home_of(run, config, method)
    steps = steps_in(home)
    if not steps:
        return None
    path = home / step_name(steps[-1])
    instead = f"remove {path} to resume from step-{steps[-2]}" if len(steps) > 1 else ""
    instead = instead or f"remove {path} to start {method} over"
    fragments = method_for(config, method).fragments
    try:
        ckpt = load_checkpoint(path, builder=config.model)  # the resuming run's own model
        if not has_state(ckpt.manifest):
            why = f"missing (not listed in {MANIFEST}): no simulated-clock resume state"
            raise CheckpointError(path / STATE, why)
        state = read_state(path)
        if ckpt.manifest.get("method") != method or state.values.get("kind") != (
            "fragments" if fragments else "data_parallel"
        ):
            raise CheckpointError(path / MANIFEST, f"not a checkpoint of {method}")
    except CheckpointError as exc:
        raise CheckpointError(exc.path, f"{exc.why}; cannot resume from it ({instead})") from exc
    t = float(state.values["t"])
    limit = config.train.max_virtual_seconds
    more = int(state.values["tokens"]) < config.train.tokens and not (limit and t >= limit)
    finished = bool(state.values["final"]) and not more
    return Resume(path, ckpt.manifest, state, ckpt.model, carried_chaos(plan, t), finished)


def carried_chaos(plan: Sequence[ChaosEvent], t: float) -> tuple[ChaosEvent, ...]:
    """The chaos a run resumed at ``t`` plays: what was still slowing a learner or its links
    at ``t`` (again, at ``t``, for the rest of its duration), then every event from ``t`` on.
    A crash, freeze or preemption before ``t`` is not replayed: every learner is up at ``t``."""
    carried = []
    for e in plan:
        if e.at >= t or e.kind not in LASTING:
            continue
        if e.duration == 0 and e.kind != "link_cut":  # to the end
            carried.append(dataclasses.replace(e, at=t))
        elif e.at + e.duration > t:
            carried.append(dataclasses.replace(e, at=t, duration=e.at + e.duration - t))
    return (*carried, *(e for e in plan if e.at >= t))


def _rng_state(rng: random.Random) -> list[Any]:
    version, internal, gauss = rng.getstate()
    return [version, list(internal), gauss]


def _set_rng(rng: random.Random, state: list[Any]) -> None:
    rng.setstate((state[0], tuple(state[1]), state[2]))


def _key(value: Any) -> Any:
    return tuple(_key(v) for v in value) if isinstance(value, list) else value


# -- fragment methods ------------------------------------------------------------------------
def fragment_state(sim: FragmentSim, final: bool = False) -> ResumeState:
    """What :func:`restore_fragments` needs of ``sim`` now (reading only)."""
    now = sim.clock.now
    tensors: dict[str, torch.Tensor] = {}
    syncer, policy = sim.syncer, sim.syncer.policy
    outer = [pack(f"outer.{p}", o.state_dict(), tensors) for p, o in enumerate(syncer.outer)]
    idle = sim.idle_seconds
    if not final:  # (at the end, the run has already counted the waits still going on)
        idle += sum(now - n.waiting_since for n in sim.nodes if n.waiting_since is not None)
    up = sim.uptime
    live = sum(n.up for n in sim.nodes)
    uptime = up.seconds + (now - up.mark if up.mark is not None and live >= up.quorum else 0.0)
    learners = [
        {
            "present": n.state is not NodeState.ABSENT,
            "step": n.sync.step,
            "trainer_steps": n.trainer.steps,
            "position": n.trainer.stream.position,
            "incarnation": n.incarnation,
            "down_seconds": n.down_seconds
            + (now - n.down_since if n.down_since is not None else 0.0),
        }
        for n in sim.nodes
    ]
    values = {
        "kind": "fragments",
        "final": final,
        "t": now,
        "tokens": sim.tokens,
        "next_eval": sim.next_eval,
        "bytes": [sim.bytes_up, sim.bytes_down, sim.bytes_peer],
        "idle_seconds": idle,
        "uptime": [uptime, up.first],
        "counts": dict(syncer.counts),
        "versions": list(policy.versions),
        "next_round_id": list(policy.next_round_id),
        "global_step": policy.global_step,
        "merged_opened": list(syncer.merged_opened),  # the outer momentum's period clock
        "ema": [policy.step_time.value, policy.sync_time.value],
        "norm_windows": [list(w.values) for w in syncer.norm_windows],
        "outer": outer,
        "ledger": sim.ledger.to_state(),
        "rng": _rng_state(sim.step_times.rng),
        "learners": learners,
    }
    return ResumeState(values, tensors)


def restore_fragments(sim: FragmentSim, resume: Resume) -> None:
    """Put a freshly built ``sim`` at ``resume``'s checkpoint: the syncer's fragments (the
    global model), outer optimizers and round counters, the ledger (what was not yet merged
    is wasted as ``resumed``), and every learner present then starting from the global model
    at its own step, learning-rate step and data position, with a fresh inner optimizer."""
    v, plan = resume.values, sim.plan
    syncer, policy = sim.syncer, sim.syncer.policy
    if len(v["learners"]) != len(sim.nodes) or len(v["outer"]) != plan.num_fragments:
        raise CheckpointError(resume.checkpoint / STATE, "does not fit this run's learners/plan")
    now = sim.clock.now = float(v["t"])
    weights = dict(resume.model.named_parameters())
    for p in range(plan.num_fragments):
        syncer.restore_fragment(
            p,
            gather(plan, p, weights),
            unpack(f"outer.{p}", v["outer"][p], resume.state.tensors),
            int(v["versions"][p]),
            int(v["next_round_id"][p]),
            (),
            {},
            v["norm_windows"][p],
        )
    policy.global_step = int(v["global_step"])
    opened = v.get("merged_opened") or [None] * plan.num_fragments
    syncer.merged_opened = [None if s is None else int(s) for s in opened]
    policy.step_time.value, policy.sync_time.value = v["ema"]
    syncer.counts = dict(v["counts"])
    sim.ledger.load_state(v["ledger"])
    for row in v["ledger"]["answers"]:  # in flight at the checkpoint: lost
        sim.ledger.wasted_answer(_key(row[0]), RESUMED)
    sim.tokens = int(v["tokens"])
    sim.bytes_up, sim.bytes_down, sim.bytes_peer = (int(b) for b in v["bytes"])
    sim.idle_seconds = float(v["idle_seconds"])
    sim.uptime.seconds, sim.uptime.first = v["uptime"]
    sim.uptime.mark = now
    _set_rng(sim.step_times.rng, v["rng"])
    for node, saved in zip(sim.nodes, v["learners"], strict=True):
        sim.ledger.crashed(node.id, RESUMED)  # its local progress since its base: lost
        node.incarnation = int(saved["incarnation"]) + 1  # a new life: its answers' keys too
        node.down_seconds = float(saved["down_seconds"])
        node.down_since = None
        node.asks.clear()
        node.inbox.clear()
        if not saved["present"]:
            node.state = NodeState.ABSENT
            policy.leave(node.id, now)
            continue
        trainer = node.trainer
        params = trainer.params()
        for p in range(plan.num_fragments):
            scatter(plan, p, params, syncer.fragments[p])
        trainer.reset_optimizer()
        trainer.steps = int(saved["trainer_steps"])
        trainer.stream.position = int(saved["position"])
        sync = LearnerSync(
            node.id,
            plan,
            params,
            incarnation=node.incarnation,
            apply=sim.sync.apply,
            blend=sim.sync.blend,
            versions=syncer.versions,
        )
        sync.step = int(saved["step"])
        node.boundary = sim.boundary_of(sync)
        node.state = NodeState.STEPPING
        policy.join(node.id, sync.step)


# -- data-parallel ---------------------------------------------------------------------------
def dp_state(
    sim: DataParallelSim,
    steps: int,
    next_eval: int,
    returns: Sequence[tuple[float, int]],
    final: bool = False,
) -> ResumeState:
    """What :func:`restore_dp` needs of ``sim`` now (reading only): a replica on its way back
    (elastic) counts as live."""
    live = set(sim.live) | {m for _, m in returns if m >= 0}
    values = {
        "kind": "data_parallel",
        "final": final,
        "t": sim.now,
        "tokens": sim.tokens,
        "wasted": sim.wasted,
        "steps": steps,
        "next_eval": next_eval,
        "stepping_seconds": sim.stepping_seconds,
        "kept_replica_seconds": sim.kept_replica_seconds,
        "bytes": sim.bytes,
        "live": sorted(live),
        "trainer_steps": sim.trainer.steps,
        "position": sim.trainer.stream.position,
        "rng": _rng_state(sim.step_times.rng),
    }
    return ResumeState(values)


def restore_dp(sim: DataParallelSim, resume: Resume) -> None:
    """Put a freshly built ``sim`` at ``resume``'s checkpoint: the model, its step and data
    position, a fresh inner optimizer, the time and the running totals."""
    v = resume.values
    trainer = sim.trainer
    trainer.model.load_state_dict(resume.model.state_dict())
    trainer.reset_optimizer()
    trainer.steps = int(v["trainer_steps"])
    trainer.stream.position = int(v["position"])
    sim.now = float(v["t"])
    sim.tokens = int(v["tokens"])
    sim.wasted = int(v["wasted"])
    sim.stepping_seconds = float(v["stepping_seconds"])
    sim.kept_replica_seconds = float(v["kept_replica_seconds"])
    sim.bytes = int(v["bytes"])
    sim.live = {int(m) for m in v["live"]}
    _set_rng(sim.step_times.rng, v["rng"])
    sim.checkpoint = sim._snapshot()  # a rollback goes back to here at most
