"""A learner's rank group (learner/ranks.py) over real gloo, two spawned processes on
loopback: what rank 0 decides reaches every rank, whatever the others passed (a sharded
learner's rank 1 once kept its own "fresh start" while rank 0 caught up from a peer, and
trained alone into a collective rank 0 never joined)."""

from __future__ import annotations

import multiprocessing as mp
import os
import socket


def _rank(rank: int, port: int, out: mp.Queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2",
                      RANK=str(rank), LOCAL_RANK=str(rank))  # fmt: skip
    import torch

    torch.set_num_threads(1)
    from ddiloco.runtime.processes.learner.ranks import RankGroup

    group = RankGroup()
    try:
        mine = bytes([rank + 1]) * (3 + rank)  # each rank its own bytes, its own length
        out.put((rank, group.share_bytes(mine), group.share_bytes(b"late" if rank == 0 else None)))
    finally:
        group.close()


def test_every_rank_gets_rank_0s_bytes_whatever_it_passed():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, port, out)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        got = dict((r, rest) for r, *rest in (out.get(timeout=60) for _ in procs))
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    assert got[0] == got[1] == [b"\x01\x01\x01", b"late"]
