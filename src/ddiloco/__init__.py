"""ddiloco: Decoupled DiLoCo — independent learners, an asynchronous CPU syncer.

The pure rules live in :mod:`ddiloco.core`; runtimes drive them. ``ddiloco.train(config,
out)`` runs an experiment as ``ddiloco train`` does (:mod:`ddiloco.launch`); importing the
package loads neither torch nor a runtime until it is called.
"""

from typing import Any

from ddiloco.errors import CodecError, ConfigError, DDiLoCoError
from ddiloco.version import __version__

__all__ = ["CodecError", "ConfigError", "DDiLoCoError", "__version__", "train"]


def __getattr__(name: str) -> Any:
    if name == "train":  # (lazily: ddiloco.launch imports torch and the runtimes)
        from ddiloco.launch import train

        return train
    raise AttributeError(f"module 'ddiloco' has no attribute {name!r}")
