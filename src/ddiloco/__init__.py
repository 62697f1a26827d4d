"""ddiloco: Decoupled DiLoCo — independent learners, an asynchronous CPU syncer.

The pure rules live in :mod:`ddiloco.core`; runtimes drive them.
"""

from ddiloco.errors import CodecError, ConfigError, DDiLoCoError

__all__ = ["CodecError", "ConfigError", "DDiLoCoError", "__version__"]
__version__ = "0.1.0"
