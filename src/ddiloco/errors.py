"""The package's exceptions.

Every error a user can cause is a ``ValueError`` subclass whose message names the offending
field and value, so callers can catch ``ValueError`` or the narrower class.
"""

from __future__ import annotations

import reprlib
from typing import Any

FATAL_EXIT = 78  # a syncer or learner that a restart cannot help exits so (EX_CONFIG)

_REPR = reprlib.Repr()
_REPR.maxlevel = 3  # a value from the network may be nested 1000 deep or megabytes long
_REPR.maxstring = _REPR.maxother = 80


class DDiLoCoError(ValueError):
    """Base class: bad input to ddiloco, with the field that is wrong."""

    def __init__(self, field: str, value: Any, why: str) -> None:
        self.field = field
        self.value = value
        self.why = why
        super().__init__(f"{field}={_REPR.repr(value)}: {why}")


class ConfigError(DDiLoCoError):
    """A configuration value or argument is out of range or inconsistent."""


class CodecError(DDiLoCoError):
    """An encoded payload is malformed: wrong magic, length, codec or shape."""


def require(condition: bool, field: str, value: Any, why: str) -> None:
    """Raise :class:`ConfigError` naming ``field`` unless ``condition`` holds."""
    if not condition:
        raise ConfigError(field, value, why)
