"""Peak memory of a learner and of the syncer against a plain training loop, in one run.

Three measurements of the same model and batch, side by side:

(a) a plain loop: the project's Trainer (AdamW) on the model, ``--steps`` steps, alone in a
    process of its own (the same torch threads as a learner: ``processes.threads``);
(b) each learner process and (c) the syncer process of a real ``ddiloco train --runtime
    processes`` run (``--learners`` learners, no chaos, ``--tokens`` tokens).

Each process's peak RSS is its ``VmHWM`` (/proc/<pid>/status), read as it exits: the children
of the run import a ``sitecustomize`` written by this script (a benchmark-only hook, on their
PYTHONPATH) that records it from ``atexit`` and from ``os._exit`` (how the services end), and
this script also polls every child's ``/proc`` entry while it lives (a fallback, and the RSS
timeline with ``--timeline``). Targets (issue 28): learner <= 1.5x the plain loop, syncer <=
3x the fp32 model.

    .venv/bin/python benchmarks/bench_memory.py                      # gpt-50m, batch 2, 2 learners
    .venv/bin/python benchmarks/bench_memory.py --model gpt-12m --tokens 20000
    .venv/bin/python benchmarks/bench_memory.py --model bench_memory:gpt_200m   # ~200M params
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent

HOOK = textwrap.dedent(
    """
    import atexit, json, os, sys
    _out = os.environ.get("DDILOCO_BENCH_HWM")
    def _record():
        if not _out:
            return
        try:
            with open("/proc/self/status") as f:
                status = dict(line.split(":", 1) for line in f if ":" in line)
            kib = {k: int(status[k].split()[0]) for k in ("VmHWM", "VmRSS") if k in status}
            with open(os.path.join(_out, f"{os.getpid()}.json"), "w") as f:
                json.dump({"pid": os.getpid(), "argv": sys.argv, **kib}, f)
        except Exception:
            pass
    if _out:
        atexit.register(_record)
        _exit = os._exit
        def _recorded_exit(code):
            _record()
            _exit(code)
        os._exit = _recorded_exit
    """
)


def gpt_200m() -> Any:
    """A ~200M-parameter GPT (16 layers of width 1024, context 512, byte vocabulary): the
    larger size of issue 28 (``--model bench_memory:gpt_200m``)."""
    from ddiloco.models.gpt import GPT, GPTConfig

    return GPT(GPTConfig(n_layer=16, n_head=16, n_embd=1024, block_size=512))


def status_kib(pid: int) -> dict[str, int]:
    """VmHWM and VmRSS of a live process (KiB); empty once it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            lines = [line.split(":", 1) for line in f if line.startswith(("VmHWM", "VmRSS"))]
    except OSError:
        return {}
    return {k: int(v.split()[0]) for k, v in lines}


