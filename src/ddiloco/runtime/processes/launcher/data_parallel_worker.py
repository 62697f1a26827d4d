"""One rank of the data-parallel baseline on real processes: torchrun DDP with checkpoints.

Run by torchrun (:mod:`.data_parallel` starts it):
``python -m ddiloco.runtime.processes.launcher.data_parallel_worker --config PATH --out DIR
--t0 T --method data_parallel``. Every rank builds the one run assembly
(:class:`~ddiloco.runtime.run.RunSetup`: Theta_0 from the seed, the same on every rank), wraps
the model in ``DistributedDataParallel`` (gloo on CPU; NCCL on CUDA, each rank on
``cuda:LOCAL_RANK``) and trains it with the shared :class:`~ddiloco.trainer.Trainer`. Rank r is
rank ``r % processes.ranks`` of replica ``m = r // processes.ranks``: it draws from shard m
with the seed learner m's rank draws with under the launcher, ``train.batch_size`` sequences a
step, so the global batch is every rank's. It stops at ``train.tokens`` (all ranks together),
at ``train.max_virtual_seconds`` wall seconds since the launch if set, or when rank 0 gets
SIGUSR1 (the job's clean stop); rank 0 decides and every rank follows.

Checkpoints (every ``data_parallel.checkpoint_every`` steps, rank 0 writes them, the data positions
of every rank gathered first): ``<out>/checkpoints/ckpt-<step>.bin``, written to a temp file,
fsynced, renamed, the directory fsynced, in the format of :mod:`..state_file` (a magic, a
version, the payload length, a BLAKE3 digest, then msgpack plus raw tensors, never pickle).
At start every rank loads the latest one (torchrun restarted the group;
``TORCHELASTIC_RESTART_COUNT`` is the attempt); a damaged one, or one another job wrote, is refused
with :class:`CheckpointError` naming the file, and the rank exits :data:`~ddiloco.errors.FATAL_EXIT`
after a ``fatal`` event, so the job gives up at once. Those are the job's own, to roll back to;
the model a user takes home is rank 0's checkpoint of the global model
(:mod:`ddiloco.checkpoints`: ``<run>/checkpoints/...``, every ``train.checkpoint_every`` tokens
the model holds and at the end; ``--run-dir`` names the run directory).

Events (``@event`` lines, as the launcher's children print): every rank ``rank_up`` (its pid,
so the job can signal it) and, if it must give up, ``fatal``; rank 0 ``learner_up``,
``resumed``, ``step``, ``eval``, ``checkpoint`` and at the end ``dp_done`` (what the job's
summary needs).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ddiloco.checkpoints.format import CheckpointError as CheckpointError  # one error, re-exported
from ddiloco.checkpoints.write import CheckpointWriter
from ddiloco.config import RunConfig, load_config
from ddiloco.data.corpus import BatchStream
from ddiloco.data.info import bits_per_byte
from ddiloco.errors import FATAL_EXIT, ConfigError, DDiLoCoError
from ddiloco.runtime import layout
from ddiloco.runtime.processes.state_file import StateFile
from ddiloco.runtime.processes.transport.events import Events
from ddiloco.runtime.run import RunSetup
from ddiloco.trainer import Trainer, pick_device

FIELDS = (
    "version",
    "method",
    "model",
    "world",
    "step",
    "tokens",
    "positions",
    "stepping_seconds",
    "next_eval",
    "weights",
    "optimizer",
)
# the job's rollback checkpoints: <out>/checkpoints/ckpt-<step>.bin, the newest two kept
ROLLBACK = StateFile(b"DDPCKPT\0", 1, FIELDS, "data-parallel checkpoint", prefix="ckpt", keep=2)
STOP_SIGNAL = signal.SIGUSR1  # the job's clean stop, to rank 0


def latest(directory: Path) -> tuple[int, Path] | None:
    """The newest rollback checkpoint in ``directory`` (by step), None if there is none."""
    return ROLLBACK.latest(directory)


def write_checkpoint(directory: Path, step: int, state: dict[str, Any]) -> tuple[Path, int]:
    """One rollback checkpoint, atomically (:meth:`StateFile.write`); its path and size."""
    return ROLLBACK.write(directory, step, state)


def read_checkpoint(path: Path) -> dict[str, Any]:
    """A rollback checkpoint checked to the byte, or :class:`CheckpointError` naming it."""
    return ROLLBACK.read(path)


# -- the worker ------------------------------------------------------------------------------
def rank_device(name: str, local: int, world: int) -> torch.device:
    """This rank's device: ``train.device``'s kind; on CUDA with several ranks, the
    ``LOCAL_RANK``-th GPU (one per rank), refused when this host has too few."""
    device = pick_device(name)
    if device.type != "cuda":
        return device
    if not torch.cuda.is_available():
        raise ConfigError("train.device", name, "CUDA is not available")
    count = torch.cuda.device_count()
    if world == 1:
        return device if device.index is not None else torch.device("cuda", 0)
    if local >= count:
        why = f"rank {local} has no GPU: {world} ranks on a host with {count} (one per rank)"
        raise ConfigError("train.device", name, why)
    return torch.device("cuda", local)


class DPWorker:
    """One rank: its model replica in DDP, its shard, and (rank 0) the checkpoints."""

    def __init__(
        self,
        config: RunConfig,
        method: str,
        out: Path,
        events: Events,
        stop: threading.Event,
        run: Path | None = None,
    ) -> None:
        self.setup = setup = RunSetup(config, method)
        if setup.method.fragments or setup.method.elastic:
            raise ConfigError("method", method, "the torchrun worker runs data_parallel only")
        self.config, self.events, self.stop = config, events, stop
        self.rank = int(os.environ.get("RANK", "0"))
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        per = config.processes.ranks
        if self.world != config.train.learners * per:
            why = f"train.learners x processes.ranks = {config.train.learners * per}"
            raise ConfigError("WORLD_SIZE", self.world, why)
        local = int(os.environ.get("LOCAL_RANK", "0"))
        self.device = rank_device(config.train.device, local, self.world)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        # a rank that waits on the others longer than this (a peer frozen past the plan's
        # longest freeze, a hung rendezvous) raises, and torchrun restarts the group
        frozen = max((e.duration for e in config.chaos if e.kind == "freeze"), default=0.0)
        wait = timedelta(seconds=config.processes.give_up_seconds + frozen)
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        dist.init_process_group(backend, timeout=wait)
        self.dir = out / layout.ROLLBACK
        self.run_dir = run if run is not None else out.parent.parent  # <run>/processes/<method>
        self.writer: CheckpointWriter | None = None  # rank 0's, once resumed
        t = dataclasses.replace(config.train, device=str(self.device))
        replica, sub = divmod(self.rank, per)
        stream = BatchStream(
            setup.splits.shards[replica],
            t.batch_size,
            setup.seq_len,
            config.seed + replica + 7919 * sub,
        )  # as learner m's
        self.batch_tokens = self.world * setup.tokens_per_step  # one step, every rank
        steps = max(1, t.tokens // self.batch_tokens)
        self.trainer = Trainer(setup.model, stream, t, steps)
        self.module = self.trainer.model
        ids = [self.device.index] if self.device.type == "cuda" else None
        self.trainer.model = DistributedDataParallel(self.module, device_ids=ids)
        self.grad_bytes = sum(
            p.numel() * p.element_size() for p in self.module.parameters() if p.requires_grad
        )
        self.tokens = 0  # trained by this lineage (all ranks): what the model holds
        self.stepping_seconds = 0.0  # this lineage's steps (the kept ones, at the end)
        self.next_eval = 0

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def run(self) -> None:
        """Resume, train to the budget or a stop, evaluate; rank 0 reports."""
        path = self.resume()
        self.events(
            "learner_up",
            learner=0,
            ranks=self.world,
            attempt=self.attempt,
            step=self.trainer.steps,
            tokens=self.tokens,
            device=str(self.device),
            grad_bytes=self.grad_bytes,
            batch_tokens=self.batch_tokens,
            stepping_seconds=self.stepping_seconds,
        )
        if path is not None:
            self.events(
                "resumed",
                step=self.trainer.steps,
                tokens=self.tokens,
                stepping_seconds=round(self.stepping_seconds, 6),
                attempt=self.attempt,
                path=str(path),
            )
        elif self.leader:
            self.evaluate()
        if self.leader:
            self.writer = CheckpointWriter(self.setup, self.run_dir, tokens=self.tokens)
        every = self.config.data_parallel.checkpoint_every
        done = self.tokens >= self.config.train.tokens
        while not done:
            started = time.perf_counter()
            loss, _ = self.trainer.train_step()
            secs = time.perf_counter() - started
            self.tokens += self.batch_tokens
            self.stepping_seconds += secs
            self.events(
                "step",
                learner=0,
                step=self.trainer.steps,
                loss=loss,
                tokens=self.tokens,
                batch_tokens=self.batch_tokens,
                secs=secs,
            )
            if self.trainer.steps % every == 0:
                self.checkpoint()
            evaluated = None
            if self.leader and self.tokens >= self.next_eval:
                evaluated = self.evaluate()
            done = self.decide_stop() or self.tokens >= self.config.train.tokens
            if not done and self.writer is not None and self.writer.due(self.tokens):
                self.writer.write(self.module, self.tokens, evaluated)  # the others wait
        loss = self.evaluate() if self.leader else float("nan")
        if self.writer is not None:  # the model a user takes home
            self.writer.write(self.module, self.tokens, loss)
        self.events(
            "dp_done",
            step=self.trainer.steps,
            tokens=self.tokens,
            eval_loss=loss,
            eval_bpb=bits_per_byte(loss, self.config.data.source),
            checkpoint=self.writer.relative() if self.writer is not None else None,
            stepping_seconds=self.stepping_seconds,
            grad_bytes=self.grad_bytes,
            ranks=self.world,
            attempt=self.attempt,
            stopped=self.stop.is_set(),
        )
        dist.destroy_process_group()

    def decide_stop(self) -> bool:
        """Rank 0's word, on every rank: asked to stop (SIGUSR1), or out of wall time."""
        limit = self.config.train.max_virtual_seconds
        stop = self.stop.is_set() or bool(limit and self.events.now() >= limit)
        flag = torch.tensor([int(stop and self.leader)], device=self.device)
        dist.broadcast(flag, 0)
        return bool(flag.item())

    def evaluate(self) -> float:
        loss = self.setup.evaluate(self.module)
        self.events("eval", tokens=self.tokens, loss=loss)
        self.next_eval = self.tokens + self.config.train.eval_every
        return loss

    def checkpoint(self) -> None:
        """Every rank's data position to rank 0, which writes the checkpoint."""
        mine = torch.tensor([self.trainer.stream.position], dtype=torch.int64, device=self.device)
        positions = [torch.zeros_like(mine) for _ in range(self.world)]
        dist.all_gather(positions, mine)
        if not self.leader:
            return
        started = time.perf_counter()
        state = {
            "version": ROLLBACK.version,
            "method": self.setup.method_name,
            "model": self.config.model,
            "world": self.world,
            "step": self.trainer.steps,
            "tokens": self.tokens,
            "positions": [int(p.item()) for p in positions],
            "stepping_seconds": self.stepping_seconds,
            "next_eval": self.next_eval,
            "weights": self.module.state_dict(),
            "optimizer": self.trainer.optimizer.state_dict(),
        }
        path, size = write_checkpoint(self.dir, self.trainer.steps, state)
        self.events(
            "checkpoint",
            step=self.trainer.steps,
            tokens=self.tokens,
            path=str(path),
            bytes=size,
            seconds=round(time.perf_counter() - started, 6),
        )

    def resume(self) -> Path | None:
        """Load the newest checkpoint (rank 0 picks it, every rank reads it), if any."""
        found = latest(self.dir) if self.leader else None
        step = torch.tensor([found[0] if found else -1], dtype=torch.int64, device=self.device)
        dist.broadcast(step, 0)
        if int(step.item()) < 0:
            return None
        path = ROLLBACK.path(self.dir, int(step.item()))
        self.load(read_checkpoint(path), path)
        return path

    def load(self, state: dict[str, Any], path: Path) -> None:
        """Adopt a checkpoint's state, refusing one another job wrote (names the file)."""
        mine = {"method": self.setup.method_name, "model": self.config.model, "world": self.world}
        for key, value in mine.items():
            if state[key] != value:
                raise CheckpointError(path, f"written with {key}={state[key]!r}, not {value!r}")
        if len(state["positions"]) != self.world:
            count = len(state["positions"])
            raise CheckpointError(path, f"{count} data positions, not {self.world}")
        try:
            self.module.load_state_dict(state["weights"])
            self.trainer.optimizer.load_state_dict(state["optimizer"])
        except (RuntimeError, KeyError, ValueError, TypeError) as exc:
            raise CheckpointError(path, f"does not fit this model: {exc}") from exc
        self.trainer.steps = int(state["step"])
        self.trainer.stream.position = int(state["positions"][self.rank])
        self.tokens = int(state["tokens"])
        self.stepping_seconds = float(state["stepping_seconds"])
        self.next_eval = int(state["next_eval"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ddiloco dp", description=__doc__.split("\n")[0])
    parser.add_argument("--config", required=True, help="the run's config (TOML)")
    parser.add_argument("--out", required=True, help="the job's folder (checkpoints/)")
    parser.add_argument("--run-dir", help="the run directory (default: --out's grandparent)")
    parser.add_argument("--t0", type=float, default=None, help="the launch (epoch seconds)")
    parser.add_argument("--method", default="data_parallel")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # until the config says how many
    stop = threading.Event()
    signal.signal(STOP_SIGNAL, lambda *_: stop.set())  # before rank_up: then it may come
    rank = int(os.environ.get("RANK", "0"))
    every = Events(args.t0 if args.t0 is not None else time.time())
    every(
        "rank_up",
        rank=rank,
        pid=os.getpid(),
        attempt=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
        world=int(os.environ.get("WORLD_SIZE", "1")),
    )
    events = every if rank == 0 else Events(every.t0, open(os.devnull, "w"))  # noqa: SIM115
    try:
        run = Path(args.run_dir) if args.run_dir else None
        config = load_config(args.config)
        torch.set_num_threads(config.processes.threads)
        worker = DPWorker(config, args.method, Path(args.out), events, stop, run)
        worker.run()
    except DDiLoCoError as exc:  # a restart cannot fix it: say so, and the job gives up
        print(f"ddiloco dp: error: rank {rank}: {exc}", file=sys.stderr, flush=True)
        every("fatal", rank=rank, error=str(exc))
        return FATAL_EXIT
    return 0


if __name__ == "__main__":
    sys.exit(main())
