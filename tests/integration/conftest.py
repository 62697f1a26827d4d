"""Shared by the real-process tests: run one launcher with a hook, keep its records."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from ddiloco.config import RunConfig
from ddiloco.runtime.processes.launcher.fragments import Launcher

Records = list[dict[str, Any]]


@pytest.fixture
def launch() -> Callable[..., tuple[dict[str, Any], Records]]:
    """``launch(config, out, hook)``: run the decoupled method as processes, with ``hook``
    called on every event; returns the summary and every event record."""

    def run(cfg: RunConfig, out: Path, hook: Callable[[Launcher, dict[str, Any]], None]):
        records: Records = []
        return Launcher(cfg, "decoupled", out, records.append, hooks=[hook]).run(), records

    return run
