"""For the benchmarks that need a real syncer process: start one on a free loopback port."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import IO

from ddiloco.config import RunConfig, to_toml
from ddiloco.runtime.processes.launcher.fragments import free_port
from ddiloco.runtime.processes.transport.sockets import SECRET_ENV


def start_syncer(
    tmp: Path, config: RunConfig, run_id: str, secret: bytes, stderr: IO[str] | None = None
) -> tuple[subprocess.Popen[str], str]:
    """``ddiloco syncer`` for ``config`` (written to ``tmp/config.toml``, its store in
    ``tmp/store``), its events on its stdout; the process and its address."""
    (tmp / "config.toml").write_text(to_toml(config))
    address = f"127.0.0.1:{free_port('127.0.0.1')}"
    argv = [sys.executable, "-m", "ddiloco.cli", "syncer", "--bind", address]
    argv += [
        "--config",
        str(tmp / "config.toml"),
        "--run-id",
        run_id,
        "--store",
        str(tmp / "store"),
    ]
    env = {**os.environ, SECRET_ENV: secret.hex()}
    syncer = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=stderr, text=True)
    return syncer, address
