"""Restarting a simulated method from one of its checkpoints (``ddiloco train --resume``).

Every checkpoint the simulated clock writes carries a resume state
(:mod:`ddiloco.checkpoints.sim_state`) beside the global model: each runner's ``state_dict``
takes it, reading only, so writing it never changes a run, and its ``load_state_dict`` puts
a freshly built runner back at it. :func:`find_resume` picks a method's newest checkpoint,
checks every file of it and refuses one that is damaged, naming the file. What is
restored and what is lost: :mod:`ddiloco.runtime.resume`.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from ddiloco.chaos.plan import ChaosEvent
from ddiloco.checkpoints.format import MANIFEST, CheckpointError, home_of, step_name, steps_in
from ddiloco.checkpoints.load import load_checkpoint
from ddiloco.checkpoints.sim_state import STATE, ResumeState, has_state, read_state
from ddiloco.config import RunConfig
from ddiloco.methods import method_for

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


def rng_state(rng: random.Random) -> list[Any]:
    version, internal, gauss = rng.getstate()
    return [version, list(internal), gauss]


def set_rng(rng: random.Random, state: list[Any]) -> None:
    rng.setstate((state[0], tuple(state[1]), state[2]))


def answer_key(value: Any) -> Any:
    return tuple(answer_key(v) for v in value) if isinstance(value, list) else value
