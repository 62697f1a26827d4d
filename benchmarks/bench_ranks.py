"""A torchrun learner's step with its gradients all-reduced as backward produces them and
waited for in Python at backward's end (``learner/ranks.py``, decision 84) against the plain
way (a blocking all-reduce per gradient inside backward), side by side in one run.

    .venv/bin/python -m torch.distributed.run --standalone --nproc-per-node 2 \\
        benchmarks/bench_ranks.py [--model gpt-1m] [--batch 8] [--steps 10] [--repeats 6]

Prints rank 0's median step time of each (the first repeat is a warm-up) and their ratio
(target <= 1.0: waiting in Python so that SIGTERM can land must not cost step time).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
import torch.distributed as dist

from ddiloco.config import load_config
from ddiloco.data.corpus import BatchStream
from ddiloco.runtime.processes.learner.ranks import RankGroup
from ddiloco.runtime.run import RunSetup
from ddiloco.trainer import Trainer


def blocking(group: RankGroup, model: torch.nn.Module) -> None:
    """The plain way: each gradient all-reduced, blocking, as backward produces it."""

    def reduce(p: torch.Tensor) -> None:
        assert p.grad is not None
        dist.all_reduce(p.grad)
        p.grad.div_(group.world)

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(reduce)  # type: ignore[no-untyped-call]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gpt-1m")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=6)
    args = ap.parse_args()
    torch.set_num_threads(1)
    config = load_config(None, [f"model='{args.model}'", f"train.batch_size={args.batch}"])
    setup = RunSetup(config, "decoupled")
    group = RankGroup(config.train.device)
    trainers = {}
    for way in ("blocking", "ours"):
        stream = BatchStream(setup.splits.shards[0], args.batch, setup.seq_len, group.rank)
        trainer = Trainer(copy.deepcopy(setup.model), stream, config.train, 10_000)
        if way == "ours":
            group.average_gradients(trainer.model)
        else:
            blocking(group, trainer.model)
        trainers[way] = trainer
    times: dict[str, list[float]] = {way: [] for way in trainers}
    for _ in range(args.repeats):  # interleaved: both see the same load
        for way, trainer in trainers.items():
            started = time.perf_counter()
            for _ in range(args.steps):
                trainer.train_step()
            times[way].append((time.perf_counter() - started) / args.steps)
    if group.leader:
        plain, ours = (statistics.median(times[w][1:]) for w in ("blocking", "ours"))
        what = f"{args.model} batch {args.batch}, {group.world} ranks ({group.device})"
        print(f"{what}: step blocking {plain * 1e3:.1f} ms, ours {ours * 1e3:.1f} ms, "
              f"ratio {ours / plain:.3f}")  # fmt: skip
    group.close()


if __name__ == "__main__":
    main()
