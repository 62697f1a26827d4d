"""Run directories: metrics as JSON lines, the summary, and live progress on the terminal."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any, TextIO

LOSSES = ("crash", "node_loss")  # chaos that takes a learner down


class MetricsWriter:
    """Appends one JSON object per line to ``metrics.jsonl``, tagged with the method."""

    def __init__(self, path: Path, append: bool = False) -> None:
        """``append``: a resumed run adds to the records it has (never truncates them)."""
        self.path = path
        # line-buffered: the records of a run killed at any moment are on disk
        self._file = path.open("a" if append else "w", encoding="utf-8", buffering=1)
        self.method = ""

    def emit(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps({"method": self.method, **record}, sort_keys=True) + "\n")

    def close(self) -> None:
        self._file.close()


class Progress:
    """Live one-line updates: method, virtual time, tokens, latest eval, learner states."""

    def __init__(self, total_tokens: int, stream: TextIO = sys.stdout, quiet: bool = False) -> None:
        self.total = total_tokens
        self.stream = stream
        self.quiet = quiet
        self.started = time.monotonic()
        self.learners: dict[int, str] = {}
        self.rounds = 0
        self.last_round = ""

    def __call__(self, method: str, record: dict[str, Any]) -> None:
        if method != getattr(self, "method", method):
            self.learners.clear()
            self.rounds = 0
            self.last_round = ""
        self.method = method
        kind = record["kind"]
        if kind == "step":
            self.learners[record["learner"]] = f"s{record['step']}"
        elif kind == "chaos" and record["event"] in LOSSES and "skipped" not in record:
            self.learners[record["learner"]] = "DOWN"
            what = "crashed" if record["event"] == "crash" else "lost its node"
            self._line(
                method,
                record["t"],
                f"learner {record['learner']} {what} (down {record['duration']:.0f}s)",
            )
        elif kind == "recovered":
            src = record.get("source") or (
                "syncer" if record["peer"] is None else f"peer {record['peer']}"
            )
            self.learners[record["learner"]] = "up"
            self._line(method, record["t"], f"learner {record['learner']} recovered from {src}")
        elif kind == "round":
            self.rounds += 1
            self.last_round = (
                f"last {record['answers']}/{record['asked']} answers, grace {record['grace']:.2f}s"
            )
        elif kind == "eval":
            states = " ".join(f"{k}:{v}" for k, v in sorted(self.learners.items()))
            pct = 100.0 * record["tokens"] / self.total
            rounds = f"rounds {self.rounds:>5} ({self.last_round})  " if self.rounds else ""
            text = f"tokens {record['tokens']:>9,} ({pct:5.1f}%)  eval {record['loss']:.4f}  "
            self._line(method, record["t"], text + rounds + states)

    def _line(self, method: str, t: float, text: str) -> None:
        if self.quiet:
            return
        wall = time.monotonic() - self.started
        print(f"[{wall:6.1f}s] {method:<14} t={t:8.1f}  {text}", file=self.stream, flush=True)


def write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")
