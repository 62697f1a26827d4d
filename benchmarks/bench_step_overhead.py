"""Learner step time with syncing on against the same loop with syncing off, in one run.

A real ``ddiloco syncer`` process and one learner (this process) train a model whose step
dominates (default gpt-4m). Blocks of ``--steps`` steps alternate: syncing off (the inner
step only) and syncing on (the inner step plus progress report, answering asks and applying
merged fragments: the learner process's own ``step``; encoding and sending happen in the link
thread). Alternating blocks cancels slow drifts of a shared machine. Target: ratio <= 1.03,
also while the syncer evaluates a large model all the time (``--eval-every`` tokens, on its
evaluation thread, which must not stall merges or beats).

    .venv/bin/python benchmarks/bench_step_overhead.py --model gpt-4m --blocks 6 --steps 10
    .venv/bin/python benchmarks/bench_step_overhead.py --model gpt-12m --eval-every 512 \
        --eval-batches 16
    .venv/bin/python benchmarks/bench_step_overhead.py --ray   # the learner as a Ray task
    .venv/bin/python benchmarks/bench_step_overhead.py --ranks 2 --parallel fsdp  # torchrun

With ``--ray`` the learner runs in a Ray worker process on a local Ray cluster (as ``ddiloco
train --runtime ray`` runs it; the syncer stays a process): Ray's own threads share the
machine with it in both kinds of block. With ``--ranks R`` the learner is R torchrun ranks
(``--parallel ddp`` or ``fsdp``), every rank timing its own steps; rank 0 prints.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

from ddiloco.config import load_config
from ddiloco.runtime.processes.learner.process import LearnerProcess
from ddiloco.runtime.processes.transport.events import Events
from ddiloco.runtime.processes.transport.sockets import SECRET_ENV
from ddiloco.runtime.run import RunSetup
from syncer_process import start_syncer


def measure(
    overrides: list[str], address: str, secret: bytes, blocks: int, steps: int
) -> dict[str, Any]:
    """One learner against the syncer at ``address``: ``blocks`` pairs of ``steps`` steps
    with syncing off, then on; the step times (s), the inner steps of the syncing-on ones,
    and the merged fragment versions it applied."""
    torch.set_num_threads(1)
    setup = RunSetup(load_config(None, overrides))
    quiet = Events(time.time(), io.StringIO())
    learner = LearnerProcess(setup, 0, address, "bench", secret, quiet)
    engine = learner.engine
    if engine.ranks.active:  # every rank: the engine's own start (collectives included)
        engine.start()
    else:
        engine.link.start()
        engine.server.start()
        engine.link.register(engine.status())
        if not engine.link.await_welcome(120):
            raise SystemExit("the syncer did not answer")
    inner: list[float] = []  # the inner step alone, inside the syncing-on steps
    train_step = learner.trainer.train_step

    def timed_step(batches: int = 1) -> tuple[float, int]:
        t = time.perf_counter()
        out = train_step(batches)
        inner.append(time.perf_counter() - t)
        return out

    learner.trainer.train_step = timed_step  # type: ignore[method-assign]
    for _ in range(3):  # warm up both paths
        learner.step()
    off: list[float] = []
    on: list[float] = []
    for _ in range(blocks):
        for _ in range(steps):
            t = time.perf_counter()
            train_step()
            off.append(time.perf_counter() - t)
        for _ in range(steps):
            t = time.perf_counter()
            learner.step()
            on.append(time.perf_counter() - t)
    merged = sum(engine.sync.versions)
    if engine.ranks.active:
        engine.close()
    else:
        engine.link.close(0.0)
        engine.server.close()
    return {"off": off, "on": on, "inner": inner, "merged": merged}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="gpt-4m")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--blocks", type=int, default=6, help="pairs of (off, on) blocks")
    parser.add_argument("--steps", type=int, default=10, help="steps per block")
    parser.add_argument("--fragments", type=int, default=12)
    parser.add_argument("--eval-every", type=int, default=1_000_000_000, help="syncer, tokens")
    parser.add_argument("--eval-batches", type=int, default=1)
    parser.add_argument("--ray", action="store_true", help="the learner in a Ray worker")
    parser.add_argument("--ranks", type=int, default=1, help="torchrun ranks of the learner")
    parser.add_argument("--parallel", default="ddp", choices=["ddp", "fsdp"])
    parser.add_argument("--rank-child", help=argparse.SUPPRESS)  # ADDRESS: one torchrun rank
    args = parser.parse_args()
    torch.set_num_threads(1)
    overrides = [
        f"model='{args.model}'",
        "methods=['decoupled']",
        "train.learners=1",
        f"train.batch_size={args.batch}",
        "train.tokens=1000000000",
        f"train.eval_every={args.eval_every}",
        f"sync.fragments={args.fragments}",
        f"sync.sync_every={args.fragments}",
        f"data.eval_batches={args.eval_batches}",
        f"processes.ranks={args.ranks}",
        f"train.parallel='{args.parallel}'",
    ]
    if args.rank_child:  # one rank of the torchrun learner (the secret in its environment)
        result = measure(overrides, args.rank_child, bytes.fromhex(os.environ[SECRET_ENV]),
                         args.blocks, args.steps)  # fmt: skip
        if int(os.environ.get("RANK", "0")) == 0:
            print("RESULT " + json.dumps(result), flush=True)
        return
    config = load_config(None, overrides)
    tmp = Path(tempfile.mkdtemp(prefix="ddiloco-bench-"))
    secret = os.urandom(32)
    syncer, address = start_syncer(tmp, config, "bench", secret)
    evals: list[str] = []
    threading.Thread(
        target=lambda: evals.extend(
            line for line in syncer.stdout or () if '"kind": "eval"' in line
        ),
        daemon=True,
    ).start()
    try:
        if args.ranks > 1:  # the learner as torchrun ranks, as `processes.ranks` starts it
            result = ranks_measure(args, address, secret)
        elif args.ray:  # the learner in a Ray actor's worker, as `--runtime ray` runs it
            import ray

            ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
            task = ray.remote(num_cpus=1)(measure)
            result = ray.get(task.remote(overrides, address, secret, args.blocks, args.steps))
            ray.shutdown()
        else:
            result = measure(overrides, address, secret, args.blocks, args.steps)
    finally:
        syncer.kill()  # (a SIGTERM would make it evaluate once more: minutes for big models)
        syncer.wait(timeout=30)
    off, on, inner, merged = result["off"], result["on"], result["inner"], result["merged"]
    m_off, m_on = statistics.median(off), statistics.median(on)
    print(
        f"model {args.model}, batch {args.batch}, {args.ranks} rank(s) ({args.parallel}), "
        f"P = H = {args.fragments}, "
        f"{len(off)} + {len(on)} steps, merged fragment versions {merged}, "
        f"syncer evaluations finished {len(evals)}"
    )
    print(
        f"inner step inside the syncing-on steps: {statistics.median(inner) * 1e3:.1f} ms "
        "(growth over 'off' is CPU/GIL contention, not work in the training loop)"
    )
    print(
        f"step off {m_off * 1e3:.1f} ms (median), on {m_on * 1e3:.1f} ms: "
        f"ratio {m_on / m_off:.3f} (mean ratio {statistics.mean(on) / statistics.mean(off):.3f})"
    )


def ranks_measure(args: argparse.Namespace, address: str, secret: bytes) -> dict[str, Any]:
    """:func:`measure` on every rank of a torchrun learner; rank 0's result."""
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
            str(args.ranks), __file__, "--rank-child", address, "--model", args.model,
            "--batch", str(args.batch), "--blocks", str(args.blocks), "--steps",
            str(args.steps), "--fragments", str(args.fragments), "--eval-every",
            str(args.eval_every), "--eval-batches", str(args.eval_batches), "--ranks",
            str(args.ranks), "--parallel", args.parallel]  # fmt: skip
    env = {**os.environ, SECRET_ENV: secret.hex(), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=3600)
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])  # type: ignore[no-any-return]
    raise SystemExit(f"the ranks failed ({done.returncode}):\n{done.stderr[-3000:]}")


if __name__ == "__main__":
    main()
