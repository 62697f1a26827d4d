"""Find a model by name: one of the project's GPT configs, ``hf:PATH`` for a local Hugging
Face model directory (:mod:`ddiloco.models.hf`), or ``module:function`` for any
``torch.nn.Module`` a user brings (a function of no arguments, or of one: the run config).

Given the run config, a built-in GPT is shaped for the run: its vocabulary is the data's
(:func:`ddiloco.data.info.vocab_size`) and its context is ``train.seq_len`` when set. Other
models declare their own; the contract check (:mod:`ddiloco.runtime.contract`) holds them to
the data and the sequence length.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from torch import nn

from ddiloco.data.info import vocab_size
from ddiloco.errors import ConfigError
from ddiloco.imports import find_callable
from ddiloco.models.gpt import GPT, GPT_CONFIGS, GPTConfig
from ddiloco.models.hf import build_hf, is_hf

if TYPE_CHECKING:
    from ddiloco.config import RunConfig

DEFAULT_MODEL = "gpt-1m"


def build_model(name: str = DEFAULT_MODEL, config: RunConfig | None = None) -> nn.Module:
    """Build the named model (for ``config``'s run when given); errors name the field and
    list the choices."""
    if name in GPT_CONFIGS:
        return GPT(_gpt_shape(name, config))
    if is_hf(name):
        return build_hf(name)
    if ":" not in name:
        known = ", ".join(GPT_CONFIGS)
        raise ConfigError(
            "model", name, f"unknown model; use one of {known}, hf:PATH or module:function"
        )
    factory = find_callable(name, "model")
    if _wants_config(name, factory):
        if config is None:
            from ddiloco.config import RunConfig

            config = RunConfig(model=name)
        model = factory(config)
    else:
        model = factory()
    if not isinstance(model, nn.Module):
        raise ConfigError("model", name, f"returned {type(model).__name__}, not a torch.nn.Module")
    return model


def _gpt_shape(name: str, config: RunConfig | None) -> GPTConfig:
    """The named GPT config, with the data's vocabulary and ``train.seq_len`` as its context
    (the very same object when they already agree, so a default run builds the same model)."""
    shape = GPT_CONFIGS[name]
    if config is None:
        return shape
    vocab = vocab_size(config.data.source)
    block = config.train.seq_len or shape.block_size
    if (vocab, block) == (shape.vocab_size, shape.block_size):
        return shape
    return dataclasses.replace(shape, vocab_size=vocab, block_size=block)


def _wants_config(name: str, factory: Callable[..., Any]) -> bool:
    """True for a factory with one required positional parameter (it gets the run config);
    False for one callable with no arguments (every factory written before the config was
    offered). More required parameters are refused."""
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):  # a builtin without a signature: call it bare, as before
        return False
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    required = [
        p
        for p in signature.parameters.values()
        if p.default is inspect.Parameter.empty
        and (p.kind in kinds or p.kind == inspect.Parameter.KEYWORD_ONLY)
    ]
    if len(required) > 1 or any(p.kind == inspect.Parameter.KEYWORD_ONLY for p in required):
        listed = ", ".join(p.name for p in required)
        raise ConfigError(
            "model",
            name,
            f"the factory requires ({listed}); it may take none or one: the run config",
        )
    return len(required) == 1
