"""ddiloco: Decoupled DiLoCo — independent learners, an asynchronous CPU syncer.

The pure rules live in :mod:`ddiloco.core`; runtimes drive them. ``ddiloco.train(config,
out)`` runs an experiment as ``ddiloco train`` does (:mod:`ddiloco.launch`);
``ddiloco.Learner(model, optimizer)`` makes your own training loop a learner of a run
(:mod:`ddiloco.runtime.processes.learner.own_loop`). Importing the package loads neither
torch nor a runtime until one of them is used.
"""

from typing import Any

from ddiloco.errors import CodecError, ConfigError, DDiLoCoError
from ddiloco.version import __version__

__all__ = ["CodecError", "ConfigError", "DDiLoCoError", "Learner", "Start", "__version__", "train"]


def __getattr__(name: str) -> Any:
    if name == "train":  # (lazily: ddiloco.launch imports torch and the runtimes)
        from ddiloco.launch import train

        return train
    if name in ("Learner", "Start"):  # your own training loop (docs/own_loop.md)
        from ddiloco.runtime.processes.learner import own_loop

        return getattr(own_loop, name)
    raise AttributeError(f"module 'ddiloco' has no attribute {name!r}")
