"""The package's exceptions.

Every error a user can cause is a ``ValueError`` subclass whose message names the offending
field and value, so callers can catch ``ValueError`` or the narrower class.
"""

from __future__ import annotations

from typing import Any


class DDiLoCoError(ValueError):
    """Base class: bad input to ddiloco, with the field that is wrong."""

    def __init__(self, field: str, value: Any, why: str) -> None:
        self.field = field
        self.value = value
        self.why = why
        super().__init__(f"{field}={value!r}: {why}")


class ConfigError(DDiLoCoError):
    """A configuration value or argument is out of range or inconsistent."""


class CodecError(DDiLoCoError):
    """An encoded payload is malformed: wrong magic, length, codec or shape."""


def require(condition: bool, field: str, value: Any, why: str) -> None:
    """Raise :class:`ConfigError` naming ``field`` unless ``condition`` holds."""
    if not condition:
        raise ConfigError(field, value, why)
