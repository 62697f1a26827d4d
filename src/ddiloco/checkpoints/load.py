"""Reading checkpoints back: find one in a run, check every file, build the model.

Every file ``ddiloco.json`` lists is checked (present, its size, its BLAKE3 digest) before
anything is loaded, so a damaged, truncated or missing file is refused with one line naming
it (:class:`~ddiloco.checkpoints.format.CheckpointError`), never a traceback from safetensors
or transformers half way through a load.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_model
from torch import nn

from ddiloco.checkpoints.format import (
    FORMAT,
    KINDS,
    MAC,
    MANIFEST,
    MODEL_CONFIG,
    RUN_CONFIG,
    WEIGHTS,
    CheckpointError,
    digest,
    home_of,
    mac_holds,
    step_name,
    steps_in,
)
from ddiloco.config import RunConfig, load_config
from ddiloco.data.tokenizer import Tokenizer, tokenizer_for
from ddiloco.errors import ConfigError, DDiLoCoError
from ddiloco.models.gpt import GPT, GPTConfig
from ddiloco.models.registry import build_model

RUN_FILE = "config.toml"  # what every run directory holds (ddiloco train writes it)


@dataclass
class Checkpoint:
    """A loaded checkpoint: the global model, its tokenizer, the run's config."""

    path: Path
    manifest: dict[str, Any]
    config: RunConfig
    model: nn.Module
    tokenizer: Tokenizer

    @property
    def step(self) -> int:
        return int(self.manifest["step"])

    @property
    def method(self) -> str:
        return str(self.manifest["method"])


def verify(path: Path, key: bytes | None = None) -> dict[str, Any]:
    """``path``'s manifest, after checking every file it lists; with ``key`` (the run's
    manifest key: its secret is at hand), after checking the manifest was written with it."""
    manifest_path = path / MANIFEST
    if not path.is_dir():
        raise CheckpointError(path, "no such checkpoint directory")
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(manifest_path, "missing: not a complete ddiloco checkpoint") from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(manifest_path, f"unreadable: {exc}") from None
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict) or manifest.get("format") != FORMAT:
        why = f"not a format-{FORMAT} ddiloco.json (format {manifest.get('format')!r})"
        raise CheckpointError(manifest_path, why)
    if manifest.get("kind") not in KINDS:
        raise CheckpointError(manifest_path, f"unknown model kind {manifest.get('kind')!r}")
    if key is not None and not mac_holds(manifest, key):
        why = (
            "its MAC does not verify under this run's secret: altered after it was written (or the "
            "secret given is not the run's)"
            if MAC in manifest
            else "no MAC, in a run whose checkpoints carry one: written by another run or an "
            "older build, or its MAC removed"
        )
        raise CheckpointError(
            manifest_path, f"{why}; refused (copy it out of the run to load it unauthenticated)"
        )
    for name, entry in sorted(files.items()):
        file = path / name
        if ".." in Path(name).parts or Path(name).is_absolute():
            raise CheckpointError(manifest_path, f"lists a file outside the checkpoint: {name}")
        if not (isinstance(entry, dict) and isinstance(entry.get("bytes"), int)):
            raise CheckpointError(manifest_path, f"a malformed entry for {name}: {entry!r}")
        if not file.is_file():
            raise CheckpointError(file, f"missing (listed in {MANIFEST})")
        size, listed = file.stat().st_size, entry["bytes"]
        if size != listed:
            what = "truncated" if size < listed else "longer than written"
            raise CheckpointError(file, f"{what}: {size} bytes, {MANIFEST} says {listed}")
        if digest(file) != entry["blake3"]:
            raise CheckpointError(file, "BLAKE3 digest mismatch: the file is damaged")
    for needed in (RUN_CONFIG, *(() if manifest["kind"] == "hf" else (WEIGHTS, MODEL_CONFIG))):
        if needed not in files:
            raise CheckpointError(path / needed, f"missing (not listed in {MANIFEST})")
    return dict(manifest)


