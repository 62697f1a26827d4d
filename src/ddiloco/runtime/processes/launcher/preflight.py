"""Pre-flight for ``--runtime processes``: refuse a run that cannot train, before any
process starts.

A broken model or data set otherwise shows only as processes that crash and are restarted
until the launcher gives up, with the cause buried in their logs. Here the launcher's own
process builds what every process builds (:class:`RunSetup`: the model, its fragment plan,
the shards and the eval batches, with the validation those already do), then runs one
training forward/backward on a real batch of 2 at the model's sequence length and one
evaluation batch on the configured device, and names what is wrong: the device, the data,
the vocabulary (tokens are bytes), an exception from the model, or output that is not
``(logits, loss)`` with logits ``(batch, sequence, vocab)`` and a finite loss. About 1.5 s
for gpt-1m on 2 CPU cores, most of it splitting the corpus.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
from torch import nn

from ddiloco.config import RunConfig
from ddiloco.data.corpus import BatchStream, load_documents
from ddiloco.errors import ConfigError, DDiLoCoError
from ddiloco.runtime.run import RunSetup
from ddiloco.trainer import evaluate, pick_device

BYTE_VOCAB = 256  # tokens are bytes


@dataclass(frozen=True)
class Report:
    seq_len: int
    seconds: float


def check(config: RunConfig, method: str = "decoupled") -> Report:
    """Raise a :class:`DDiLoCoError` naming why ``config`` cannot train as processes."""
    started = time.monotonic()
    device = _device(config.train.device)
    name = config.model
    try:
        setup = RunSetup(config, method)
    except DDiLoCoError:
        raise
    except Exception as exc:  # the user's model factory, or a plan of its parameters
        raise ConfigError("model", name, f"building it raised {_what(exc)}") from exc
    vocab = _vocabulary(setup.model)
    if vocab is not None and vocab < BYTE_VOCAB:
        raise ConfigError("model", name, f"vocabulary {vocab} < {BYTE_VOCAB}: tokens are bytes")
    t = config.train
    shards = _shards(setup)
    for m, shard in enumerate(shards):  # as each learner draws its batches
        try:
            BatchStream(shard, t.batch_size, setup.seq_len, config.seed + m)
        except ConfigError as exc:
            source = config.data.source
            raise ConfigError("data.source", source, f"learner {m}: {exc}") from exc
    evals = setup.eval_batches  # raises when the eval split is shorter than one sequence
    stream = BatchStream(shards[0], 2, setup.seq_len, config.seed)
    model = setup.model.to(device)
    _train_step(model, name, *stream.next(), device)
    try:
        loss = evaluate(model, evals[:1])
    except Exception as exc:
        raise ConfigError("model", name, f"evaluation raised {_what(exc)}") from exc
    if not math.isfinite(loss):
        raise ConfigError("model", name, f"evaluation loss is {loss} at initialization")
    return Report(setup.seq_len, time.monotonic() - started)


def _device(spec: str) -> torch.device:
    try:
        device = pick_device(spec)
        if device.type == "cuda" and not torch.cuda.is_available():
            build = f"torch {torch.__version__}, CUDA {torch.version.cuda or 'not built in'}"
            raise ConfigError("train.device", spec, f"CUDA is not available ({build}); use 'cpu'")
        torch.empty(1, device=device)
    except DDiLoCoError:
        raise
    except Exception as exc:
        raise ConfigError("train.device", spec, f"unusable: {_what(exc)}") from exc
    return device


def _shards(setup: RunSetup) -> tuple[torch.Tensor, ...]:
    """The learners' shards; split_corpus refuses missing files and too little text."""
    source = setup.config.data.source
    try:
        return setup.splits.shards
    except DDiLoCoError:
        raise
    except Exception as exc:  # e.g. no text at all: torch.frombuffer of 0 bytes
        empty = sum(len(text) for _, text in load_documents(source)) == 0
        why = "no text: the files are empty" if empty else f"cannot be split: {_what(exc)}"
        raise ConfigError("data.source", source, why) from exc


def _vocabulary(model: nn.Module) -> int | None:
    """The model's vocabulary: ``config.vocab_size``, else its first embedding's size."""
    size = getattr(getattr(model, "config", None), "vocab_size", None)
    if isinstance(size, int):
        return size
    embedding = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
    return None if embedding is None else int(embedding.num_embeddings)


def _train_step(
    model: nn.Module, name: str, x: torch.Tensor, y: torch.Tensor, device: torch.device
) -> None:
    """One forward/backward as :class:`~ddiloco.trainer.Trainer` runs it (autocast on CUDA)."""
    model.train()
    amp = device.type == "cuda" and torch.cuda.is_bf16_supported()
    x, y = x.to(device), y.to(device)
    context = f"on a batch of shape {tuple(x.shape)} (int64 byte tokens) with targets"
    try:
        with torch.autocast(device.type, torch.bfloat16, enabled=amp):
            out = model(x, y)
    except Exception as exc:
        hint = (
            ""
            if hasattr(getattr(model, "config", None), "block_size")
            else (" (the model has no config.block_size: sequences are 128 tokens)")
        )
        raise ConfigError("model", name, f"forward {context} raised {_what(exc)}{hint}") from exc
    if not (isinstance(out, tuple | list) and len(out) == 2):
        raise ConfigError("model", name, f"forward returned {_shape(out)}, not (logits, loss)")
    logits, loss = out
    want = f"({x.shape[0]}, {x.shape[1]}, >= {BYTE_VOCAB})"
    if (
        not isinstance(logits, torch.Tensor)
        or logits.dim() != 3
        or tuple(logits.shape[:2]) != tuple(x.shape)
    ):
        raise ConfigError("model", name, f"logits are {_shape(logits)}, not {want}")
    if logits.shape[2] < BYTE_VOCAB:
        raise ConfigError(
            "model", name, f"vocabulary {logits.shape[2]} < {BYTE_VOCAB}: tokens are bytes"
        )
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise ConfigError("model", name, f"loss is {_shape(loss)}, not a scalar tensor")
    if not torch.isfinite(loss.detach().float()).all():
        raise ConfigError("model", name, f"loss is {float(loss.detach())} at initialization")
    try:
        torch.autograd.backward(loss)
    except Exception as exc:
        raise ConfigError("model", name, f"backward raised {_what(exc)}") from exc
    if all(p.grad is None for p in model.parameters()):
        raise ConfigError("model", name, "the loss has no gradient for any parameter")
    model.zero_grad(set_to_none=True)


def _what(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")


def _shape(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    if isinstance(value, tuple | list):
        return f"a {type(value).__name__} of {len(value)}"
    return f"a {type(value).__name__}"
