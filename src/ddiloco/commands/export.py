"""``ddiloco export RUN [--method M] [--step N] --out DIR``: a checkpoint directory of the
global model, from any run.

From the run's checkpoints (``RUN/checkpoints/...``; the latest by default), or, for a
processes run that stopped before its last checkpoint, from what its processes kept: the
syncer's durable store, or the data-parallel job's rollback checkpoints (``--store`` asks
for that; without it, it is used when it holds more tokens than the latest checkpoint of a
run that wrote no summary). An unknown method or step is refused with what exists. The
output is written atomically and checked: it loads with ``ddiloco sample`` / ``eval`` and,
for a Hugging Face model, with ``AutoModelForCausalLM.from_pretrained(DIR)``.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ddiloco.checkpoints.format import CheckpointError, equivalent_step, manifest_key
from ddiloco.checkpoints.load import (
    Checkpoint,
    available,
    find_checkpoint,
    is_checkpoint,
    listing,
    load_checkpoint,
    pick_method,
    run_config,
    verify,
)
from ddiloco.checkpoints.write import copy_checkpoint, write_checkpoint
from ddiloco.config import RunConfig
from ddiloco.data.tokenizer import tokenizer_for
from ddiloco.errors import ConfigError
from ddiloco.models.gpt import GPT_CONFIGS
from ddiloco.models.hf import is_hf
from ddiloco.runtime.layout import run_secret

if TYPE_CHECKING:
    from ddiloco.runtime.processes.recover import Recovered


def add_source_arguments(parser: argparse.ArgumentParser, what: str) -> None:
    """The arguments naming a model: a run or checkpoint directory, a method, a step."""
    parser.add_argument("path", metavar=what, help="a run directory or a checkpoint directory")
    parser.add_argument("--method", help="the run's method (default: its first)")
    parser.add_argument("--step", type=int, help="the checkpoint's step (default: the latest)")
    parser.add_argument(
        "--store",
        action="store_true",
        help="from the processes' state (syncer store, data-parallel rollback checkpoint)",
    )
    parser.add_argument(
        "--model",
        metavar="MODULE:FUNCTION",
        help="the builder of a checkpoint of your own model code (a checkpoint names it, "
        "but never has it run: you say which code you trust)",
    )
    parser.add_argument(
        "--secret-file",
        help="the run secret, to authenticate the checkpoints' MAC where the run directory "
        "does not keep it (a hand-started run; a checkpoint directory by itself)",
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_source_arguments(parser, "RUN")
    parser.add_argument("--out", required=True, help="the checkpoint directory to write")


@dataclass
class Source:
    """Where a model comes from: a checkpoint directory, or a processes run's state; ``key``:
    the run's manifest key when its secret is at hand (checkpoints/format.py)."""

    checkpoint: Path | None = None
    recovered: Recovered | None = None
    method: str = ""
    key: bytes | None = None


def key_of(run: Path, method: str, secret_file: str | None = None) -> bytes | None:
    """The manifest key of ``method``'s checkpoints in ``run``: from ``secret_file`` (the
    user's ``--secret-file``), else the secret a processes run of a fragment method keeps,
    0600, in its processes home; None when neither is at hand."""
    path = Path(secret_file) if secret_file else run_secret(run, method)
    if not secret_file and not path.exists():
        return None
    from ddiloco.runtime.processes.transport.sockets import load_secret

    return manifest_key(load_secret(str(path)))


