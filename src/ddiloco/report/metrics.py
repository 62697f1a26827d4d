"""Run directories: metrics as JSON lines, and JSON files (the summary).

Live progress on the terminal is report/progress.py, fed the same records."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


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


def write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")
