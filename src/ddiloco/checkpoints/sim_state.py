"""The simulated clock's resume state inside a checkpoint: what ``ddiloco train --resume``
needs besides the global model to continue a simulated run from it.

Two files under ``resume/`` in the checkpoint directory, listed (size and BLAKE3) in its
``ddiloco.json`` like every other file, so they are checked before they are read:

- ``resume/state.json``: plain values: the virtual time, the token count, every learner's
  step, learning-rate step and data position, the syncer's round counters, the token ledger,
  the step-time generator's state, the run's running totals (bytes, idle and down time);
- ``resume/tensors.safetensors``: the outer optimizers' momentum buffers (safetensors).

Nothing is pickled, and reading never unpickles: JSON and safetensors only. A checkpoint
without them (one of a processes run, or written before this format) has no resume state.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from ddiloco.checkpoints.format import CheckpointError
from ddiloco.checkpoints.weights import write_weights

STATE = "resume/state.json"
TENSORS = "resume/tensors.safetensors"
VERSION = 1  # state.json's "version": what this build writes and reads


@dataclass
class ResumeState:
    """Plain values (JSON) and named tensors (safetensors)."""

    values: dict[str, Any]
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)


def write_state(directory: Path, state: ResumeState) -> dict[str, str]:
    """Write ``state`` under ``directory``; returns the digests known as written (the
    tensors file's, hashed while it was streamed)."""
    (directory / STATE).parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps({"version": VERSION, **state.values}, sort_keys=True)
    (directory / STATE).write_text(text + "\n", encoding="utf-8")
    return {TENSORS: write_weights(directory / TENSORS, state.tensors, {"format": "pt"})}


def has_state(manifest: Mapping[str, Any]) -> bool:
    files = manifest.get("files")
    return isinstance(files, dict) and STATE in files and TENSORS in files


def read_state(path: Path) -> ResumeState:
    """The resume state of the checkpoint ``path`` (its files already verified)."""
    try:
        values = json.loads((path / STATE).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise CheckpointError(path / STATE, f"unreadable: {exc}") from None
    if not isinstance(values, dict) or values.get("version") != VERSION:
        version = values.get("version") if isinstance(values, dict) else None
        raise CheckpointError(path / STATE, f"not a version-{VERSION} resume state ({version!r})")
    try:
        tensors = load_file(str(path / TENSORS))
    except Exception as exc:  # safetensors' own errors
        raise CheckpointError(path / TENSORS, f"unreadable: {exc}") from None
    return ResumeState(values, dict(tensors))


# -- an optimizer's state_dict (ints, floats, None and lists of tensors) ---------------------
def pack(prefix: str, state: Mapping[str, Any], tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """``state``'s plain values, its tensor lists moved into ``tensors`` under ``prefix``."""
    plain: dict[str, Any] = {}
    for key, value in state.items():
        if isinstance(value, list) and all(isinstance(t, torch.Tensor) for t in value):
            plain[key] = {"tensors": len(value)}
            for i, t in enumerate(value):
                tensors[f"{prefix}.{key}.{i}"] = t
        elif value is None or isinstance(value, int | float | str | bool):
            plain[key] = value
        else:
            raise TypeError(f"{prefix}.{key}: {type(value).__name__} has no resume-state form")
    return plain


def unpack(
    prefix: str, plain: Mapping[str, Any], tensors: Mapping[str, torch.Tensor]
) -> dict[str, Any]:
    """The state :func:`pack` took apart."""
    state: dict[str, Any] = {}
    for key, value in plain.items():
        if isinstance(value, dict) and set(value) == {"tensors"}:
            state[key] = [tensors[f"{prefix}.{key}.{i}"] for i in range(int(value["tensors"]))]
        else:
            state[key] = value
    return state
