"""Writing checkpoints of the global model: what goes in, when one is due, and the atomic
publish (docs/checkpoints.md).

A checkpoint is written into a hidden temp directory beside its final name (``.step-N.*.tmp``),
every file and the directory fsynced, then renamed to ``step-N``: a reader never sees a half
directory of that name, and a crash leaves only a hidden temp directory, removed by the next
writer of that home. A later checkpoint of the same step (the final one after a periodic one
at the same step; a data-parallel job restarted from an older rollback checkpoint) replaces
it: the old directory is renamed aside first, then removed. Every checkpoint is kept: they are
the user's, and ``train.checkpoint_every`` bounds how many a run writes.

Writing only reads the model it is given (and the resume state the simulated clock hands it,
:mod:`.sim_state`) and evaluates a model of its own, so it never changes a run: the simulated
clock's results are bit for bit those of a run without checkpoints.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import logging
import math
import os
import secrets
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ddiloco.checkpoints.format import (
    FORMAT,
    MAC,
    MANIFEST,
    MODEL_CONFIG,
    RUN_CONFIG,
    STEP,
    WEIGHTS,
    CheckpointError,
    digest,
    equivalent_step,
    home_of,
    manifest_mac,
    step_name,
)
from ddiloco.checkpoints.sim_state import ResumeState, write_state
from ddiloco.checkpoints.weights import write_weights
from ddiloco.config import RunConfig, to_toml
from ddiloco.core.fragments import gather, scatter
from ddiloco.data.info import bits_per_byte
from ddiloco.data.tokenizer import Tokenizer, tokenizer_for, transformers_files
from ddiloco.models.gpt import GPT
from ddiloco.models.hf import HFCausalLM
from ddiloco.trainer import model_context

if TYPE_CHECKING:
    from ddiloco.runtime.run import RunSetup

log = logging.getLogger(__name__)


def model_kind(model: nn.Module) -> str:
    """How a model is written and loaded back: ``gpt``, ``hf`` or ``module``."""
    if isinstance(model, GPT):
        return "gpt"
    if isinstance(model, HFCausalLM):
        return "hf"
    return "module"


def write_model(directory: Path, model: nn.Module, spec: str) -> tuple[str, dict[str, str]]:
    """The weights and config.json of ``model`` (built from ``spec``) into ``directory``:
    the model's kind, and the digests already known (hashed as written). A Hugging Face model
    is written by its own ``save_pretrained`` (loadable with ``from_pretrained`` as it is);
    any other model as safetensors (:mod:`.weights`)."""
    kind = model_kind(model)
    if isinstance(model, HFCausalLM):
        model.hf.save_pretrained(str(directory))
        return kind, {}
    known = {WEIGHTS: write_weights(directory / WEIGHTS, model.state_dict(), {"format": "pt"})}
    described: dict[str, Any] = {"ddiloco_model": kind, "model": spec}
    if isinstance(model, GPT):
        described["config"] = dataclasses.asdict(model.config)
    _write_json(directory / MODEL_CONFIG, described)
    return kind, known


def write_checkpoint(
    path: Path,
    model: nn.Module,
    config: RunConfig,
    tokenizer: Tokenizer,
    *,
    method: str,
    step: int,
    tokens: int,
    eval_loss: float,
    state: ResumeState | None = None,
    key: bytes | None = None,
) -> Path:
    """Write one checkpoint directory at ``path``, atomically (module docstring); a failed
    write (a full disk) is a :class:`CheckpointError` naming it, and leaves what was there.
    ``state``: the simulated clock's resume state (:mod:`.sim_state`), written with it;
    ``key``: the run's manifest key (:func:`~.format.manifest_key`), to authenticate it."""
    with _staged(path) as tmp:
        kind, known = write_model(tmp, model, config.model)
        if state is not None:
            known.update(write_state(tmp, state))
        tokenizer.save(tmp)
        for name, content in transformers_files(tokenizer, model_context(model)).items():
            _write_json(tmp / name, content)  # (eos_token for AutoTokenizer: issue 33)
        if kind == "hf" and tokenizer.eot is not None:
            end_of_text_ids(tmp, tokenizer.eot)
        (tmp / RUN_CONFIG).write_text(to_toml(config), encoding="utf-8")
        files = {}
        for f in sorted(tmp.rglob("*")):
            if f.is_file():
                name = f.relative_to(tmp).as_posix()
                files[name] = {"bytes": f.stat().st_size, "blake3": known.get(name) or digest(f)}
        manifest = {
            "format": FORMAT,
            "method": method,
            "step": step,
            "tokens": tokens,
            "eval_loss": eval_loss,
            "eval_bpb": bits_per_byte(eval_loss, config.data.source),
            "model": config.model,
            "kind": kind,
            "tokenizer": tokenizer.name,
            "files": files,
        }
        if key is not None:
            manifest[MAC] = manifest_mac(manifest, key)
        _write_json(tmp / MANIFEST, manifest)
        for f in tmp.rglob("*"):
            if f.relative_to(tmp).as_posix() not in known:  # (fsynced as they were written)
                fsync(f)
    return path


