"""Find a model by name: one of the project's GPT configs, or ``module:function`` for any
``torch.nn.Module`` a user brings (the function is called with no arguments)."""

from __future__ import annotations

import importlib

from torch import nn

from ddiloco.errors import ConfigError
from ddiloco.models.gpt import GPT, GPT_CONFIGS

DEFAULT_MODEL = "gpt-1m"


def build_model(name: str = DEFAULT_MODEL) -> nn.Module:
    """Build the named model; errors name the field and list the choices."""
    if name in GPT_CONFIGS:
        return GPT(GPT_CONFIGS[name])
    if ":" not in name:
        known = ", ".join(GPT_CONFIGS)
        raise ConfigError("model", name, f"unknown model; use one of {known} or module:function")
    module_name, _, attr = name.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError("model", name, f"cannot import module {module_name!r}: {exc}") from exc
    factory = getattr(module, attr, None)
    if factory is None or not callable(factory):
        raise ConfigError("model", name, f"{module_name} has no callable {attr!r}")
    model = factory()
    if not isinstance(model, nn.Module):
        raise ConfigError("model", name, f"returned {type(model).__name__}, not a torch.nn.Module")
    return model
