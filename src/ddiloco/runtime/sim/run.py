"""What every simulated runner starts with: the run's setup, where its records and
checkpoints go, the checkpoint it resumes from, and the hardware and network models."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ddiloco.runtime.run import RunSetup
from ddiloco.runtime.sim.world import Network, StepTimes

if TYPE_CHECKING:
    from ddiloco.checkpoints.write import CheckpointWriter
    from ddiloco.runtime.sim.restart import Resume


class SimRun:
    """The common head of :class:`~.engine.FragmentSim` and
    :class:`~.data_parallel.DataParallelSim`. The step-time generator is seeded by the
    run's seed alone, so both runners draw the same hardware. A runner builds the rest
    of itself in :meth:`assemble`, which ``__init__`` calls last."""

    def __init__(
        self,
        setup: RunSetup,
        emit: Callable[[dict[str, Any]], None],
        checkpoints: CheckpointWriter | None = None,
        resume: Resume | None = None,
    ) -> None:
        self.setup = setup
        self.config = setup.config
        self.method = setup.method
        self.emit = emit
        self.checkpoints = checkpoints
        self.resume = resume
        self.step_times = StepTimes(
            self.config.hardware, setup.slots, random.Random(self.config.seed)
        )
        self.network = Network(self.config.network)
        self.assemble()

    def assemble(self) -> None:
        """Build what this runner adds to the common head (its model, clock, learners)."""
        raise NotImplementedError
