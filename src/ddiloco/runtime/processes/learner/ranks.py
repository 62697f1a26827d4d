"""A learner that is itself data-parallel: its ranks under torchrun, rank 0 the only talker.

Owns what the ranks of one learner share through ``torch.distributed`` (gloo on CPU, NCCL
on GPU): gradients averaged during backward (a post-accumulate hook per parameter, so the
sim's Trainer runs unchanged), and at every step boundary what rank 0 decided (stop or go
on, which merged fragments to apply with their values), and at start the state rank 0
recovered (a snapshot's bytes). Only rank 0 has the syncer link and the snapshot server, so
to the syncer a learner of any size is one learner. No pickle: only tensors are broadcast.
With WORLD_SIZE unset or 1 every method is a cheap no-op.

Every collective is started asynchronously and waited on in Python (:meth:`RankGroup._wait`),
not inside the backend: a rank whose peer is gone must still hear its SIGTERM. Torchrun
stops the surviving ranks of a group with SIGTERM (then SIGKILL 30 s later); a wait that
sat in C++ would keep the learner's slot, and its rank 0's link, for those 30 s. A
collective that fails, or still waits :data:`STUCK_AFTER_TERM_SECONDS` after a SIGTERM,
raises :class:`RankGroupFailed`: the group cannot go on, and the learner exits non-zero.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ddiloco.trainer import pick_device

log = logging.getLogger(__name__)

Apply = tuple[int, int, list[torch.Tensor]]  # fragment, version, values

STUCK_AFTER_TERM_SECONDS = 5.0  # a collective still waiting this long after SIGTERM: failed
WAIT_WARN_SECONDS = 30.0  # a collective waiting this long is said (then every 30 s)
MAX_POLL_SECONDS = 0.005  # polls start at 50 us and double up to this


class RankGroupFailed(RuntimeError):
    """A collective among this learner's ranks failed: a rank is gone, the group cannot
    go on (torchrun, or the Ray child, restarts the learner as a whole)."""


def watch_agent(rank: int, every: float = 0.5) -> None:
    """Exit when torchrun's agent, our parent, is gone (SIGKILLed with the launcher): its
    ranks would otherwise wait, orphaned, in a rendezvous or a collective for gloo's
    30-minute timeout, holding a learner's slot and ports."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(every)
        log.error("rank %d: its torchrun agent (pid %d) is gone: exiting", rank, parent)
        logging.shutdown()
        os._exit(1)

    threading.Thread(target=watch, name="agent-watch", daemon=True).start()


