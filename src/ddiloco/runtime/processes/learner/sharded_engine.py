"""A sharded (FSDP) learner's life: the engine, on rows instead of whole parameters.

Every rank of a learner whose parameters are DTensors (``train.parallel = "fsdp"``, or a
user's own loop under ``fully_shard``) runs the core's learner state and step boundary on
its own rows of each fragment (core/shards.py's local plan). At each boundary rank 0's asks
reach every rank and every rank sends its rows of each answer itself, rank r on its own link
(:mod:`.part_link`; rank 0's part carries the answer's metadata on the learner's link): the
syncer puts the parts together, all or nothing (core/parts.py), and to it the learner is one
learner. Of each merged fragment every rank receives only its rows, on its own link
(syncer/broadcast.py); at each boundary the ranks say which version of each fragment they
hold and apply the ones all hold (:func:`agreed`), so every rank's rows move to the same
version at the same step. Every rank serves its own rows to newcomers and saves its own
local checkpoint (one file per rank, all at the same step); a newcomer's rank r copies rank
r of one peer (learner/sharded.py). :func:`engine_for` picks this engine or the
whole-parameter one by the replica's parameters.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from ddiloco.core.plans import FragmentPlan
from ddiloco.core.shards import local_plan
from ddiloco.errors import ConfigError
from ddiloco.runtime.processes import protocol
from ddiloco.runtime.processes.learner.engine import LearnerEngine, Replica, snapshot_refusal
from ddiloco.runtime.processes.learner.local_checkpoint import (
    LEARNER_STATE,
    LocalCheckpoints,
    identity,
    load_save,
)
from ddiloco.runtime.processes.learner.options import LearnerOptions
from ddiloco.runtime.processes.learner.part_link import PartLink
from ddiloco.runtime.processes.learner.peer_copy import Copied
from ddiloco.runtime.processes.learner.ranks import Apply, RankGroup
from ddiloco.runtime.processes.learner.sharded import (
    copy_shards,
    global_tree,
    local_tree,
    rows_refusal,
)
from ddiloco.runtime.processes.state_file import state_key
from ddiloco.runtime.processes.transport.auth import link_name
from ddiloco.runtime.processes.transport.events import Events
from ddiloco.runtime.processes.transport.wire import Wire
from ddiloco.runtime.run import RunSetup

log = logging.getLogger(__name__)

KEPT_SAVES = 2  # each rank's newest saves compared on resume (state_file keeps two)


def engine_for(
    setup: RunSetup,
    learner: int,
    syncer: str,
    run_id: str,
    secret: bytes,
    events: Events,
    replica: Replica,
    ranks: RankGroup,
    leaving: threading.Event,
    options: LearnerOptions,
) -> LearnerEngine:
    """The engine for ``replica``: :class:`ShardedEngine` when its parameters are sharded
    over the learner's ranks (DTensors), else :class:`LearnerEngine`."""
    sharded = ranks.active and any(isinstance(p, DTensor) for p in replica.params().values())
    kind = ShardedEngine if sharded else LearnerEngine
    return kind(setup, learner, syncer, run_id, secret, events, replica, ranks, leaving, options)