def load_checkpoint(
    path: Path, device: str = "cpu", builder: str | None = None, key: bytes | None = None
) -> Checkpoint:
    """Check and load the checkpoint directory ``path``: its model on ``device``, in eval
    mode. ``builder``: the ``module:function`` that builds a checkpoint of user code, as the
    user gives it (a checkpoint never names code to run: it only says which builder made
    it); built-in GPTs and Hugging Face models need none. ``key``: see :func:`verify`."""
    manifest = verify(path, key)
    try:
        config = load_config(path / RUN_CONFIG)
    except DDiLoCoError as exc:
        raise CheckpointError(
            path / RUN_CONFIG, f"not a run config this build reads: {exc}"
        ) from exc
    model = _model(path, manifest, config, builder)
    model.to(torch.device(device)).eval()
    return Checkpoint(path, manifest, config, model, tokenizer_for(path))


def _model(
    path: Path, manifest: dict[str, Any], config: RunConfig, builder: str | None
) -> nn.Module:
    kind, spec = manifest["kind"], str(manifest["model"])[:200]
    if kind == "hf":
        try:
            return build_model(f"hf:{path}", config)
        except ConfigError as exc:
            raise CheckpointError(path, exc.why) from exc
    weights = path / WEIGHTS
    if kind == "gpt":
        try:
            described = json.loads((path / MODEL_CONFIG).read_text(encoding="utf-8"))
            model: nn.Module = GPT(GPTConfig(**described["config"]))
        except (ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(path / MODEL_CONFIG, f"not a GPT config: {exc}") from exc
    else:
        if builder is None:  # importing what a file names is running code a file chose
            why = (
                f"its model is user code ({spec!r}), and a checkpoint never runs code it "
                f"names: pass --model {spec} if that is the builder you trust"
            )
            raise CheckpointError(path / MANIFEST, why)
        model = build_model(builder, config)
    try:
        load_model(model, str(weights), strict=True)
    except Exception as exc:  # safetensors' own errors, or keys/shapes that do not fit
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(weights, f"does not load into {spec}: {first}") from exc
    _finite(model, weights)
    return model


def _finite(model: nn.Module, weights: Path) -> None:
    """Refuse weights holding NaN or infinity (digests prove a file is the one written, not
    that what was written is a model): such a checkpoint evaluates to nan and says nothing."""
    for name, tensor in model.state_dict().items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise CheckpointError(weights, f"{name} holds NaN or infinite values: refused")


# -- finding one -----------------------------------------------------------------------------
def is_checkpoint(path: Path) -> bool:
    return (path / MANIFEST).is_file()


def run_config(run: Path) -> RunConfig:
    """A run directory's config (``config.toml``)."""
    if not (run / RUN_FILE).is_file():
        if (run / RUN_CONFIG).is_file() or (run / WEIGHTS).is_file():  # a checkpoint's files
            raise CheckpointError(run / MANIFEST, "missing: not a complete ddiloco checkpoint")
        why = f"neither a checkpoint ({MANIFEST}) nor a run directory ({RUN_FILE})"
        raise CheckpointError(run, why)
    return load_config(run / RUN_FILE)


def available(run: Path, config: RunConfig) -> dict[str, list[int]]:
    """Every method's checkpoint steps in a run directory."""
    return {m: steps_in(home_of(run, config, m)) for m in config.methods}


def listing(found: dict[str, list[int]]) -> str:
    """What ``available`` found, for an error message."""
    parts = [f"{m}: step {', '.join(map(str, s))}" for m, s in found.items() if s]
    return "; ".join(parts) if parts else "none"


def pick_method(config: RunConfig, method: str | None) -> str:
    """``method``, or the run's first; refused (listing the run's) when it has no such one."""
    if method is None:
        return config.methods[0]
    if method not in config.methods:
        raise ConfigError("--method", method, f"the run has {', '.join(config.methods)}")
    return method


def find_checkpoint(path: Path, method: str | None = None, step: int | None = None) -> Path:
    """The checkpoint directory ``path`` names: itself, or in a run directory ``method``'s
    (default: the run's first) checkpoint at ``step`` (default: the latest)."""
    if is_checkpoint(path):
        return path
    config = run_config(path)
    method = pick_method(config, method)
    found = available(path, config)
    steps = found[method]
    if not steps:
        why = f"no checkpoints of {method} in {path} (there are: {listing(found)})"
        raise CheckpointError(home_of(path, config, method), why)
    if step is None:
        step = steps[-1]
    elif step not in steps:
        raise ConfigError("--step", step, f"no such checkpoint; there are: {listing(found)}")
    return home_of(path, config, method) / step_name(step)
