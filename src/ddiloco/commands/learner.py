"""``ddiloco learner``: one learner process of a real-processes run.

Connects to the syncer (``--syncer HOST:PORT``), serves snapshots to newcomers on
``--peer-bind`` (default ``--peer-host``) port ``--peer-port`` (default
``processes.peer_port + id`` when the config fixes one, so the learners of one host never
want the same port; else a free one), tells peers to dial ``--peer-host``, and trains
until the syncer says stop. ``--join`` first copies a healthy peer's state (a restart, or
scavenged compute arriving at any time); ``--resume`` starts from this learner's newest local
checkpoint in ``--state-dir`` (a resumed run); ``--leave-after SECONDS`` goes away cleanly
(SIGTERM does too). ``--entry module:function`` (or the config's ``train.entry``) runs the
user's own training loop instead of ddiloco's: the function makes a ``ddiloco.Learner``,
which reads these arguments from the environment this command sets (own_loop.py's ENV).
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import threading
import time
from pathlib import Path
from typing import Any

from ddiloco.commands.syncer import add_common
from ddiloco.config import load_config
from ddiloco.errors import require
from ddiloco.runtime.processes.learner.options import LearnerOptions
from ddiloco.runtime.processes.transport.events import Events
from ddiloco.runtime.processes.transport.sockets import load_secret, parse_address


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--syncer", default="127.0.0.1:5555", help="HOST:PORT of the syncer")
    parser.add_argument("--id", type=int, help="learner slot (its data shard)")
    parser.add_argument(
        "--spare",
        action="store_true",
        help="a warm spare: import, read the data, then wait on stdin for the slot to take over "
        '(one JSON line: {"id": M, "state_dir": ..., "peer_port": N, "gpus": ...}); it joins',
    )
    parser.add_argument(
        "--join",
        action="store_true",
        help="recover from a healthy peer (else the syncer) before training",
    )
    parser.add_argument(
        "--leave-after",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="leave cleanly after this many seconds (0: stay)",
    )
    parser.add_argument(
        "--peer-host", default="127.0.0.1", help="address peers reach this learner's snapshots on"
    )
    parser.add_argument(
        "--peer-port",
        type=int,
        help="TCP port of the snapshots (default: processes.peer_port + --id when the config "
        "fixes one, as ddiloco train does, else any free port; 0: any free)",
    )
    parser.add_argument(
        "--peer-bind",
        help="interface the snapshots listen on, e.g. 0.0.0.0 (default: --peer-host)",
    )
    parser.add_argument("--max-steps", type=int, default=0, help="stop after N steps (0: never)")
    parser.add_argument(
        "--state-dir",
        help="where this learner keeps its local checkpoints (default: runs/<name>-learner-<id>)",
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="start from the newest local checkpoint in --state-dir (else as --join)",
    )
    parser.add_argument(
        "--entry",
        metavar="MODULE:FUNCTION",
        help="run your own training loop (it makes a ddiloco.Learner) instead of ddiloco's "
        "(default: the config's train.entry)",
    )
    add_common(parser)


def run(args: argparse.Namespace) -> int:
    import torch

    from ddiloco.report.progress import terminal_sink
    from ddiloco.runtime.processes.learner.process import LearnerProcess
    from ddiloco.runtime.processes.learner.ranks import RankGroupFailed
    from ddiloco.runtime.processes.memory import give_back_freed_memory
    from ddiloco.runtime.run import RunSetup

    require((args.id is None) == args.spare, "--id", args.id, "give a slot, or --spare (not both)")
    who = "spare" if args.spare else args.id
    logging.basicConfig(level=logging.WARNING)
    for handler in logging.getLogger().handlers:
        handler.setFormatter(Who(who))
    logging.getLogger("ddiloco").setLevel(logging.INFO)  # ours: a peer copy's progress lines
    parse_address(args.syncer, "--syncer")
    config = load_config(args.config, list(args.set))
    if config.processes.learner_mmap_threshold:  # before the model: its big buffers given back
        give_back_freed_memory(config.processes.learner_mmap_threshold)
    torch.set_num_threads(config.processes.threads)  # before the model and data are built
    entry = args.entry or config.train.entry
    if entry:  # the user's function is found (or refused) before anything is built
        from ddiloco.runtime.processes.learner.own_loop import resolve_entry

        resolve_entry(entry, "--entry" if args.entry else "train.entry")
    setup = None if entry else RunSetup(config, args.method)  # (the user's Learner builds it)
    if args.spare and not take_over(args, setup):
        return 0  # the launcher went away, or stopped the run: nothing to take over
    slots = config.train.learners + config.train.scavenged
    require(0 <= args.id < slots, "--id", args.id, f"slots are 0..{slots - 1}")
    require(args.leave_after >= 0, "--leave-after", args.leave_after, "must be >= 0")
    peer_port = args.peer_port
    if peer_port is None:  # the config's port is the first learner's, as under ddiloco train:
        fixed = config.processes.peer_port  # learners of one host never want the same one
        peer_port = fixed + args.id if fixed else 0
    require(0 <= peer_port <= 65535, "--peer-port", peer_port, "must be in 0..65535 (0: any)")
    state_dir = Path(args.state_dir or f"runs/{config.name}-learner-{args.id}")
    t0 = args.t0 if args.t0 is not None else time.time()
    options = LearnerOptions(
        join=args.join,
        resume=args.resume,
        leave_after=args.leave_after,
        max_steps=args.max_steps,
        peer_host=args.peer_host,
        peer_port=peer_port,
        peer_bind=args.peer_bind,
        state_dir=state_dir,
    )
    if entry:
        from ddiloco.runtime.processes.learner.own_loop import run_entry

        env = {
            "syncer": args.syncer,
            "learner": args.id,
            "config": args.config or "",
            "set": json.dumps(list(args.set)),
            "secret_file": args.secret_file or "",
            "run_id": args.run_id or config.name,
            "method": args.method,
            **options.env(),
            "t0": t0,
        }
        return run_entry(entry, env)
    assert setup is not None
    every = config.report.progress_seconds
    sink = terminal_sink(config.train.tokens, every, args.method)  # (a person: lines)
    events = Events(t0, sink=sink)
    process = LearnerProcess(
        setup,
        args.id,
        args.syncer,
        args.run_id or config.name,
        load_secret(args.secret_file),
        events,
        options,
    )
    try:
        return process.run()
    except RankGroupFailed as e:
        logging.getLogger("ddiloco").error("%s; exiting", e)  # (the format names the learner)
        if threading.current_thread() is not threading.main_thread():
            raise  # hosted (a Ray actor's thread): the host ends the life, not its process
        from ddiloco.cli import exit_service

        # the group cannot go on, and nothing is left to save: exit now, not through an
        # interpreter teardown that may wait on the broken group's threads
        exit_service(1)
        return 1  # (not reached)


def take_over(args: argparse.Namespace, setup: Any) -> bool:
    """A warm spare: build what every slot shares (the model, the shards), say so, then wait
    for the launcher's one line naming the slot to take over; False at end of input. The
    spare then starts as that slot's restart (``--join``: it copies a peer)."""
    import json
    import os
    import sys

    import torch

    if setup is not None:  # (an own loop reads its own data)
        setup.splits  # noqa: B018  (read now, not after the slot is named)
    torch.optim.AdamW([torch.zeros(1, requires_grad=True)])  # its first one imports dynamo: 2 s
    Events(args.t0 if args.t0 is not None else time.time())("spare_ready", pid=os.getpid())
    line = sys.stdin.readline()
    if not line.strip():
        return False
    order = json.loads(line)
    args.id, args.join = int(order["id"]), True
    args.state_dir = order.get("state_dir") or args.state_dir
    args.peer_port = int(order.get("peer_port", 0))
    if order.get("gpus"):  # before anything touches CUDA (its first use reads it)
        os.environ["CUDA_VISIBLE_DEVICES"] = str(order["gpus"])
    for handler in logging.getLogger().handlers:
        handler.setFormatter(Who(args.id))
    return True


NAMED = re.compile(r"learner \d+\b")  # a message that names its learner itself


class Who(logging.Formatter):
    """``TIME learner M message``, where a message that names its learner itself ("learner
    3: ...", as the link's and the peer copy's do) is not prefixed twice."""

    def __init__(self, who: object) -> None:
        super().__init__("%(asctime)s %(message)s")
        self.who = who

    def formatMessage(self, record: logging.LogRecord) -> str:
        said = record.message
        who = "" if NAMED.match(said) else f"learner {self.who} "
        return f"{record.asctime} {who}{said}"
