"""Run directories: metrics as JSON lines (written, and read back as the curves stand on
them), and JSON files (the summary).

Live progress on the terminal is report/progress.py, fed the same records."""

from __future__ import annotations

import json
from collections.abc import Iterable
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


def method_summaries(run: Path) -> dict[str, dict[str, Any]] | None:
    """Each method's summary in ``run``'s summary.json (one method's summary, or every
    method's under ``methods``): {} when there is none, None when it cannot be read."""
    path = run / "summary.json"
    if not path.is_file():
        return {}
    try:
        held = json.loads(path.read_text(encoding="utf-8"))
        methods = dict(held.get("methods") or {held["method"]: held})
    except (OSError, ValueError, KeyError, AttributeError, TypeError):
        return None
    return {m: s for m, s in methods.items() if isinstance(s, dict)}


def read_records(path: Path) -> list[dict[str, Any]]:
    """Every record of a run's ``metrics.jsonl`` (a line cut by a crash, which a resumed run
    leaves in place, is skipped)."""
    records = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                r = json.loads(line)
            except ValueError:
                continue
            if isinstance(r, dict):
                records.append(r)
    return records


def kept_records(records: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """The records a resumed run stands on: a ``resume`` record marks the point (its ``t``)
    a method continued from, and that method's records before it in the file with a later
    time are the abandoned launch's (its work past the checkpoint, never counted), left out.
    Every curve of a run is drawn from these (the plots, ``ddiloco compare``, equal time)."""
    records = list(records)
    resumed_at: dict[str, float] = {}  # method -> the earliest resume point after a record
    dropped = set()
    for i in range(len(records) - 1, -1, -1):
        r = records[i]
        method, t = r.get("method"), r.get("t")
        if not isinstance(t, int | float):
            continue
        if r.get("kind") == "resume":
            resumed_at[str(method)] = min(float(t), resumed_at.get(str(method), float(t)))
        elif float(t) > resumed_at.get(str(method), float("inf")):
            dropped.add(i)
    return [r for i, r in enumerate(records) if i not in dropped]
