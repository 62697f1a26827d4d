"""A learner that is itself data-parallel: its ranks under torchrun, rank 0 the only talker.

Owns what the ranks of one learner share through ``torch.distributed`` (gloo on CPU, NCCL
on GPU): gradients averaged during backward (a post-accumulate hook per parameter, so the
sim's Trainer runs unchanged), and at every step boundary what rank 0 decided (stop or go
on, which merged fragments to apply with their values), and at start the state rank 0
recovered (a snapshot's bytes). Only rank 0 has the syncer link and the snapshot server, so
to the syncer a learner of any size is one learner. No pickle: only tensors are broadcast.
With WORLD_SIZE unset or 1 every method is a cheap no-op.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from ddiloco.trainer import pick_device

Apply = tuple[int, int, list[torch.Tensor]]  # fragment, version, values


class RankGroup:
    """This process's place among its learner's data-parallel ranks."""

    def __init__(self, device: str = "cpu") -> None:
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        self.device = torch.device("cpu")
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

    def average_gradients(self, model: nn.Module) -> None:
        """All-reduce every gradient as backward produces it, so each rank's optimizer step
        sees the mean gradient of the learner's global batch."""
        if not self.active:
            return
        world = self.world

        def reduce(p: torch.Tensor) -> None:
            assert p.grad is not None
            dist.all_reduce(p.grad)
            p.grad.div_(world)

        for p in model.parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(reduce)  # type: ignore[no-untyped-call]

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
        dist.broadcast(head, 0)
        flags = head[3 + 2 * p_count :].tolist()
        snapshots = [p for p in range(p_count) if flags[p]]
        out: list[Apply] = []
        for i in range(int(head[2])):
            p, version = int(head[3 + 2 * i]), int(head[4 + 2 * i])
            if self.leader:
                values = [v.to(self.device) for v in applies[i][2]]
            else:
                values = [torch.empty(s, device=self.device) for s in shapes[p]]
            for v in values:
                dist.broadcast(v, 0)
            out.append((p, version, [v.cpu() for v in values]))
        return bool(head[0]), bool(head[1]), out, snapshots

    def share_bytes(self, blob: bytes | None) -> bytes:
        """Rank 0's bytes (a recovered state) on every rank."""
        if not self.active:
            assert blob is not None
            return blob
        size = torch.tensor([len(blob) if blob is not None else 0], device=self.device)
        dist.broadcast(size, 0)
        if self.leader:
            assert blob is not None
            data = torch.frombuffer(bytearray(blob), dtype=torch.uint8).to(self.device)
        else:
            data = torch.empty(int(size), dtype=torch.uint8, device=self.device)
        dist.broadcast(data, 0)
        return blob if blob is not None else bytes(data.cpu().numpy().tobytes())

    def agree(self, value: float) -> bool:
        """Whether every rank holds the same ``value`` (e.g. a parameter checksum)."""
        if not self.active:
            return True
        both = torch.tensor([value, -value], dtype=torch.float64, device=self.device)
        dist.all_reduce(both, op=dist.ReduceOp.MAX)
        return float(both[0]) == -float(both[1])

    def close(self) -> None:
        if self.active and dist.is_initialized():
            dist.destroy_process_group()
