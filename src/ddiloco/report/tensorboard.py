"""TensorBoard event files from the run's records (``[report] tensorboard = true``).

Fed the same records as ``metrics.jsonl``, which stays the source of truth: this is a view
of it, written under ``<run>/tensorboard/<method>/`` (``tensorboard --logdir <run>/tensorboard``
compares the methods). The x axis is tokens trained (all learners), so methods and runtimes
line up. Scalars, torchtitan's names first:

- ``loss_metrics/global_avg_loss``: the learners' mean train loss over the steps since the
  last point (a point every :data:`STEPS_PER_POINT` steps); ``loss_metrics/eval_loss``;
- ``throughput(tps)``: tokens per second of the run's clock over the same steps (virtual
  seconds on the simulated clock, wall seconds on real processes);
- ``sync/round_close_ms`` (a round's open to its merge), ``sync/grace_ms``,
  ``sync/staleness`` (versions behind, mean over a round's answers), ``sync/bytes_out_per_s``
  (the syncer's broadcasts since the last round, per second);
- ``ledger/tokens_merged`` and ``ledger/tokens_wasted/<reason>`` (at the end of a method);
- ``learner/<m>/state``: 1 up, 0 down, 2 frozen, 3 joining, 4 copying, 5 left (the states
  of report/progress.py, which reads the same records).

TensorBoard is an optional extra (``pip install 'ddiloco[tensorboard]'``); asking for it
without the package is refused before the run starts.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

from ddiloco.errors import ConfigError
from ddiloco.report.progress import Progress

STEPS_PER_POINT = 10
STATE_CODES = {"DOWN": 0, "up": 1, "frozen": 2, "joining": 3, "copying": 4, "left": 5}


def summary_writer_class() -> Any:
    """torch's SummaryWriter, or a ConfigError saying how to install TensorBoard."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as exc:  # torch's module imports tensorboard itself
        why = "TensorBoard is not installed: pip install 'ddiloco[tensorboard]'"
        raise ConfigError("report.tensorboard", True, why) from exc
    return SummaryWriter


class ScalarView:
    """The scalars of the module's list from the run's records, written by one writer per
    method (an object with ``add_scalar(name, value, tokens)``, ``flush()``, ``close()``):
    TensorBoard's here, W&B's in :mod:`.wandb_sink`."""

    def __init__(self) -> None:
        self.writers: dict[str, Any] = {}
        self.method = ""

    def new_writer(self, method: str) -> Any:
        raise NotImplementedError

    def __call__(self, method: str, record: dict[str, Any]) -> None:
        if method != self.method:
            self.method = method
            self.tokens = 0
            self.losses: list[float] = []
            self.window_steps = 0
            self.window_start: tuple[float, int] | None = None  # (t, tokens)
            self.bytes_since, self.bytes_t = 0, 0.0
            self.states = Progress(1, stream=io.StringIO(), quiet=True, every=0.0)
            self.shown: dict[int, str] = {}
        writer = self._writer(method)
        kind = record["kind"]
        t = float(record.get("t", 0.0))
        self.states(method, record)
        if kind == "step":
            self._step(writer, record, t)
        elif kind == "eval":
            writer.add_scalar("loss_metrics/eval_loss", record["loss"], self.tokens)
        elif kind == "round":
            self._round(writer, record, t)
        for m, state in self.states.learners.items():
            if self.shown.get(m) != state:
                self.shown[m] = state
                writer.add_scalar(f"learner/{m}/state", STATE_CODES[state], self.tokens)

    def _step(self, writer: Any, r: dict[str, Any], t: float) -> None:
        if self.window_start is None:
            self.window_start = (t, self.tokens)
        self.tokens += int(r.get("batch_tokens", 0))
        if r.get("loss") is not None:  # (an own loop may not say its loss)
            self.losses.append(float(r["loss"]))
        self.window_steps += 1
        if self.window_steps < STEPS_PER_POINT:
            return
        if self.losses:
            mean = sum(self.losses) / len(self.losses)
            writer.add_scalar("loss_metrics/global_avg_loss", mean, self.tokens)
        t0, tokens0 = self.window_start
        if t > t0:
            writer.add_scalar("throughput(tps)", (self.tokens - tokens0) / (t - t0), self.tokens)
        self.losses, self.window_start, self.window_steps = [], (t, self.tokens), 0

    def _round(self, writer: Any, r: dict[str, Any], t: float) -> None:
        writer.add_scalar("sync/round_close_ms", 1000.0 * (t - r["opened_at"]), self.tokens)
        writer.add_scalar("sync/grace_ms", 1000.0 * float(r.get("grace") or 0.0), self.tokens)
        if "staleness" in r:
            writer.add_scalar("sync/staleness", r["staleness"], self.tokens)
        self.bytes_since += int(r["broadcast_bytes"]) * max(int(r["asked"]), 1)
        if t > self.bytes_t:
            rate = self.bytes_since / (t - self.bytes_t)
            writer.add_scalar("sync/bytes_out_per_s", rate, self.tokens)
            self.bytes_since, self.bytes_t = 0, t

    def summary(self, method: str, summary: dict[str, Any]) -> None:
        """A method's end: its ledger, at its last token count."""
        writer = self._writer(method)
        writer.add_scalar("ledger/tokens_merged", summary.get("tokens_merged", 0.0), self.tokens)
        for reason, tokens in sorted(summary.get("tokens_wasted", {}).items()):
            writer.add_scalar(f"ledger/tokens_wasted/{reason}", tokens, self.tokens)
        writer.flush()

    def _writer(self, method: str) -> Any:
        if method not in self.writers:
            self.writers[method] = self.new_writer(method)
        return self.writers[method]

    def close(self) -> None:
        for writer in self.writers.values():
            writer.close()


class TensorBoardSink(ScalarView):
    """One event-file directory per method under ``<run>/tensorboard`` (see the module)."""

    def __init__(self, run_dir: Path) -> None:
        super().__init__()
        self.root = run_dir / "tensorboard"
        self.writer_class = summary_writer_class()

    def new_writer(self, method: str) -> Any:
        return self.writer_class(log_dir=str(self.root / method))
