"""The model contract, checked before training on both clocks: refuse a run that cannot
train, in one line that names the key and the cause, before the first step.

A broken model, data set or device otherwise shows as a traceback mid-run, or (under
``--runtime processes``) as processes that crash and are restarted until the launcher gives
up, with the cause buried in their logs. What a model must do, checked here in this order:

* the device exists in this torch build, and ``train.precision = "bf16"`` can autocast on it;
* its vocabulary (``config.vocab_size``, else its first embedding's size, then the logits'
  last dim) covers the data's (:func:`ddiloco.data.info.vocab_size`: 256 for raw text);
* its context (:func:`ddiloco.trainer.model_context`) is at least ``train.seq_len``;
* every learner's shard and the eval split hold a sequence;
* one training forward/backward on a real batch of 2 at the run's sequence length, with the
  Trainer's precision, returns ``(logits, loss)``: logits ``(batch, sequence, >= vocab)``, a
  finite scalar loss, a gradient for some parameter; one evaluation batch gives a finite loss.

About 1 s for gpt-1m on 2 CPU cores, most of it splitting the corpus (which the run reuses).
The check trains on ``setup.model`` in place (moved to the device, gradients cleared, no
optimizer step: its weights do not change).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ddiloco.config import RunConfig
from ddiloco.data.corpus import BatchStream, TokenShard, load_documents
from ddiloco.data.info import BYTE_VOCAB, vocab_size
from ddiloco.errors import ConfigError, DDiLoCoError
from ddiloco.runtime.run import RunSetup
from ddiloco.trainer import CONTEXT_FIELDS, model_context, pick_device, uses_bf16

CHECK_BATCH = 2  # sequences in the checked training batch


def assemble(config: RunConfig, method: str = "decoupled", **given: Any) -> RunSetup:
    """The run's :class:`RunSetup` (``given``: its ``splits_given`` / ``evals_given``), with an
    exception from the user's model factory (or from planning its parameters) named."""
    try:
        return RunSetup(config, method, **given)
    except DDiLoCoError:
        raise
    except Exception as exc:
        raise ConfigError("model", config.model, f"building it raised {_what(exc)}") from exc


def check_contract(setup: RunSetup) -> None:
    """Raise a :class:`ConfigError` naming why ``setup`` cannot train."""
    config = setup.config
    name = config.model
    device = check_device(config.train.device)
    amp = check_precision(config.train.precision, device)
    vocab = vocab_size(config.data.source)
    _vocabulary_fits(name, _vocabulary(setup.model), vocab)
    _context_fits(setup)
    shards = _shards(setup)
    for m, shard in enumerate(shards):  # as each learner draws its batches
        try:
            BatchStream(shard, config.train.batch_size, setup.seq_len, config.seed + m)
        except ConfigError as exc:
            source = config.data.source
            raise ConfigError("data.source", source, f"learner {m}: {exc}") from exc
    evals = setup.eval_batches  # raises when the eval split is shorter than one sequence
    stream = BatchStream(shards[0], CHECK_BATCH, setup.seq_len, config.seed)
    model = setup.model.to(device)
    if not config.train.entry:  # (an own loop trains the model its own way: not checked)
        _train_step(setup, model, *stream.next(), device, amp, vocab)
    field, spec = ("train.evaluate", config.train.evaluate) if config.train.evaluate else (
        "model", name)  # fmt: skip
    try:
        loss = setup.evaluate(model, evals[:1])
    except DDiLoCoError:
        raise
    except Exception as exc:
        hint = ""
        if config.train.entry and not config.train.evaluate:
            hint = (
                ": the syncer evaluates the global model as model(inputs, targets) -> "
                "(logits, loss); name your own evaluation as train.evaluate = "
                "'module:function' (function(model, batches) -> mean loss)"
            )
        raise ConfigError(field, spec, f"evaluation raised {_what(exc)}{hint}") from exc
    if not math.isfinite(loss):
        raise ConfigError(field, spec, f"evaluation loss is {loss} at initialization")


def check_device(spec: str) -> torch.device:
    """``train.device``, if this torch build and machine have it."""
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


