"""``module:function``: how a config names a user's code (a model factory, a training loop,
an evaluation), found the same way for each, with one error that names the field."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from ddiloco.errors import ConfigError


def find_callable(spec: str, field: str) -> Callable[..., Any]:
    """The callable ``spec`` (``module:function``) names, or a :class:`ConfigError` naming
    ``field`` and why it cannot be had (no colon, an import error, no such callable)."""
    module_name, _, name = spec.partition(":")
    if not module_name or not name:
        raise ConfigError(field, spec, "name it as module:function")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(field, spec, f"cannot import module {module_name!r}: {exc}") from exc
    found = getattr(module, name, None)
    if found is None or not callable(found):
        raise ConfigError(field, spec, f"{module_name} has no callable {name!r}")
    return found  # type: ignore[no-any-return]
