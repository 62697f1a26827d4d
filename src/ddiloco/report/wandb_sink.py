"""Weights & Biases runs from the run's records (``[report] wandb = "PROJECT"``).

The same scalars as TensorBoard's (:mod:`.tensorboard`: torchtitan's names, then ``sync/*``,
``ledger/*``, ``learner/<m>/state``) against ``tokens``, one W&B run per method, grouped
under the run directory's name and written under ``<run>/wandb``; the method's summary
becomes the W&B run's summary. ``metrics.jsonl`` stays the source of truth.

``report.wandb_mode``: ``auto`` (the default) logs online when an API key is configured
(``$WANDB_API_KEY``, or a ``wandb login``) and offline otherwise, saying how to upload the
run later (``wandb sync <run>/wandb/offline-run-*``); ``online``, ``offline`` and
``disabled`` are W&B's own modes. ``$WANDB_MODE`` overrides ``auto``. W&B is an optional
extra (``pip install 'ddiloco[wandb]'``); asking for it without the package is refused
before the run starts.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ddiloco.config import RunConfig, to_toml
from ddiloco.errors import ConfigError
from ddiloco.report.tensorboard import ScalarView

SUMMARY_KEYS = ("eval_loss", "eval_bpb", "goodput", "token_efficiency", "uptime", "tokens")


def wandb_module() -> Any:
    try:
        import wandb
    except ImportError as exc:
        why = "W&B is not installed: pip install 'ddiloco[wandb]'"
        raise ConfigError("report.wandb", True, why) from exc
    return wandb


def has_api_key() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    netrc = Path(os.environ.get("NETRC", Path.home() / ".netrc"))
    try:
        return "api.wandb.ai" in netrc.read_text(encoding="utf-8")
    except OSError:
        return False


def resolve_mode(setting: str) -> str:
    if setting != "auto":
        return setting
    return os.environ.get("WANDB_MODE") or ("online" if has_api_key() else "offline")


class _Writer:
    """One W&B run: ``add_scalar`` logs against the ``tokens`` axis."""

    def __init__(self, run: Any) -> None:
        self.run = run
        run.define_metric("tokens")
        run.define_metric("*", step_metric="tokens")

    def add_scalar(self, name: str, value: float, tokens: int) -> None:
        self.run.log({name: float(value), "tokens": tokens})

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self.run.finish()


class WandbSink(ScalarView):
    """One W&B run per method (see the module)."""

    def __init__(self, run_dir: Path, config: RunConfig) -> None:
        super().__init__()
        self.wandb = wandb_module()
        self.run_dir = run_dir
        self.config = config
        self.mode = resolve_mode(config.report.wandb_mode)
        (run_dir / "wandb").mkdir(parents=True, exist_ok=True)

    def new_writer(self, method: str) -> Any:
        import tomllib

        run = self.wandb.init(
            project=self.config.report.wandb,
            group=self.run_dir.name,
            name=f"{self.run_dir.name}-{method}",
            job_type=method,
            dir=str(self.run_dir),
            mode=self.mode,
            config={"method": method, **tomllib.loads(to_toml(self.config))},
            settings=self.wandb.Settings(silent=True, console="off"),
            reinit="create_new",
        )
        if self.mode == "offline":
            print(
                f"wandb: offline run of {method} in {run.dir}; upload it later with "
                f"`wandb sync {Path(run.dir).parent}`",
                flush=True,
            )
        return _Writer(run)

    def summary(self, method: str, summary: dict[str, Any]) -> None:
        super().summary(method, summary)
        run = self._writer(method).run
        for key in SUMMARY_KEYS:
            if isinstance(summary.get(key), int | float):
                run.summary[key] = summary[key]
