"""Reading a run directory from a test: the ``--set`` arguments of a command line and the
records of ``metrics.jsonl``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def argv(*sets: str) -> list[str]:
    """``--set`` arguments for a ``ddiloco train`` command line."""
    out: list[str] = []
    for item in sets:
        out += ["--set", item]
    return out


def records(run: Path) -> list[dict[str, Any]]:
    """Every record of ``run``'s metrics.jsonl, in order."""
    lines = (run / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines if line.strip()]
