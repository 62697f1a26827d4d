"""One learner process running ddiloco's own training loop: the built-in user of the engine.

Every step is one inner step of the shared Trainer (the sim's: same model contract, same
AdamW, same data stream), then :meth:`LearnerEngine.step` — the report, the step boundary,
a lock-step wait, a save (:mod:`.engine` owns a learner's life and its call order). Under
torchrun the learner is data-parallel (:mod:`.ranks`): every rank trains on its part of the
learner's batch with gradients averaged; only rank 0 talks to the syncer.
"""

from __future__ import annotations

import threading
import time

import torch

from ddiloco.data.corpus import BatchStream
from ddiloco.runtime.processes.learner.options import LearnerOptions
from ddiloco.runtime.processes.learner.ranks import RankGroup
from ddiloco.runtime.processes.learner.sharded_engine import engine_for
from ddiloco.runtime.processes.terminate import on_terminate
from ddiloco.runtime.processes.transport.events import Events
from ddiloco.runtime.run import RunSetup
from ddiloco.trainer import Trainer, uses_bf16


class LearnerProcess:
    """A learner slot's process: ddiloco's Trainer (model, AdamW, its shard) and the engine."""

    def __init__(
        self,
        setup: RunSetup,
        learner: int,
        syncer: str,
        run_id: str,
        secret: bytes,
        events: Events,
        options: LearnerOptions | None = None,
    ) -> None:
        options = options or LearnerOptions()
        config = setup.config
        torch.set_num_threads(config.processes.threads)
        self.leaving = threading.Event()  # SIGTERM: a clean leave (a rank's too: ranks.py)
        self.ranks = RankGroup(config.train.device, terminated=self.leaving)
        t = config.train
        seed = config.seed + learner + 7919 * self.ranks.rank  # ranks draw different batches
        stream = BatchStream(setup.splits.shards[learner], t.batch_size, setup.seq_len, seed)
        model = setup.model
        if t.parallel == "fsdp" and self.ranks.active:  # FSDP reduces the gradients itself
            model = self.ranks.shard(model, uses_bf16(t.precision, self.ranks.device))
        else:
            self.ranks.average_gradients(model)
        self.trainer = Trainer(model, stream, t, setup.steps_each)
        self.engine = engine_for(
            setup,
            learner,
            syncer,
            run_id,
            secret,
            events,
            self.trainer,
            self.ranks,
            self.leaving,
            options,
        )

    def run(self) -> int:
        on_terminate(self.leaving.set)  # SIGTERM: a clean leave
        if not self.engine.start():
            return 0
        try:
            while self.step():
                pass
            self.engine.finish()
        finally:
            self.engine.close()
        return 0

    def step(self) -> bool:
        """One inner step and its boundary; False when the learner stops here."""
        started = time.perf_counter()
        loss, tokens = self.trainer.train_step()
        return self.engine.step(tokens, loss, seconds=time.perf_counter() - started)