def check_precision(precision: str, device: torch.device) -> bool:
    """Whether training autocasts to bf16 (as the Trainer does); 'bf16' where the device
    cannot is refused."""
    if precision == "bf16" and not bf16_works(device):
        raise ConfigError(
            "train.precision",
            precision,
            f"{device} cannot autocast to bf16 (torch {torch.__version__}); use 'fp32' or 'auto'",
        )
    return uses_bf16(precision, device)


def bf16_works(device: torch.device) -> bool:
    """A bf16 autocast matmul runs on ``device`` and gives bf16."""
    if device.type == "cuda" and not torch.cuda.is_bf16_supported():
        return False
    try:
        with torch.autocast(device.type, torch.bfloat16):
            a = torch.ones(2, 2, device=device)
            out = a @ a
    except Exception:
        return False
    return out.dtype == torch.bfloat16


def _vocabulary(model: nn.Module) -> int | None:
    """The model's vocabulary: ``config.vocab_size``, else its first embedding's size."""
    size = getattr(getattr(model, "config", None), "vocab_size", None)
    if isinstance(size, int):
        return size
    embedding = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
    return None if embedding is None else int(embedding.num_embeddings)


def _vocabulary_fits(name: str, model_vocab: int | None, data_vocab: int) -> None:
    if model_vocab is not None and model_vocab < data_vocab:
        what = "bytes" if data_vocab == BYTE_VOCAB else "ids of data.source's tokenizer"
        raise ConfigError(
            "model", name, f"vocabulary {model_vocab} < {data_vocab}: tokens are {what}"
        )


def _context_fits(setup: RunSetup) -> None:
    seq_len = setup.config.train.seq_len
    context = model_context(setup.model)
    if seq_len and context is not None and seq_len > context:
        config = getattr(setup.model, "config", None)
        field = next(f for f in CONTEXT_FIELDS if getattr(config, f, None) == context)
        raise ConfigError(
            "train.seq_len",
            seq_len,
            f"longer than the context of model {setup.config.model!r} "
            f"({context} tokens: config.{field})",
        )


def _shards(setup: RunSetup) -> Sequence[TokenShard]:
    """The learners' shards; split_corpus refuses missing files and too little text."""
    source = setup.config.data.source
    try:
        return setup.splits.shards
    except DDiLoCoError:
        raise
    except Exception as exc:  # e.g. no text at all: torch.frombuffer of 0 bytes
        why = "no text: the files are empty" if _empty(source) else f"cannot be split: {_what(exc)}"
        raise ConfigError("data.source", source, why) from exc


def _empty(source: str) -> bool:
    try:
        return sum(len(text) for _, text in load_documents(source)) == 0
    except Exception:  # not raw text: say what split_corpus said
        return False


def _train_step(
    setup: RunSetup,
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    device: torch.device,
    amp: bool,
    vocab: int,
) -> None:
    """One forward/backward as :class:`~ddiloco.trainer.Trainer` runs it."""
    name = setup.config.model
    model.train()
    x, y = x.to(device), y.to(device)
    context = f"on a batch of shape {tuple(x.shape)} (int64 token ids < {vocab}) with targets"
    try:
        with torch.autocast(device.type, torch.bfloat16, enabled=amp):
            out = model(x, y)
    except Exception as exc:
        hint = ""
        if model_context(model) is None and not setup.config.train.seq_len:
            hint = (
                f" (the model's config declares no context ({', '.join(CONTEXT_FIELDS)}): "
                f"sequences are {setup.seq_len} tokens; set train.seq_len)"
            )
        raise ConfigError("model", name, f"forward {context} raised {_what(exc)}{hint}") from exc
    if not (isinstance(out, tuple | list) and len(out) == 2):
        raise ConfigError("model", name, f"forward returned {_shape(out)}, not (logits, loss)")
    logits, loss = out
    want = f"({x.shape[0]}, {x.shape[1]}, >= {vocab})"
    if (
        not isinstance(logits, torch.Tensor)
        or logits.dim() != 3
        or tuple(logits.shape[:2]) != tuple(x.shape)
    ):
        raise ConfigError("model", name, f"logits are {_shape(logits)}, not {want}")
    _vocabulary_fits(name, int(logits.shape[2]), vocab)
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