def publish(tmp: Path, path: Path) -> None:
    """Rename the complete ``tmp`` to ``path``; an older ``path`` is renamed aside first and
    removed after (a crash between the renames leaves it hidden, and :func:`sweep` puts it
    back)."""
    aside = None
    if path.exists():
        aside = path.with_name(f".{path.name}.{secrets.token_hex(4)}.old")
        os.rename(path, aside)
    os.rename(tmp, path)
    fsync(path.parent)
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)


def sweep(home: Path) -> None:
    """Remove what a crashed writer left in ``home``: hidden temp directories, and put back a
    checkpoint renamed aside whose replacement never arrived."""
    if not home.is_dir():
        return
    for entry in home.iterdir():
        name = entry.name
        if not (name.startswith(".step-") and entry.is_dir()):
            continue
        final = home / name[1:].split(".", 1)[0]
        if name.endswith(".old") and STEP.fullmatch(final.name) and not final.exists():
            with contextlib.suppress(OSError):
                os.rename(entry, final)
                continue
        if name.endswith((".tmp", ".old")):
            shutil.rmtree(entry, ignore_errors=True)


class CheckpointWriter:
    """One method's checkpoints of the global model in a run directory: when one is due
    (every ``train.checkpoint_every`` tokens, at multiples of it), its step, and writing it
    now (:meth:`write`) or on a thread of its own (:meth:`submit`, for the syncer, which keeps
    merging meanwhile). ``tokens`` is the count a resumed run starts from; ``key``: the run's
    manifest key, when the writer holds its secret (every manifest is then authenticated)."""

    def __init__(
        self,
        setup: RunSetup,
        run: Path,
        home: Path | None = None,
        tokens: int = 0,
        key: bytes | None = None,
    ) -> None:
        self.setup = setup
        self.key = key
        self.config = setup.config
        self.run = run
        self.home = home if home is not None else home_of(run, self.config, setup.method_name)
        self.every = self.config.train.checkpoint_every
        self.next = self._after(tokens)
        self.model: nn.Module | None = None  # a copy of the reference model, for fragments
        self.tokenizer: Tokenizer | None = None
        self.last: Path | None = None
        self.thread: threading.Thread | None = None
        self.counts = {"checkpoints": 0, "checkpoint_failed": 0}
        self.seconds = 0.0
        sweep(self.home)

    def _after(self, tokens: int) -> float:
        return (tokens // self.every + 1) * self.every if self.every else math.inf

    def due(self, tokens: int) -> bool:
        """A periodic checkpoint is due (and none is being written)."""
        return tokens >= self.next and not self.busy

    @property
    def busy(self) -> bool:
        return self.thread is not None and self.thread.is_alive()

    def step_of(self, tokens: int) -> int:
        t = self.config.train
        return equivalent_step(tokens, t.learners, self.setup.tokens_per_step)

    def staged(self, fragments: Sequence[Sequence[torch.Tensor]], now: bool = False) -> nn.Module:
        """The global model: ``fragments`` copied into this writer's own copy of the
        reference model (never the reference model itself, which evaluations use); for a
        write ``now`` (nothing changes them meanwhile), the reference model itself when
        ``fragments`` are its own parameters (a syncer's global values: nothing to copy)."""
        if now and self._shared(fragments):
            return self.setup.model
        if self.model is None:
            self.model = copy.deepcopy(self.setup.model)
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for p, values in enumerate(fragments):
                scatter(self.setup.plan, p, params, values)
        return self.model

    def _shared(self, fragments: Sequence[Sequence[torch.Tensor]]) -> bool:
        params = dict(self.setup.model.named_parameters())
        return all(
            got.data_ptr() == want.data_ptr()
            for p, values in enumerate(fragments)
            for got, want in zip(values, gather(self.setup.plan, p, params), strict=True)
        )

    def write(
        self,
        model: nn.Module,
        tokens: int,
        eval_loss: float | None = None,
        state: ResumeState | None = None,
    ) -> Path:
        """Write ``model`` (the global model at ``tokens``) as step-N, with the simulated
        clock's resume ``state`` if given; evaluate it first unless its ``eval_loss`` is
        known."""
        started = time.perf_counter()
        if eval_loss is None:
            eval_loss = self.setup.evaluate(model)
        if self.tokenizer is None:
            self.tokenizer = tokenizer_for(self.config.data.source)
        step = self.step_of(tokens)
        path = write_checkpoint(
            self.home / step_name(step),
            model,
            self.config,
            self.tokenizer,
            method=self.setup.method_name,
            step=step,
            tokens=tokens,
            eval_loss=eval_loss,
            state=state,
            key=self.key,
        )
        self.next = self._after(tokens)
        self.last = path
        self.counts["checkpoints"] += 1
        self.seconds += time.perf_counter() - started
        return path

    def write_fragments(
        self,
        fragments: Sequence[Sequence[torch.Tensor]],
        tokens: int,
        eval_loss: float | None = None,
        state: ResumeState | None = None,
    ) -> Path:
        return self.write(self.staged(fragments, now=True), tokens, eval_loss, state)

    def submit(self, fragments: Sequence[Sequence[torch.Tensor]], tokens: int) -> bool:
        """Copy ``fragments`` now (between two merges) and write them on a thread; False if
        one is still being written (the checkpoint stays due: it is delayed, not skipped)."""
        if self.busy:
            return False
        model = self.staged(fragments)
        self.next = self._after(tokens)  # not due again while this one is written
        self.thread = threading.Thread(
            target=self._background, args=(model, tokens), name="checkpoint", daemon=True
        )
        self.thread.start()
        return True

    def _background(self, model: nn.Module, tokens: int) -> None:
        try:
            self.write(model, tokens)
        except Exception as exc:  # a full disk: the run goes on, the failure is counted
            self.counts["checkpoint_failed"] += 1
            log.error("checkpoint at %d tokens failed: %s: %s", tokens, type(exc).__name__, exc)
        finally:
            self.model = None  # one fp32 model less between checkpoints (issue 28)

    def wait(self) -> None:
        if self.thread is not None:
            self.thread.join()

    def relative(self) -> str | None:
        """The last checkpoint's path, relative to the run directory when it is inside."""
        if self.last is None:
            return None
        try:
            return self.last.relative_to(self.run).as_posix()
        except ValueError:
            return str(self.last)

    def summary(self) -> dict[str, Any]:
        return {**self.counts, "checkpoint_seconds": round(self.seconds, 6)}


def _temp_beside(path: Path) -> Path:
    """A hidden temp directory next to ``path``, readable as any run file is (mkdtemp's is
    the owner's only)."""
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    tmp.chmod(0o755)
    return tmp


def end_of_text_ids(directory: Path, eot: int) -> None:
    """A Hugging Face model's ``eos_token_id``/``bos_token_id`` (config.json and
    generation_config.json, as ``save_pretrained`` wrote them) set to the id that ended each
    document in training: a config made for another tokenizer (Llama's eos 2) would have
    ``generate`` stop at a word of this one's, never at the end of a text."""
    for name in (MODEL_CONFIG, "generation_config.json"):
        path = directory / name
        if path.is_file():
            config = json.loads(path.read_text(encoding="utf-8"))
            config.update(eos_token_id=eot, bos_token_id=eot)
            _write_json(path, config)


def _write_json(path: Path, value: dict[str, Any]) -> None:
    path.write_text(json.dumps(value, indent=1, sort_keys=True) + "\n", encoding="utf-8")


def fsync(path: Path) -> None:
    """fsync a file or a directory (what a rename needs to be durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def copy_checkpoint(source: Path, out: Path, files: Sequence[str]) -> Path:
    """Copy a checked checkpoint's ``files`` (every file its manifest lists, and the
    manifest) to ``out``, atomically, as :func:`write_checkpoint` writes one."""
    with _staged(out) as tmp:
        for name in [*files, MANIFEST]:
            (tmp / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source / name, tmp / name)
            fsync(tmp / name)
    return out


@contextlib.contextmanager
def _staged(path: Path) -> Iterator[Path]:
    """A hidden temp directory beside ``path`` to fill; when the block ends it is fsynced and
    published as ``path`` (:func:`publish`). Any failure removes it, leaves what was at
    ``path``, and an OSError (a full disk) becomes a :class:`CheckpointError` naming ``path``."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = _temp_beside(path)
    except OSError as exc:
        raise CheckpointError(path, f"cannot write it: {exc.strerror or exc}") from exc
    try:
        yield tmp
        fsync(tmp)
        publish(tmp, path)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(path, f"cannot write it: {exc.strerror or exc}") from exc
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