class RankGroup:
    """This process's place among its learner's data-parallel ranks. ``terminated`` is
    the learner's SIGTERM flag: a collective waiting on after it is taken as failed."""

    def __init__(self, device: str = "cpu", terminated: threading.Event | None = None) -> None:
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        self.device = torch.device("cpu")
        self.terminated = terminated if terminated is not None else threading.Event()
        self.failed: str | None = None  # why the group failed (a collective's error)
        if self.world > 1 and "TORCHELASTIC_RUN_ID" in os.environ:
            watch_agent(self.rank)
        if self.world > 1 and not dist.is_initialized():
            # the learner's device, not whatever the host has: a CPU run on a GPU host
            # all-reduces CPU tensors (gloo), which NCCL cannot
            cuda = pick_device(device).type == "cuda"
            if cuda:
                local = int(os.environ.get("LOCAL_RANK", "0"))
                if local >= torch.cuda.device_count():  # it sees only its own GPU (a Ray
                    local = 0  # rank actor: Ray sets CUDA_VISIBLE_DEVICES per actor)
                torch.cuda.set_device(local)
                self.device = torch.device("cuda", local)
            dist.init_process_group("nccl" if cuda else "gloo")

    @property
    def leader(self) -> bool:
        return self.rank == 0

    @property
    def active(self) -> bool:
        return self.world > 1

    def _wait(self, what: str, works: Sequence[Any]) -> None:
        """Wait for started collectives, polling so that SIGTERM's handler runs meanwhile;
        raises :class:`RankGroupFailed` on a collective's error, or when still waiting
        :data:`STUCK_AFTER_TERM_SECONDS` after a SIGTERM (a peer rank is gone)."""
        started = time.monotonic()
        warn_at, term_seen, delay = started + WAIT_WARN_SECONDS, 0.0, 5e-5
        while not all(w.is_completed() for w in works):
            time.sleep(delay)
            delay = min(2 * delay, MAX_POLL_SECONDS)
            now = time.monotonic()
            if self.terminated.is_set():
                term_seen = term_seen or now
                if now - term_seen >= STUCK_AFTER_TERM_SECONDS:
                    self._fail(
                        what,
                        f"still waiting {now - started:.1f} s, {STUCK_AFTER_TERM_SECONDS:.0f} s "
                        "after SIGTERM: a rank of this learner is gone",
                    )
            if now >= warn_at:
                log.warning("rank %d: waiting %.0f s for the %s", self.rank, now - started, what)
                warn_at = now + WAIT_WARN_SECONDS
        try:
            for w in works:
                w.wait()
        except RuntimeError as e:  # (DistBackendError is one: a peer's socket closed)
            self._fail(what, str(e).splitlines()[0])

    def _fail(self, what: str, why: str) -> None:
        self.failed = f"rank {self.rank} of {self.world}: the {what} failed: {why}"
        raise RankGroupFailed(self.failed)

    def average_gradients(self, model: nn.Module) -> None:
        """All-reduce every gradient as backward produces it (overlapping the rest of
        backward), then wait for them all at backward's end, so each rank's optimizer step
        sees the mean gradient of the learner's global batch."""
        if not self.active:
            return
        world = self.world
        started: list[tuple[torch.Tensor, Any]] = []  # (gradient, its all-reduce)

        def finish() -> None:  # backward's last callback (as DDP's): every gradient reduced
            try:
                self._wait("gradient all-reduce", [w for _, w in started])
            finally:
                grads = [g for g, _ in started]
                started.clear()
            for g in grads:
                g.div_(world)

        def reduce(p: torch.Tensor) -> None:
            assert p.grad is not None
            if not started:
                torch.autograd.Variable._execution_engine.queue_callback(finish)
            started.append((p.grad, dist.all_reduce(p.grad, async_op=True)))

        for p in model.parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(reduce)  # type: ignore[no-untyped-call]

    def shard(self, model: nn.Module, bf16: bool = False) -> nn.Module:
        """FSDP2 over this learner's ranks (``train.parallel = "fsdp"``): every block of
        every ``nn.ModuleList`` (a transformer's layers) its own unit, then the rest; each
        rank then holds 1/R of the parameters, gradients and optimizer state. ``bf16``:
        compute in bf16, reduce gradients in fp32 (CUDA under ``train.precision``).

        The model (Theta_0, built in host memory) is sharded as a skeleton on the meta
        device, materialized on this rank's device, and only this rank's rows of each
        parameter are copied in: the whole model never lands on the device (the ceiling
        sharding removes), nor twice in host memory."""
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        from ddiloco.core.shards import shard_rows

        policy = (
            MixedPrecisionPolicy(torch.bfloat16, torch.float32) if bf16 else MixedPrecisionPolicy()
        )
        params = {n: p.detach() for n, p in model.named_parameters()}
        buffers = {n: b.detach() for n, b in model.named_buffers()}
        model.to("meta")
        for module in list(model.modules()):
            if isinstance(module, nn.ModuleList):
                for block in module:
                    fully_shard(block, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        model.to_empty(device=self.device)
        with torch.no_grad():
            for n, p in model.named_parameters():
                local = p.to_local() if hasattr(p, "to_local") else p
                lo, hi = shard_rows(p.shape[0], self.world, self.rank) if p.dim() else (0, 0)
                local.copy_(params.pop(n)[lo:hi] if p.dim() else params.pop(n))
            for n, b in model.named_buffers():
                b.copy_(buffers[n])
        return model

    def share_boundary(
        self,
        stop: bool,
        wait: bool,
        applies: list[Apply],
        shapes: Sequence[Sequence[tuple[int, ...]]],
        answered: Sequence[int] = (),
    ) -> tuple[bool, bool, list[Apply], list[int]]:
        """Rank 0's decisions at a step boundary (stop, wait for a merge, the fragments to
        apply, the fragments it answered before applying), the same on every rank."""
        if not self.active:
            return stop, wait, applies, list(answered)
        p_count = len(shapes)
        head = torch.zeros(3 + 3 * p_count, dtype=torch.int64, device=self.device)
        if self.leader:
            head[0], head[1], head[2] = int(stop), int(wait), len(applies)
            for i, (p, version, _) in enumerate(applies):
                head[3 + 2 * i], head[4 + 2 * i] = p, version
            for p in answered:
                head[3 + 2 * p_count + p] = 1
        self._wait("boundary broadcast", [dist.broadcast(head, 0, async_op=True)])
        flags = head[3 + 2 * p_count :].tolist()
        snapshots = [p for p in range(p_count) if flags[p]]
        out: list[Apply] = []
        for i in range(int(head[2])):
            p, version = int(head[3 + 2 * i]), int(head[4 + 2 * i])
            if self.leader:
                values = [v.to(self.device) for v in applies[i][2]]
            else:
                values = [torch.empty(s, device=self.device) for s in shapes[p]]
            works = [dist.broadcast(v, 0, async_op=True) for v in values]
            self._wait("merged fragment broadcast", works)
            out.append((p, version, [v.cpu() for v in values]))
        return bool(head[0]), bool(head[1]), out, snapshots

    def share_asks(
        self, asks: dict[int, int], final: bool, fragments: int
    ) -> tuple[dict[int, int], bool]:
        """Rank 0's asks (fragment -> round id, of ``fragments``) and final-rounds flag on
        every rank (a sharded learner's ranks each answer their rows of them): one broadcast
        of a fixed size, every step."""
        if not self.active:
            return asks, final
        head = torch.zeros(1 + 2 * fragments, dtype=torch.int64, device=self.device)
        if self.leader:
            head[0] = int(final)
            for p, round_id in asks.items():
                head[1 + p], head[1 + fragments + p] = 1, round_id
        self._wait("ask broadcast", [dist.broadcast(head, 0, async_op=True)])
        values = head.tolist()
        shared = {p: values[1 + fragments + p] for p in range(fragments) if values[1 + p]}
        return shared, bool(values[0])

    def share_bytes(self, blob: bytes | None) -> bytes:
        """Rank 0's bytes (a recovered state, a decision) on every rank: another rank's
        ``blob`` is not read (every rank returns rank 0's, whatever it passed)."""
        if not self.active:
            assert blob is not None
            return blob
        size = torch.tensor([len(blob) if blob is not None else 0], device=self.device)
        self._wait("state broadcast", [dist.broadcast(size, 0, async_op=True)])
        if self.leader:
            assert blob is not None
            data = torch.frombuffer(bytearray(blob), dtype=torch.uint8).to(self.device)
        else:
            data = torch.empty(int(size), dtype=torch.uint8, device=self.device)
        self._wait("state broadcast", [dist.broadcast(data, 0, async_op=True)])
        return blob if self.leader and blob is not None else bytes(data.cpu().numpy().tobytes())

    def all_ints(self, values: Sequence[int]) -> list[list[int]]:
        """Every rank's ``values`` (the same length on every rank), in rank order."""
        if not self.active:
            return [list(values)]
        mine = torch.tensor(list(values), dtype=torch.int64, device=self.device)
        into = [torch.empty_like(mine) for _ in range(self.world)]
        self._wait("all-gather", [dist.all_gather(into, mine, async_op=True)])
        return [t.tolist() for t in into]

    def all_texts(self, text: str, longest: int = 512) -> list[str]:
        """Every rank's ``text`` (UTF-8, at most ``longest`` bytes), in rank order."""
        raw = text.encode()
        if len(raw) > longest:
            raise ValueError(f"{text[:40]!r}...: longer than {longest} bytes")
        rows = self.all_ints([len(raw), *raw, *bytes(longest - len(raw))])
        return [bytes(row[1 : 1 + row[0]]).decode() for row in rows]

    def any(self, flag: bool) -> bool:
        """Whether ``flag`` holds on any rank."""
        return bool(max(row[0] for row in self.all_ints([int(flag)])))

    def agree(self, value: float) -> bool:
        """Whether every rank holds the same ``value`` (e.g. a parameter checksum)."""
        if not self.active:
            return True
        if self.failed is not None:  # a broken group cannot check
            return False
        both = torch.tensor([value, -value], dtype=torch.float64, device=self.device)
        work = dist.all_reduce(both, op=dist.ReduceOp.MAX, async_op=True)
        self._wait("checksum all-reduce", [work])
        return float(both[0]) == -float(both[1])

    def close(self) -> None:
        if self.active and dist.is_initialized() and self.failed is None:
            dist.destroy_process_group()
