"""torchft's recovery on our recovery benchmark's model: from a SIGKILL to the replica's first
committed step in its new life, measured the way ``bench_recovery.py`` measures ours.

torchft (``pip install torchft==0.2.0``: not a dependency of ddiloco) runs fault-tolerant
data-parallel training: a lighthouse (its coordinator), and per replica group a Manager that
joins a quorum every step; a restarted replica heals by copying a live peer's state over
HTTP, then takes part in the step's gradient all-reduce. Here: the same model, data and
batch as ``bench_recovery.py`` (gpt-1m at context 64, batch 8; ddiloco's Trainer and data),
3 replica groups of one process each (gloo on CPU), replica 0 SIGKILLed at ``--kill-at`` s
and started again at once. Printed: the kill, the new life's first step (``back``: it has
healed from a peer) and its first committed step with all replicas taking part (``merged``:
its gradient is in the others' update), from the kill. Torchft steps in lock-step, so this
is data-parallel recovery, not Decoupled DiLoCo's: the comparison is of the restart path
(a fresh interpreter, the quorum, the peer copy), not of the training method.

    .venv/bin/pip install torchft==0.2.0
    .venv/bin/python benchmarks/bench_torchft_recovery.py [--kill-at 25] [--after 15]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

CONFIG = [
    "model='gpt-1m'",
    "train.learners=3",
    "train.batch_size=8",
    "train.seq_len=64",
    "train.tokens=600000",
]


def replica(index: int, lighthouse: str, store_port: int) -> None:
    """One replica group of one process: train until killed, one JSON line per step."""
    import torch
    from torch.distributed import TCPStore  # type: ignore[attr-defined]
    from torchft import Manager, ProcessGroupGloo
    from torchft.optim import OptimizerWrapper

    from ddiloco.config import load_config
    from ddiloco.data.corpus import BatchStream
    from ddiloco.runtime.run import RunSetup
    from ddiloco.trainer import Trainer

    torch.set_num_threads(1)
    config = load_config(None, CONFIG)
    setup = RunSetup(config, "data_parallel")
    stream = BatchStream(setup.splits.shards[index], 8, setup.seq_len, config.seed + index)
    trainer = Trainer(setup.model, stream, config.train, setup.steps_each)
    inner = trainer.optimizer
    # the replica group's store (torchrun would host it): kept referenced, or it stops
    store = TCPStore("127.0.0.1", store_port, 1, is_master=True, wait_for_workers=False)

    def load(state: dict[str, Any]) -> None:  # a healing replica: a live peer's state
        trainer.model.load_state_dict(state["model"])
        inner.load_state_dict(state["optim"])

    manager = Manager(
        pg=ProcessGroupGloo(),
        min_replica_size=1,
        load_state_dict=load,
        state_dict=lambda: {"model": trainer.model.state_dict(), "optim": inner.state_dict()},
        replica_id=f"replica{index}",
        store_addr="127.0.0.1",
        store_port=store_port,
        rank=0,
        world_size=1,
        lighthouse_addr=lighthouse,
    )

    def average(p: torch.Tensor) -> None:  # gradients averaged over the quorum's replicas
        manager.allreduce(p.grad).wait()

    for p in trainer.model.parameters():
        p.register_post_accumulate_grad_hook(average)
    trainer.optimizer = OptimizerWrapper(manager, inner)  # quorum at zero_grad, commit at step
    print(json.dumps({"kind": "up", "t": time.time(), "store": store.port}), flush=True)
    while True:
        loss, _ = trainer.train_step()
        print(
            json.dumps(
                {
                    "kind": "step",
                    "t": time.time(),
                    "step": manager.current_step(),
                    "participants": manager.num_participants(),
                    "loss": loss,
                }
            ),
            flush=True,
        )


def start(index: int, lighthouse: str, port: int, log: Path) -> subprocess.Popen[bytes]:
    out = log.open("ab")
    cmd = [sys.executable, __file__, "--replica", str(index), "--lighthouse", lighthouse]
    return subprocess.Popen([*cmd, "--store-port", str(port)], stdout=out, stderr=out)


def steps(log: Path, since: float) -> list[dict[str, Any]]:
    out = []
    for line in log.read_text(errors="replace").splitlines():
        if line.startswith('{"kind": "step"'):
            record = json.loads(line)
            if record["t"] > since:
                out.append(record)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kill-at", type=float, default=25.0, help="wall seconds")
    parser.add_argument("--after", type=float, default=15.0, help="seconds to run on after")
    parser.add_argument("--out", type=Path, default=Path("runs/bench-torchft"))
    parser.add_argument("--replica", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--lighthouse", help=argparse.SUPPRESS)
    parser.add_argument("--store-port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.replica is not None:
        replica(args.replica, args.lighthouse, args.store_port)
        return
    from torchft.coordination import LighthouseServer

    args.out.mkdir(parents=True, exist_ok=True)
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1)
    address = lighthouse.address()
    logs = [args.out / f"replica{i}.log" for i in range(3)]
    for log in logs:
        log.write_bytes(b"")
    ports = [29600 + i for i in range(3)]
    procs = [start(i, address, ports[i], logs[i]) for i in range(3)]
    try:
        time.sleep(args.kill_at)
        procs[0].send_signal(signal.SIGKILL)
        procs[0].wait()
        kill = time.time()
        procs[0] = start(0, address, ports[0], logs[0])
        time.sleep(args.after)
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        lighthouse.shutdown()
    new = steps(logs[0], kill)
    if not new:
        sys.exit(f"replica 0 took no step within {args.after} s of its restart: see {logs[0]}")
    back = new[0]["t"]
    merged = next((r["t"] for r in new if r["participants"] == 3), None)
    before = [r for r in steps(logs[1], 0) if r["t"] < kill]
    step = before[-1]["step"] if before else "?"
    print(f"torchft {_version()}: gpt-1m ctx 64 batch 8, 3 replicas, replica 0 killed at "
          f"{args.kill_at:.0f} s (step {step} on replica 1)")  # fmt: skip
    print("| runtime | back (first step) | first step with all 3 replicas |")
    print("|---|---|---|")
    all3 = f"{merged - kill:.1f} s" if merged is not None else f"none in {args.after:.0f} s"
    print(f"| torchft, a fresh process | {back - kill:.1f} s | {all3} |")


def _version() -> str:
    from importlib.metadata import version

    return version("torchft")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