class ShardedEngine(LearnerEngine):
    """A learner slot's engine for a sharded replica: each rank on its rows (see above)."""

    sharded = True

    def __init__(self, setup: RunSetup, *args: Any) -> None:
        super().__init__(setup, *args)
        world, rank = self.ranks.world, self.ranks.rank
        self.shapes = local_plan(setup.plan, world, rank).shapes()  # what the syncer sends us
        self.link.inbox.shapes = self.shapes  # (rank 0's rows, on the learner's link)
        self.held: dict[int, tuple[int, list[torch.Tensor]]] = {}  # p -> newest rows received
        self.due = False  # rank 0 says when a local checkpoint is due: every rank saves then
        self.parts: PartLink | None = None  # ranks >= 1: the link its answer parts go on
        self.parts_failed: list[int] = []  # ranks whose part link failed (the learner stops)
        if not self.ranks.leader:
            main = self.link.wire  # (rank 0's link, never started here: its settings)
            wire = Wire(main.run, main.secret, link_name(self.m, rank), self.incarnation,
                        main.limits)  # fmt: skip
            self.parts = PartLink(self.link.address, wire, self.m, rank, world, self.link.codec,
                                  self.shapes, beat_seconds=self.link.beat)  # fmt: skip
        if self.saves.directory != Path("."):  # one save per rank, all at the same steps
            state_dir = self.saves.directory
            every = setup.config.processes.learner_checkpoint_every
            self.saves = LocalCheckpoints(
                state_dir / f"rank-{rank}",
                every,
                {**identity(setup, self.m), "rank": rank, "ranks": world},
                key=state_key(self.secret),
            )

    def rank_plan(self) -> FragmentPlan:
        return local_plan(self.setup.plan, self.ranks.world, self.ranks.rank)

    def status(self) -> protocol.Hello:
        return replace(super().status(), ranks=self.ranks.world)  # (each rank its rows)

    # -- life -------------------------------------------------------------------------------
    def start(self) -> bool:
        """Every rank serves its rows; a resumed learner starts from its ranks' local saves,
        a newcomer copies its rows of a peer (:meth:`recover`); then the first welcome."""
        if self.ranks.leader:
            self.link.start()
        if self.parts is not None:
            self.parts.start()
        self.server.start()
        self.serving = self.ranks.all_texts(self.server.address)
        copied = True
        if self.resume and self.resume_local():
            pass
        elif self.join or self.resume:
            self.recover()
        else:
            copied = False
            if self.ranks.leader:
                self.link.register(self.status())
        unwelcomed = self.ranks.leader and not self.await_welcome()
        late = self.ranks.leader and not unwelcomed and not copied and self.late()
        # rank 0's start on every rank: 0 fresh, 1 late (catch up from a peer), 2 leave now
        flag = self.ranks.share_bytes(bytes([2 if unwelcomed else int(late)]))
        if flag == b"\x02":
            self.leave_unwelcomed()
            return False
        if flag == b"\x01":
            self.recover(kind="caught_up")
        self.applied()  # (a fresh start's versions: each rank link says them now)
        self.up()
        return True

    def finish(self, why: str | None = None) -> None:
        """As the engine's, with each rank's bytes sent to the syncer (``learner_done``'s
        ``rank_bytes_sent``, and received), and the learner failing when a rank's part link did."""
        link = self.link if self.parts is None else self.parts
        rows = self.ranks.all_ints([link.bytes_sent, link.bytes_received])
        self.rank_bytes = [row[0] for row in rows]
        self.rank_bytes_received = [row[1] for row in rows]
        super().finish(why)
        if self.parts_failed:
            raise ConfigError(
                "syncer",
                self.link.address,
                f"the link of rank(s) {self.parts_failed} of learner {self.m} failed (its log "
                "says why): this learner's answers could not be put together",
            )

    def close(self) -> None:
        super().close()
        if self.parts is not None:
            self.parts.close()

    def save_due(self) -> bool:
        return self.due

    def ranks_agree(self) -> bool:
        """Ranks hold different rows: they agree when all stand at the same step and
        fragment versions (every merge reached every rank)."""
        rows = self.ranks.all_ints([self.sync.step, *self.sync.versions])
        return all(row == rows[0] for row in rows)

    def at_boundary(self, step_end: bool) -> tuple[bool, bool]:
        """Rank 0's asks reach every rank, each answers its rows, rank 0 puts the answers
        together and sends them; the merged fragments reach every rank, each applies its
        rows. Every rank runs the same core boundary on the same inputs, so their decisions
        (what to answer, whether to wait) are the same."""
        params = self.params()
        asks: dict[int, int] = {}
        final = stop = False
        if self.ranks.leader:
            final = self.link.finishing  # (set before a final ask is handed over)
            asks = self.link.take_asks()
            stop = self.should_stop()
        asks, final = self.ranks.share_asks(asks, final, len(self.shapes))
        for answer in self.boundary.answers(asks, params, step_end, final):
            if self.parts is None:  # rank 0: with the answer's metadata
                self.link.push(answer, ranks=self.ranks.world)
            else:
                self.parts.push(answer)
        # with the versions every rank holds, in the same all-gather: a snapshot if any
        # rank's server was asked (every rank's rows at this one boundary, after the apply),
        # a local save when rank 0's is due, a stop when a rank's part link failed
        failed = self.parts is not None and self.parts.fatal is not None
        wanted = [int(self.server.wanted), int(self.saves.due()), int(failed)]
        stop, rows, flags = self.agree(stop, wanted)
        rebased = self.boundary.apply({p: (v, mine) for p, v, mine in rows}, params)
        self.applied()
        self.due = bool(flags[0][1])
        broken = [r for r, row in enumerate(flags) if row[2]]
        if broken:
            self.parts_failed = broken
            stop = True
        if any(row[0] for row in flags):
            self.server.provide(self.snapshot_state(peer=True))
        if self.ranks.leader:
            self.rebased.extend(rebased)
            self.link.status = self.status()
        return stop, self.boundary.must_wait() or final

    def snapshot_state(self, peer: bool = False, copy: bool = True) -> dict[str, Any]:
        """This rank's rows of the state, as plain tensors (cloned to host memory if
        ``copy``; else the live local tensors, for a save streamed to disk)."""
        return local_tree(super().snapshot_state(peer=peer, copy=False), copy=copy)  # type: ignore[no-any-return]

    # -- recovery ---------------------------------------------------------------------------
    def adopt(self, state: dict[str, Any], exact: bool = False) -> None:
        """A state of this rank's rows (a peer's rank, our own save), its tensors placed as
        this rank's own parameters and moments are."""
        optimizer = getattr(self.replica, "optimizer", None)
        trainer = global_tree(state["trainer"], self.replica.model, optimizer)
        super().adopt({**state, "trainer": trainer}, exact)
        self.applied()  # (rows no newer than the adopted versions are of no use)

    def resume_local(self) -> bool:
        """Every rank: the newest step every rank has a local save of (a rank killed
        mid-save may lack the newest); False when they share none."""
        held = [step for step, _ in LEARNER_STATE.saves(self.saves.directory)][-KEPT_SAVES:]
        rows = self.ranks.all_ints([*held, *([-1] * (KEPT_SAVES - len(held)))])
        common = set.intersection(*(set(row) for row in rows)) - {-1}
        if not common:
            if self.ranks.leader and any(max(row) >= 0 for row in rows):
                log.warning(
                    "learner %d: its ranks' local saves share no step (%s): not resumed from "
                    "them", self.m, "; ".join(f"rank {r}: {row}" for r, row in enumerate(rows)),
                )  # fmt: skip
            return False
        step = max(common)
        path = LEARNER_STATE.path(self.saves.directory, step)
        state = load_save(path, self.saves.identity, self.saves.key)
        self.adopt(state)
        if self.ranks.leader:
            self.link.register(self.status())
            self.events("recovered", learner=self.m, peer=None, source="local",
                        step=self.sync.step, position=state["trainer"].get("position"),
                        ranks=self.ranks.world)  # fmt: skip
        return True

    def recover(self, kind: str = "recovered") -> None:
        """Every rank: copy rank r of a healthy peer of as many ranks, all ranks at once
        (learner/sharded.py), else start from the syncer's global fragments with a fresh
        optimizer, said in the log."""
        world, fragments = self.ranks.world, self.sync.plan.num_fragments
        donors: list[tuple[str, str]] = []
        if self.ranks.leader:
            peers = self.link.request_peers(timeout=30.0).addresses
            donors = [(pid, where) for pid, where in peers.items()
                      if len(where.split()) == world and pid != str(self.m)]  # fmt: skip
            if len(donors) < len(peers):
                log.warning(
                    "learner %d: %d peer(s) of another rank count cannot be copied shard to "
                    "shard", self.m, len(peers) - len(donors),
                )  # fmt: skip
        limit = 2 * (self.replica.state_bytes() // world + self.sync.plan.total_bytes) + (64 << 20)

        rows = {n: tuple(t.shape) for n, t in self.params().items()}

        def refuse(copied: Copied) -> str | None:  # rank 0 holds the syncer's versions
            now = self.link.request_peers(timeout=10.0).versions if self.ranks.leader else None
            return snapshot_refusal(copied.tree, now, fragments) or rows_refusal(copied.tree, rows)

        got = copy_shards(self.ranks, donors, fragments, self.run_id, self.secret, self.m,
                          max_bytes=limit, refuse=refuse)  # fmt: skip
        if got is not None:
            pid, copy, nbytes = got
            self.adopt(copy.tree)
            self.bytes_peer += copy.nbytes
            if self.ranks.leader:
                self.link.register(self.status())
                self.events(kind, learner=self.m, peer=int(pid), bytes=nbytes,
                            step=self.sync.step, ranks=world)  # fmt: skip
            return
        if self.ranks.leader:
            log.warning(
                "learner %d: no peer of %d ranks delivered its shards: starting from the "
                "syncer's global fragments with a fresh optimizer", self.m, world,
            )  # fmt: skip
            self.recover_from_syncer(kind)
        self.share_start_fragments()

    def take_fragments(self, applies: list[Apply]) -> None:
        """Rank 0's rows of the syncer's fragments: held until every rank holds its own
        (:meth:`share_start_fragments`)."""
        for p, version, values in applies:
            self.hold(p, version, values)

    def share_start_fragments(self, wait_seconds: float = 30.0) -> None:
        """Every rank takes the global step and the global fragments of rank 0's welcome:
        each waits for its rows on its own link (for at most ``wait_seconds``, rank 0's
        clock), then all apply the versions all hold, with their fresh optimizers. A
        fragment some rank lacks by then is applied at a later boundary, said in the log."""
        head = None
        if self.ranks.leader:
            welcome = self.link.welcome or protocol.Welcome(self.sync.step, [])
            head = json.dumps([self.sync.step, *welcome.versions]).encode()
        step, *wanted = json.loads(self.ranks.share_bytes(head))
        self.applied()  # each rank link says the versions we hold: the syncer sends the rest
        deadline = time.monotonic() + wait_seconds
        while True:
            self.take_inbox()
            mine = all(self.held.get(p, (0, []))[0] >= v for p, v in enumerate(wanted) if v > 0)
            rows = self.ranks.all_ints([int(mine), int(time.monotonic() > deadline)])
            if all(row[0] for row in rows) or rows[0][1]:
                break
            time.sleep(0.02)
        self.sync.step = self.replica.steps = int(step)
        _, applies, _ = self.agree(False)
        params = self.params()
        for p, version, mine_rows in applies:
            self.sync.apply(p, version, mine_rows, params)
        self.applied()
        short = [r for r, row in enumerate(rows) if not row[0]]
        if short and self.ranks.leader:
            log.warning(
                "learner %d: rank(s) %s did not receive their rows of the global fragments "
                "within %.0fs: those fragments are applied when every rank holds them",
                self.m, short, wait_seconds,
            )  # fmt: skip

    # -- merged fragments, rank by rank -----------------------------------------------------
    def hold(self, p: int, version: int, values: list[torch.Tensor]) -> None:
        if version > self.held.get(p, (-1, []))[0]:
            self.held[p] = (version, values)

    def take_inbox(self) -> None:
        """What this rank's link received (its rows of merged fragments), held."""
        inbox = (self.link if self.parts is None else self.parts).inbox.take()
        for p, (version, values) in inbox.items():
            self.hold(p, version, values)

    def agree(
        self, stop: bool, flags: Sequence[int] = ()
    ) -> tuple[bool, list[Apply], list[list[int]]]:
        """Rank 0's stop on every rank, the fragments to apply now: those every rank holds
        at the same version, and every rank's ``flags`` in rank order (one all-gather of
        each rank's stop, flags and held versions)."""
        self.take_inbox()
        mine = [self.held[p][0] if p in self.held else -1 for p in range(len(self.shapes))]
        n = len(flags)
        rows = self.ranks.all_ints([int(stop), *flags, *mine])
        held = [row[1 + n :] for row in rows]
        applies = [(p, v, self.held.pop(p)[1]) for p, v in agreed(held)]
        return bool(rows[0][0]), applies, [row[1 : 1 + n] for row in rows]

    def applied(self) -> None:
        """After an apply: rows of versions no newer than the applied ones are dropped, and
        this rank's link knows the versions (it says them to a new syncer life)."""
        for p in [p for p, (v, _) in self.held.items() if v <= self.sync.versions[p]]:
            del self.held[p]
        if self.parts is not None:
            self.parts.versions = list(self.sync.versions)


def agreed(held: Sequence[Sequence[int]]) -> list[tuple[int, int]]:
    """``(fragment, version)`` for each fragment every rank holds at the same version
    (``held``: each rank's held version per fragment, -1 for none). A rank behind (its
    rows still on the way) holds it back a boundary; a rank that missed a version holds it
    back until the next one reaches every rank (or the syncer resends it)."""
    if not held:
        return []
    return [
        (p, version)
        for p, version in enumerate(held[0])
        if version >= 0 and all(row[p] == version for row in held)
    ]