def pick(
    path: Path,
    method: str | None,
    step: int | None,
    store: bool,
    model: str | None = None,
    secret_file: str | None = None,
) -> Source:
    """The model ``path`` (and the options) name (module docstring); ``model``: the
    ``--model`` the user trusts to build a run of user code; ``secret_file``: the run
    secret the user gives (its checkpoints' MAC is then checked)."""
    if is_checkpoint(path):
        if store or step is not None or method is not None:
            why = "is a checkpoint directory: --store, --step and --method name one in a run"
            raise ConfigError("path", str(path), why)
        key = key_of(path, "", secret_file) if secret_file else None
        return Source(checkpoint=path, key=key)
    config = run_config(path)
    method = pick_method(config, method)
    key = key_of(path, method, secret_file)
    if step is not None and not store:
        return Source(find_checkpoint(path, method, step), method=method, key=key)
    from ddiloco.runtime.processes.recover import recover, state_of

    config = trusted_builder(config, model, path)
    steps = available(path, config)[method]
    state = state_of(path, config, method)
    if store or not steps:
        if state is None:
            have = (
                ""
                if store
                else f"no checkpoints of {method} ({listing(available(path, config))}) and "
            )
            why = f"{have}no syncer store or data-parallel checkpoint of {method} to recover from"
            raise CheckpointError(path, why)
        if store and step is not None:
            raise ConfigError("--step", step, "the processes' state holds only the latest model")
        return Source(recovered=recover(path, config, method), method=method)
    latest = find_checkpoint(path, method)
    if state is None or finished(path, method):
        return Source(checkpoint=latest, method=method, key=key)
    recovered = recover(path, config, method)  # a run that stopped: is its state newer?
    tokens = int(json.loads((latest / "ddiloco.json").read_text(encoding="utf-8"))["tokens"])
    if recovered.tokens > tokens:
        return Source(recovered=recovered, method=method)
    return Source(checkpoint=latest, method=method, key=key)


def trusted_builder(config: RunConfig, model: str | None, run: Path) -> RunConfig:
    """A run's config may name user code as its model (``module:function``); building the
    model a run's state is recovered into must not run code a file chose (issue 29): the
    user's ``--model`` says which builder they trust, as for a checkpoint."""
    if config.model in GPT_CONFIGS or is_hf(config.model):
        return config
    if model is None:
        why = (
            f"the run {run} trains user code ({config.model[:200]!r}), and a run directory "
            f"never runs code it names: pass --model {config.model[:200]} if that is the "
            "builder you trust"
        )
        raise ConfigError("--model", None, why)
    return replace(config, model=model)


def finished(run: Path, method: str) -> bool:
    """The run wrote its summary with ``method``'s last checkpoint (it ended normally)."""
    try:
        summary = json.loads((run / "summary.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    methods: dict[str, Any] = summary.get("methods", {})
    return bool(methods.get(method, {}).get("checkpoint"))


def open_model(args: argparse.Namespace, device: str = "cpu") -> Checkpoint:
    """The model a command's source arguments name, loaded (a recovered one in memory)."""
    source = pick(Path(args.path), args.method, args.step, args.store, args.model, args.secret_file)
    if source.checkpoint is not None:
        return load_checkpoint(source.checkpoint, device, builder=args.model, key=source.key)
    rec = source.recovered
    assert rec is not None
    config = rec.setup.config
    manifest = {
        "method": source.method,
        "step": step_of(rec),
        "tokens": rec.tokens,
        "model": config.model,
        "source": str(rec.source),
    }
    rec.model.to(device).eval()
    return Checkpoint(rec.source, manifest, config, rec.model, tokenizer_for(config.data.source))


def step_of(rec: Recovered) -> int:
    t = rec.setup.config.train
    return equivalent_step(rec.tokens, t.learners, rec.setup.tokens_per_step)


def run(args: argparse.Namespace) -> int:
    out = Path(args.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError("--out", str(out), "exists and is not an empty directory")
    source = pick(Path(args.path), args.method, args.step, args.store, args.model, args.secret_file)
    if source.checkpoint is not None:
        manifest = verify(source.checkpoint, source.key)
        copy_checkpoint(source.checkpoint, out, sorted(manifest["files"]))
        origin = str(source.checkpoint)
    else:
        rec = source.recovered
        assert rec is not None
        config = rec.setup.config
        write_checkpoint(
            out,
            rec.model,
            config,
            tokenizer_for(config.data.source),
            method=source.method,
            step=step_of(rec),
            tokens=rec.tokens,
            eval_loss=rec.setup.evaluate(rec.model),
        )
        origin = f"{rec.source} (the processes' state)"
    manifest = verify(out)
    print(
        f"exported {manifest['method']} step-{manifest['step']} ({manifest['tokens']:,} tokens, "
        f"eval loss {manifest['eval_loss']:.4f}) from {origin} to {out}"
    )
    return 0