def descendants(root: int) -> list[int]:
    """Every live descendant of ``root`` (Linux /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rpartition(")")[2].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def role(argv: list[str]) -> str:
    """learner-<m>, syncer, torchrun (a learner's agent), or what the command line says."""
    if any(a == "torch.distributed.run" or a.endswith("torch/distributed/run.py") for a in argv):
        return "torchrun"
    if "learner" in argv:
        for flag in ("--id", "--learner"):
            if flag in argv:
                return f"learner-{argv[argv.index(flag) + 1]}"
        return "learner"
    if "syncer" in argv:
        return "syncer"
    return " ".join(argv[:3])


def cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return []


# -- (a) the plain loop --------------------------------------------------------------------
def plain_loop(overrides: list[str], steps: int) -> None:
    """Runs in a child process: the Trainer alone on the model and batch; prints its peak."""
    import torch

    from ddiloco.config import load_config
    from ddiloco.data.corpus import BatchStream
    from ddiloco.runtime.run import RunSetup
    from ddiloco.trainer import Trainer

    setup = RunSetup(load_config(None, overrides))
    torch.set_num_threads(setup.config.processes.threads)
    t = setup.config.train
    stream = BatchStream(setup.splits.shards[0], t.batch_size, setup.seq_len, setup.config.seed)
    trainer = Trainer(setup.model, stream, t, setup.steps_each)
    started = time.perf_counter()
    for _ in range(steps):
        trainer.train_step()
    seconds = (time.perf_counter() - started) / steps
    params = sum(p.numel() for p in setup.model.parameters())
    print(json.dumps({**status_kib(os.getpid()), "params": params, "step_seconds": seconds}))


def runtime_baseline() -> None:
    """Runs in a child process: the syncer's imports and nothing else (torch, the runtime);
    prints its peak, what every process pays before it holds a tensor."""
    import torch

    import ddiloco.runtime.processes.syncer.service  # noqa: F401
    from ddiloco.config import load_config
    from ddiloco.runtime.run import RunSetup  # noqa: F401

    torch.set_num_threads(load_config(None, []).processes.threads)
    print(json.dumps(status_kib(os.getpid())))


def shm_bytes(skip: set[str]) -> int:
    """Bytes in this user's ddiloco directories under /dev/shm but ``skip`` (other runs')."""
    from ddiloco.runtime.processes.transport.shm import SHM_ROOT

    total = 0
    for run_dir in SHM_ROOT.glob(f"ddiloco-{os.getuid()}-*"):
        if run_dir.name in skip:
            continue
        for slot in run_dir.glob("*"):
            with contextlib.suppress(OSError):
                total += slot.stat().st_size
    return total


# -- (b), (c) a processes run ----------------------------------------------------------------
def processes_run(overrides: list[str], out: Path, timeline: bool) -> dict[str, Any]:
    """``ddiloco train --runtime processes``; every child's peak (KiB) by role, and the run's
    wall seconds."""
    hook = out / "hook"
    hwm = out / "hwm"
    hook.mkdir()
    hwm.mkdir()
    (hook / "sitecustomize.py").write_text(HOOK)
    env = {
        **os.environ,
        "DDILOCO_BENCH_HWM": str(hwm),
        "PYTHONPATH": os.pathsep.join([str(hook), str(HERE), os.environ.get("PYTHONPATH", "")]),
    }
    argv = [sys.executable, "-m", "ddiloco.cli", "train", "--runtime", "processes", "--quiet"]
    argv += ["--out", str(out / "run")]
    for item in overrides:
        argv += ["--set", item]
    from ddiloco.runtime.processes.transport.shm import SHM_ROOT

    others = {d.name for d in SHM_ROOT.glob(f"ddiloco-{os.getuid()}-*")}
    started = time.monotonic()
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    polled: dict[int, dict[str, Any]] = {}
    shm_peak = [0]
    stop = threading.Event()

    def poll() -> None:
        while not stop.is_set():
            shm_peak[0] = max(shm_peak[0], shm_bytes(others))
            children = descendants(proc.pid)
            for pid in [proc.pid, *children]:  # the launcher too
                kib = status_kib(pid)
                if not kib:
                    continue
                seen = polled.setdefault(pid, {"argv": cmdline(pid), "samples": []})
                seen["VmHWM"] = max(seen.get("VmHWM", 0), kib.get("VmHWM", 0))
                if children:  # what each holds while the run's processes live
                    seen["held"] = max(seen.get("held", 0), kib.get("VmRSS", 0))
                if timeline:
                    seen["samples"].append((round(time.monotonic() - started, 2), kib["VmRSS"]))
            stop.wait(0.1)

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    _, err = proc.communicate()
    stop.set()
    poller.join()
    if proc.returncode != 0:
        raise SystemExit(f"the run failed ({proc.returncode}):\n{err.decode()[-3000:]}")
    peaks: dict[str, dict[str, Any]] = {}
    for pid, seen in polled.items():
        name = role(seen["argv"])
        peaks[f"{name} ({pid})"] = {
            "VmHWM": seen["VmHWM"],
            "held": seen.get("held", 0),
            "samples": seen["samples"],
        }
    for path in hwm.glob("*.json"):
        rec = json.loads(path.read_text())
        # (the row the poller made for this pid, whose argv reads other than the hook's)
        polled_name = [k for k in peaks if k.endswith(f" ({rec['pid']})")]
        name = polled_name[0] if polled_name else f"{role(rec['argv'])} ({rec['pid']})"
        held = peaks.setdefault(name, {"VmHWM": 0, "held": 0, "samples": []})
        held["VmHWM"] = max(held["VmHWM"], rec.get("VmHWM", 0))
        held["at_exit"] = True
    return {"peaks": peaks, "seconds": time.monotonic() - started, "shm": shm_peak[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gpt-50m")
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=40000)
    parser.add_argument("--learners", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8, help="the plain loop's steps")
    parser.add_argument("--set", action="append", default=[], help="more config overrides")
    parser.add_argument("--timeline", action="store_true", help="print each child's RSS (MiB)")
    parser.add_argument("--plain-child", help=argparse.SUPPRESS)
    parser.add_argument("--baseline-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.plain_child:
        plain_loop(json.loads(args.plain_child), args.steps)
        return
    if args.baseline_child:
        runtime_baseline()
        return
    overrides = [
        f"model={args.model!r}",
        f"train.batch_size={args.batch_size}",
        f"train.learners={args.learners}",
        f"train.tokens={args.tokens}",
        'methods=["decoupled"]',
        "chaos=[]",
        *args.set,
    ]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
    }
    child = [sys.executable, __file__, "--plain-child", json.dumps(overrides), "--steps"]
    done = subprocess.run([*child, str(args.steps)], env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"the plain loop failed:\n{done.stderr[-3000:]}")
    plain = json.loads(done.stdout.strip().splitlines()[-1])
    done = subprocess.run([*child[:2], "--baseline-child"], env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"the runtime baseline failed:\n{done.stderr[-3000:]}")
    runtime = json.loads(done.stdout.strip().splitlines()[-1])["VmHWM"] / 1024
    with tempfile.TemporaryDirectory(prefix="bench-memory-") as tmp:
        run = processes_run(overrides, Path(tmp), args.timeline)
    mib = 1 / 1024
    fp32 = plain["params"] * 4 / 2**20
    print(
        f"{args.model}: {plain['params'] / 1e6:.1f}M parameters ({fp32:.0f} MiB fp32), batch "
        f"{args.batch_size}, {args.learners} learners, {args.tokens} tokens "
        f"(the run: {run['seconds']:.0f} s; plain step {plain['step_seconds']:.2f} s)"
    )
    print("\n| process | peak RSS (MiB) | ratio | target |\n|---|---|---|---|")
    base = plain["VmHWM"] * mib
    print(f"| plain AdamW loop, {args.steps} steps | {base:.0f} | 1.00 | |")
    print(f"| runtime alone (python + torch + ddiloco imported) | {runtime:.0f} | | |")
    for name, peak in sorted(run["peaks"].items()):
        value = peak["VmHWM"] * mib
        if name.startswith("learner"):
            print(f"| {name} | {value:.0f} | {value / base:.2f} x plain | <= 1.5 |")
        elif name.startswith("syncer"):
            net = (value - runtime) / fp32
            print(
                f"| {name} | {value:.0f} | {value / fp32:.2f} x fp32 model; above the runtime: "
                f"{net:.2f} x | <= 3 |"
            )
        else:  # the launcher: its peak is its pre-flight step, before any child starts
            held = peak["held"] * mib
            print(f"| {name} | {value:.0f}; held while the run's processes lived: {held:.0f} | | |")
    print(f"| /dev/shm slots of the run (in no process's RSS) | {run['shm'] / 2**20:.0f} | | |")
    if args.timeline:
        for name, peak in sorted(run["peaks"].items()):
            every = max(1, len(peak["samples"]) // 40)  # about 40 readings each
            samples = " ".join(f"{t:.0f}s:{kib * mib:.0f}" for t, kib in peak["samples"][::every])
            print(f"\n{name}: {samples}")


if __name__ == "__main__":
    main()
