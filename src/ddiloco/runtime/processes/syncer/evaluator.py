"""The syncer's evaluations of the global model, off its service loop.

Evaluating takes the syncer's one core for a long time (0.4 s for gpt-1m, 9 s for gpt-12m,
76 s for gpt-50m at 64 eval batches) against a detection window of seconds: done inside the
loop it stalled merges and beats, made every learner reconnect and unbalanced the ledger. So
an evaluation runs on a thread of its own; at most one runs at a time, and one that comes due
while another is running is skipped and counted. The last evaluation (the run's result) is
the caller's, in the reference model itself once the merges are over, after
:meth:`Evaluator.wait`.

Where it reads the global values (decision 126): by default in a copy of the global model
taken between two merges, dropped when the evaluation ends: one global model exactly, merges
going on meanwhile, one fp32 model more held for as long as it runs. With
``processes.eval_in_place`` it reads the reference model itself (the global values are its
own parameters, decision 99) slice by slice (``EVAL_FORWARD_TOKENS`` a forward), and a merge
waits for the slice being run, never for the whole evaluation (:class:`MergeGate`: a waiting
merge goes before the next slice): no second model (issue 28's 3x), but each slice sees the
global model of its moment, so an evaluation that outlasts merges averages over the models
they made; its record says how many (``merged_during``) and the tokens at its end
(``tokens_end``). A user's ``train.evaluate`` (one call that cannot be sliced) always gets
the copy.
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch

from ddiloco.core.fragments import scatter
from ddiloco.runtime.processes.transport.events import Events
from ddiloco.runtime.run import RunSetup

log = logging.getLogger(__name__)


class MergeGate:
    """Readers (an evaluation's slices) and writers (merges) of the global values, apart.

    Any number of slices may read at once; a merge writes alone. A merge that waits goes
    before every slice that has not started yet, so it waits for the slices already running
    and no longer (a reader-preferring lock would let back-to-back slices starve merges for a
    whole evaluation). ``writes`` counts the merges through the gate, ``longest_wait`` the
    longest any of them waited (seconds, for the summary)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._readers = 0
        self._writing = False
        self._waiting = 0  # writers waiting: new readers hold back
        self.writes = 0
        self.longest_wait = 0.0

    @contextmanager
    def reading(self) -> Iterator[None]:
        with self._cond:
            while self._writing or self._waiting:
                self._cond.wait()
            self._readers += 1
        try:
            yield
        finally:
            with self._cond:
                self._readers -= 1
                if not self._readers:
                    self._cond.notify_all()

    @contextmanager
    def writing(self) -> Iterator[None]:
        started = time.monotonic()
        with self._cond:
            self._waiting += 1
            try:
                while self._writing or self._readers:
                    self._cond.wait()
            finally:
                self._waiting -= 1
            self._writing = True
        self.longest_wait = max(self.longest_wait, time.monotonic() - started)
        try:
            yield
        finally:
            with self._cond:
                self._writing = False
                self.writes += 1
                self._cond.notify_all()


class Evaluator:
    """Evaluates the global fragments, one evaluation at a time, on a background thread."""

    def __init__(
        self,
        setup: RunSetup,
        events: Events,
        on_eval: Callable[[int, float], None] = lambda tokens, loss: None,
        in_place: bool = False,
        tokens_now: Callable[[], int] = lambda: 0,
    ) -> None:
        """``on_eval(tokens, loss)``: told of every evaluation, on the evaluator's thread.
        ``in_place``: evaluate the reference model itself, merges going through :attr:`gate`
        (a user's ``train.evaluate`` is always given a copy). ``tokens_now()``: the run's
        tokens, read when an evaluation ends (``tokens_end`` of its record)."""
        self.setup = setup
        self.events = events
        self.on_eval = on_eval
        self.in_place = in_place and not setup.config.train.evaluate
        self.tokens_now = tokens_now
        self.gate = MergeGate()
        setup.eval_batches  # noqa: B018 - built here, once, not by two threads at a time
        self.thread: threading.Thread | None = None
        self.counts = {"evals": 0, "eval_skipped": 0, "eval_failed": 0}

    @property
    def busy(self) -> bool:
        return self.thread is not None and self.thread.is_alive()

    def submit(self, fragments: list[list[torch.Tensor]], tokens: int) -> bool:
        """Start evaluating the global values ``fragments`` (the reference model's own
        parameters when in place; else copied into a model that lives as long as the
        evaluation); False (counted) if one still runs."""
        if self.busy:
            self.counts["eval_skipped"] += 1
            return False
        model = self.setup.model
        if not self.in_place:
            model = copy.deepcopy(model)
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
        writes = self.gate.writes
        try:
            hold = self.gate.reading if self.in_place else nullcontext
            loss = self.setup.evaluate(model, hold=hold)
        except Exception as exc:
            self.counts["eval_failed"] += 1
            log.error(
                "syncer: evaluation at %d tokens failed: %s: %s", tokens, type(exc).__name__, exc
            )
            return
        self.counts["evals"] += 1
        self.on_eval(tokens, loss)
        if self.in_place:  # the models it read: those of its start to its end
            merged = self.gate.writes - writes
            self.events(
                "eval", tokens=tokens, loss=loss, merged_during=merged, tokens_end=self.tokens_now()
            )
        else:
            self.events("eval", tokens=tokens, loss=loss)

    def wait(self, timeout: float | None = None) -> None:
        if self.thread is not None:
            self.thread.join(timeout)

    def summary(self) -> dict[str, Any]:
        return {**self.counts, "merge_longest_wait_s": round(self.gate.longest_wait, 3)}
