"""The syncer's evaluations of the global model, off its service loop.

Evaluating takes the syncer's one core for a long time (0.4 s for gpt-1m, 9 s for gpt-12m,
76 s for gpt-50m at 64 eval batches) against a detection window of seconds: done inside the
loop it stalled merges and beats, made every learner reconnect and unbalanced the ledger. So
an evaluation runs on a thread of its own, in a copy of the global model taken between two
merges and dropped when the evaluation ends (the syncer's global values are the reference
model's own parameters, merged in place: between evaluations the syncer holds one fp32
model, not two, issue 28); at most one runs at a time, and one that comes due while another
is running is skipped and counted. The last evaluation (the run's result) is the caller's,
in the reference model itself once the merges are over, after :meth:`Evaluator.wait`.
"""

from __future__ import annotations

import copy
import logging
import threading
from collections.abc import Callable
from typing import Any

import torch

from ddiloco.core.fragments import scatter
from ddiloco.runtime.processes.transport.events import Events
from ddiloco.runtime.run import RunSetup

log = logging.getLogger(__name__)


class Evaluator:
    """Evaluates copies of the global fragments, one at a time, on a background thread."""

    def __init__(
        self,
        setup: RunSetup,
        events: Events,
        on_eval: Callable[[int, float], None] = lambda tokens, loss: None,
    ) -> None:
        """``on_eval(tokens, loss)``: told of every evaluation, on the evaluator's thread."""
        self.setup = setup
        self.events = events
        self.on_eval = on_eval
        setup.eval_batches  # noqa: B018 - built here, once, not by two threads at a time
        self.thread: threading.Thread | None = None
        self.counts = {"evals": 0, "eval_skipped": 0, "eval_failed": 0}

    @property
    def busy(self) -> bool:
        return self.thread is not None and self.thread.is_alive()

    def submit(self, fragments: list[list[torch.Tensor]], tokens: int) -> bool:
        """Copy ``fragments`` into a model of their own and start evaluating it; False
        (counted) if one still runs. The copy lives as long as the evaluation: merges go on
        meanwhile (the syncer's global values may be the reference model's own parameters),
        and between evaluations the syncer holds no evaluation model (issue 28)."""
        if self.busy:
            self.counts["eval_skipped"] += 1
            return False
        model = copy.deepcopy(self.setup.model)
        params = dict(model.named_parameters())
        with torch.no_grad():
            for p, values in enumerate(fragments):
                scatter(self.setup.plan, p, params, values)
        self.thread = threading.Thread(
            target=self._run, args=(model, tokens), name="syncer-eval", daemon=True
        )
        self.thread.start()
        return True

    def _run(self, model: torch.nn.Module, tokens: int) -> None:
        try:
            loss = self.setup.evaluate(model)
        except Exception as exc:
            self.counts["eval_failed"] += 1
            log.error(
                "syncer: evaluation at %d tokens failed: %s: %s", tokens, type(exc).__name__, exc
            )
            return
        self.counts["evals"] += 1
        self.on_eval(tokens, loss)
        self.events("eval", tokens=tokens, loss=loss)

    def wait(self, timeout: float | None = None) -> None:
        if self.thread is not None:
            self.thread.join(timeout)

    def summary(self) -> dict[str, Any]:
        return dict(self.counts)
