"""A learner's life around any training loop: the one engine every learner runs.

Owns the order of things in a learner's life on the wall clock: recover (from a healthy
peer's snapshot, else from the syncer's global fragments), register, wait for the syncer's
first welcome (a learner never trains before its syncer is up), then, after each inner step
the caller took, the core's ``LearnerSync.stepped``, a progress report handed to the link
thread, and the core's step boundary (:class:`~ddiloco.core.boundary.StepBoundary`: the
answers to send — the link thread encodes and sends them — then the merged fragments that
arrived), and a snapshot if a newcomer asked for one. Nothing waits on a socket. A
lock-step method's learner (``waits_for_merge``) then waits, polling the boundary again,
until the merged fragments it must have arrived; while it waits it reports progress (no
new tokens) every :data:`KEEPALIVE_SECONDS`. Every learner waits the same way at the run's
end, once a final ask has come: it only answers the syncer's final rounds (so the global
model gets what it trained since its last answers) until the stop.

The training itself is the caller's: a :class:`Replica` (the model, its inner optimizer and
whatever else a newcomer must copy). The built-in loop (:mod:`.process`, ddiloco's Trainer)
and a user's own loop (:mod:`ddiloco.runtime.processes.learner.own_loop`, the public
``ddiloco.Learner``) are its two users: one code path.

Call order (one learner, every rank): :meth:`LearnerEngine.start` once (False: the run
ended before a syncer let us in; the engine is closed), then :meth:`LearnerEngine.step`
after every inner step until it returns False, then :meth:`LearnerEngine.finish` (the
goodbye and the last save; skipped when the loop failed), then :meth:`LearnerEngine.close`
(always). Under torchrun only rank 0 has the link and the snapshot server; at each boundary
rank 0's decisions (stop, fragments to apply) reach every rank (:mod:`.ranks`). A sharded
replica's engine is :mod:`.sharded_engine`'s subclass (every rank serves its rows).
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ddiloco.core.boundary import StepBoundary
from ddiloco.core.learner_state import LearnerSync
from ddiloco.core.plans import FragmentPlan
from ddiloco.errors import ConfigError
from ddiloco.runtime.processes import protocol
from ddiloco.runtime.processes.learner.link import SyncerLink
from ddiloco.runtime.processes.learner.local_checkpoint import (
    LocalCheckpoints,
    identity,
    load_latest,
)
from ddiloco.runtime.processes.learner.options import LearnerOptions
from ddiloco.runtime.processes.learner.peer import SnapshotServer
from ddiloco.runtime.processes.learner.peer_copy import Copied, copy_from_peers
from ddiloco.runtime.processes.learner.ranks import Apply, RankGroup
from ddiloco.runtime.processes.protocol import MAX_LOSS
from ddiloco.runtime.processes.state_file import state_key
from ddiloco.runtime.processes.transport.events import Events
from ddiloco.runtime.processes.transport.shm import writer_for
from ddiloco.runtime.processes.transport.sockets import new_session
from ddiloco.runtime.processes.transport.tree import pack_tree, unpack_tree
from ddiloco.runtime.processes.transport.wire import Limits, Wire
from ddiloco.runtime.run import RunSetup

log = logging.getLogger(__name__)

KEEPALIVE_SECONDS = 1.0  # a waiting learner's progress reports, so it is not taken for dead
WAIT_POLL_SECONDS = 0.002
WAIT_WARN_SECONDS = 30.0  # a wait this long is said on the terminal (then every 30 s)


class Replica(Protocol):
    """What the engine trains around: ddiloco's Trainer, or a user's model and optimizer
    (own_loop.py). ``state`` is everything a newcomer copies (``model``, ``optimizer``,
    ``steps``, ``position``); ``copy=False`` hands the live tensors to a caller done with
    them before the next step."""

    model: nn.Module
    steps: int

    def params(self) -> dict[str, torch.Tensor]: ...

    def state(self, copy: bool = True) -> dict[str, Any]: ...

    def load_state(self, state: dict[str, Any]) -> None: ...

    def state_bytes(self) -> int: ...


def snapshot_refusal(tree: Any, versions: list[int] | None, fragments: int) -> str | None:
    """Why a peer's snapshot cannot be taken, or None: it must hold one version per
    fragment, none later than the syncer's ``versions`` (no honest peer is ahead of the
    syncer: a merge is durable before it is broadcast). Taken, a later one made a learner
    whose every answer was refused as invalid, training forever without a merge."""
    try:
        held = [int(v) for v in tree["sync"]["versions"]]
    except (KeyError, TypeError, ValueError):
        return "its snapshot holds no fragment versions"
    if len(held) != fragments:
        return f"its snapshot holds {len(held)} fragment versions; the plan has {fragments}"
    if versions is not None and len(versions) == fragments:
        for p, (have, most) in enumerate(zip(held, versions, strict=True)):
            if have > most:
                return (
                    f"its snapshot holds fragment {p} at version {have}, later than the "
                    f"syncer's {most} (a lying or foreign peer)"
                )
    return None


class LearnerEngine:
    """A learner slot's sync state, link, snapshot server and saves, around a replica
    (whole parameters on every rank; learner/sharded_engine.py: a sharded replica's)."""

    sharded = False  # each rank holds its rows only (ShardedEngine)

    def __init__(
        self,
        setup: RunSetup,
        learner: int,
        syncer: str,
        run_id: str,
        secret: bytes,
        events: Events,
        replica: Replica,
        ranks: RankGroup,
        leaving: threading.Event,
        options: LearnerOptions | None = None,
    ) -> None:
        options = options or LearnerOptions()
        config = setup.config
        self.setup = setup
        self.m = learner
        self.replica = replica
        self.ranks = ranks
        self.leaving = leaving  # SIGTERM: a clean leave (a rank's too: ranks.py)
        if not ranks.leader:  # only rank 0 speaks for the learner
            events = Events(events.t0, open(os.devnull, "w"))  # noqa: SIM115
        self.events = events
        self.join = options.join
        self.resume = options.resume
        self.leave_after = options.leave_after
        self.max_steps = options.max_steps
        self.run_id = run_id
        self.secret = secret
        # one life, one number on every rank: a sharded learner's ranks key their parts of
        # an answer by it (core/parts.py)
        self.incarnation = ranks.all_ints([new_session()])[0][0]
        sync = setup.method.sync
        self.sync = LearnerSync(
            learner,
            self.rank_plan(),
            self.params(),
            incarnation=self.incarnation,
            apply=sync.apply,
            blend=sync.blend,
        )
        self.boundary = StepBoundary(
            self.sync, overlap=sync.rounds.overlap, waits_for_merge=setup.method.waits_for_merge
        )
        self.shapes = setup.plan.shapes()  # full fragments: what the syncer sends
        limits = Limits(max_payload=max(64 << 20, 4 * setup.plan.total_bytes))
        shm = writer_for(
            run_id,
            f"L{learner}",
            self.incarnation,
            syncer.rpartition(":")[0],
            config.processes.shared_memory,
        )
        wire = Wire(run_id, secret, f"L{learner}", self.incarnation, limits, shm=shm)
        self.link = SyncerLink(
            syncer,
            wire,
            learner,
            sync.codec.answers_spec(),
            self.shapes,
            silence_seconds=config.processes.detect_seconds,  # as long as the syncer waits
            beat_seconds=min(1.0, config.processes.detect_seconds / 4),
            give_up_seconds=config.processes.give_up_seconds,
        )
        # a DDP learner's other ranks' servers never start (a free port each); each rank of a
        # sharded learner serves its own rows (rank r on peer_port + r when one is fixed)
        serves = ranks.leader or self.sharded
        self.server = SnapshotServer(
            options.peer_bind or options.peer_host,
            run_id,
            secret,
            learner,
            port=options.peer_port + ranks.rank if options.peer_port and serves else 0,
            advertise_host=options.peer_host,
        )
        self.serving = [self.server.address]  # every rank's server (filled by start)
        self.started = time.monotonic()
        self.rank_bytes: list[int] = []  # a sharded learner's bytes sent, rank by rank
        self.rank_bytes_received: list[int] = []  # ... and received
        self.step_ended = time.perf_counter()  # the last boundary's end: a step's start
        self.rebased: list[int] = []
        self.tokens = 0
        self.bytes_peer = 0
        self.idle_seconds = 0.0  # lock-step: time spent waiting for merged fragments
        self.last_seconds = 0.0  # the last step's duration
        self.in_sync = False  # every rank agreed on the parameters at the end
        state_dir = options.state_dir
        every = config.processes.learner_checkpoint_every if state_dir is not None else 0.0
        self.saves = LocalCheckpoints(
            state_dir or Path("."),
            every if ranks.leader else 0.0,
            identity(setup, learner),
            key=state_key(secret),  # a save is bound to its run
        )

    def status(self) -> protocol.Hello:
        peer = " ".join(self.serving)  # a sharded learner's: one address per rank
        return protocol.Hello(self.incarnation, self.sync.step, list(self.sync.versions), peer)

    def rank_plan(self) -> FragmentPlan:
        """The fragment plan over what this rank holds (the whole plan: every parameter)."""
        return self.setup.plan

    def params(self) -> dict[str, torch.Tensor]:
        """The replica's parameters as this rank holds them: a sharded one's local rows
        (views: writes land in the shard)."""
        return {
            n: p.to_local() if isinstance(p, DTensor) else p
            for n, p in self.replica.params().items()
        }

    # -- life -------------------------------------------------------------------------------
    def start(self) -> bool:
        """Recover or register, and wait for the syncer's first welcome; False when the run
        ended (or we were asked to leave) before a syncer let us in: the engine is closed."""
        copied = self.join or self.resume  # rank 0 starts from a state the others copy
        unwelcomed = False  # asked to leave before any syncer let us in
        if self.ranks.leader:
            self.link.start()
            self.server.start()
            if self.resume and self.resume_local():
                pass
            elif copied:
                self.recover()
            else:
                self.link.register(self.status())
            # the first step waits for the syncer's first welcome: a learner up before its
            # syncer would otherwise train alone and report it all at once, spending the
            # token budget before a single merge (the link gives up loudly after
            # processes.give_up_seconds; the loop then stops at its first boundary)
            unwelcomed = not self.await_welcome()
            if not unwelcomed and not copied and self.late():
                self.recover(kind="caught_up")
                copied = True
        if self.ranks.active:  # rank 0's start on every rank: 0 fresh, 1 copied, 2 leave now
            start = bytes([2 if unwelcomed else int(copied)])
            flag = self.ranks.share_bytes(start if self.ranks.leader else None)
            unwelcomed, copied = flag == b"\x02", flag == b"\x01"
        if unwelcomed:
            self.leave_unwelcomed()
            return False
        if self.ranks.active and copied:  # every rank starts from what rank 0 recovered
            blob = self.ranks.share_bytes(self.snapshot() if self.ranks.leader else None)
            if not self.ranks.leader:
                self.load(blob, exact=True)
        self.up()
        return True

    def up(self) -> None:
        """Started: the step clock runs from here, and ``learner_up`` says so."""
        self.started = time.monotonic()
        self.step_ended = time.perf_counter()
        self.events(
            "learner_up",
            learner=self.m,
            incarnation=self.incarnation,
            peer=self.status().peer or None,
            ranks=self.ranks.world,
            sharded=self.sharded,
        )

    def finish(self, why: str | None = None) -> None:
        """After the loop's last step: check every rank holds the same parameters, say
        goodbye when leaving on our own (``why``, else :meth:`leaving_why`), save last."""
        # every rank checks before rank 0 says goodbye and saves: the others would wait for
        # that in a collective, and a wait after SIGTERM is taken as a failed group
        self.in_sync = self.ranks_agree()
        if self.ranks.leader and self.link.fatal is not None:
            raise ConfigError("syncer", self.link.address, self.link.fatal)
        if self.ranks.leader and not self.link.stopped:  # leaving on our own
            self.link.bye(why or self.leaving_why())
            self.events("leave", learner=self.m)
        if self.saves.every > 0:  # a stopped run resumes from where it stopped
            self.saves.save(self.sync.step, self.snapshot_state(copy=False))

    def close(self) -> None:
        """Say what this life did (``learner_done``) and close the link, server and ranks."""
        self.saves.close()
        self.events(
            "learner_done",
            learner=self.m,
            step=self.sync.step,
            tokens=self.tokens,
            bytes_sent=self.link.bytes_sent,
            bytes_received=self.link.bytes_received,
            bytes_peer=self.bytes_peer,
            reconnects=self.link.reconnects,
            longest_link_gap=round(self.link.longest_gap, 3),
            idle_seconds=round(self.idle_seconds, 4),
            refused=dict(self.link.wire.refused),
            snapshots_served=self.server.served,
            snapshot_refused=dict(self.server.refused),
            snapshot_gatekeeper=dict(self.server.gate.counts),
            ranks=self.ranks.world,
            ranks_in_sync=self.in_sync,
            rank_bytes_sent=self.rank_bytes or None,
            rank_bytes_received=self.rank_bytes_received or None,
        )
        if self.ranks.leader:
            self.link.close()
        if self.ranks.leader or self.sharded:
            self.server.close()
        self.ranks.close()

    def await_welcome(self) -> bool:
        """Wait for the first welcome (a link that gives up sets it too); False if told to
        stop or to leave first: the run ended, or was stopped, before a syncer let us in."""
        while not self.link.await_welcome(0.1):
            if self.leaving.is_set() or self.link.stopped:
                return False
        return True

    def leave_unwelcomed(self) -> None:
        """A clean exit for a learner that never trained: nothing to answer or to save."""
        log.warning("learner %d: told to stop or leave before a syncer let it in", self.m)
        if self.ranks.leader:
            self.link.close(flush_seconds=0.0)
        if self.ranks.leader or self.sharded:
            self.server.close()
        self.ranks.close()

    def late(self) -> bool:
        """A first start welcomed into a run already a sync period (H steps) ahead: this
        learner was slow to start. It then joins as a newcomer does (a peer's state, else the
        global step) instead of starting at step 0: a fresh optimizer at the schedule's peak,
        merged into a model trained past it, can undo the training (eval loss 3.7 -> 10 in 2
        of 8 runs of the run-directory test's config with outer Nesterov momentum)."""
        welcome = self.link.welcome
        return welcome is not None and welcome.global_step >= self.sync.plan.sync_every

    def leaving_why(self) -> str:
        """Why this learner leaves on its own (its goodbye says it; the syncer logs it)."""
        if self.leaving.is_set():
            return "SIGTERM"
        if self.link.asked_to_leave:
            return "asked to leave by an operator"
        if self.max_steps and self.sync.step >= self.max_steps:
            return f"its step limit ({self.max_steps})"
        if self.leave_after and time.monotonic() - self.started >= self.leave_after:
            return "its time limit"
        return "its training loop ended"

    def should_stop(self) -> bool:
        """Rank 0's call: the syncer said stop, we were asked to leave (SIGTERM, or an
        operator through the syncer), or our time is up."""
        if self.link.stopped or self.link.fatal is not None:
            return True
        if self.leaving.is_set() or self.link.asked_to_leave:
            return True
        if self.leave_after and time.monotonic() - self.started >= self.leave_after:
            return True
        return bool(self.max_steps and self.sync.step >= self.max_steps)

    def step(self, tokens: int, loss: float | None = None, seconds: float | None = None) -> bool:
        """After one inner step of ``tokens`` (this rank's) and ``loss``, taking ``seconds``
        (default: since the last boundary ended): report it and pass the boundary; False
        when the learner stops here."""
        self.last_seconds = time.perf_counter() - self.step_ended if seconds is None else seconds
        tokens *= self.ranks.world  # the learner's batch is every rank's
        self.sync.stepped(tokens)
        self.tokens += tokens
        self.report(tokens, loss)
        self.events("step", learner=self.m, step=self.sync.step, loss=loss, batch_tokens=tokens)
        stop, wait = self.at_boundary(step_end=True)
        if wait and not stop:
            stop = self.wait_for_merge()
        if self.save_due() and not stop:
            self.saves.save(self.sync.step, self.snapshot_state(copy=False))
        self.step_ended = time.perf_counter()
        return not stop

    def save_due(self) -> bool:
        """Whether a local checkpoint is due now (every rank that saves decides the same)."""
        return self.saves.due()

    def report(self, tokens: int, loss: float | None = None) -> None:
        """A progress report (rank 0): the step, its tokens and loss, the fragments rebased
        since."""
        if self.ranks.leader:
            finite = loss is not None and math.isfinite(loss) and 0.0 <= loss <= MAX_LOSS
            self.link.progress(
                protocol.Progress(
                    self.incarnation,
                    self.sync.step,
                    tokens,
                    self.last_seconds,
                    self.rebased,
                    loss=float(loss) if finite and loss is not None else None,
                )
            )
        self.rebased = []

    def at_boundary(self, step_end: bool) -> tuple[bool, bool]:
        """Between two steps (rank 0 decides, every rank follows): the core's boundary —
        answers, then the merged fragments that arrived —, a snapshot if one is wanted;
        returns (stop, wait for a merged fragment)."""
        params = self.replica.params()
        applies: list[Apply] = []
        answered: list[int] = []
        stop = wait = False
        if self.ranks.leader:
            asks = self.link.take_asks()
            final = self.link.finishing  # (set before a final ask is handed over)
            for answer in self.boundary.answers(asks, params, step_end, final):
                self.link.push(answer)
                answered.append(answer.meta.fragment)
            inbox = self.link.take_inbox()
            applies = [(p, v, vals) for p, (v, vals) in sorted(inbox.items())]
            self.rebased.extend(self.boundary.apply(inbox, params))
            # the syncer's final rounds: no more steps, only answers, until the stop
            wait = self.boundary.must_wait() or self.link.finishing
            stop = self.should_stop()
        stop, wait, applies, answered = self.ranks.share_boundary(
            stop, wait, applies, self.shapes, answered
        )
        if not self.ranks.leader:  # rank 0's snapshots (carry), then its merged fragments
            for p in answered:
                self.sync.snapshot(p, params)
            for p, version, values in applies:
                self.sync.apply(p, version, values, params)
        if self.ranks.leader:
            if self.server.wanted:  # cloned tensors, served as they are (no blob)
                self.server.provide(self.snapshot_state(peer=True))
            self.link.status = self.status()
        return stop, wait

    def wait_for_merge(self) -> bool:
        """Lock-step: poll the boundary until it lets the next step start; returns stop.
        Rebases and a keepalive reach the syncer before the answers that follow them."""
        started = last_report = time.monotonic()
        warn_at = started + WAIT_WARN_SECONDS
        stop, wait = False, True
        while wait and not stop:
            time.sleep(WAIT_POLL_SECONDS)
            now = time.monotonic()
            if self.rebased or now - last_report >= KEEPALIVE_SECONDS:
                self.report(0)
                last_report = now
            if now >= warn_at and self.ranks.leader and not self.link.finishing:
                log.warning(
                    "learner %d: waiting %.0fs for merged fragments %s (lock-step: a "
                    "merge waits for every learner)",
                    self.m,
                    now - started,
                    sorted(self.boundary.sent),
                )
                warn_at = now + WAIT_WARN_SECONDS
            stop, wait = self.at_boundary(step_end=False)
        self.idle_seconds += time.monotonic() - started
        return stop

    def ranks_agree(self) -> bool:
        """Whether every rank holds the same parameters (a collective: every rank calls)."""
        return self.ranks.agree(self.checksum())

    def checksum(self) -> float:
        with torch.no_grad():
            return float(sum(p.double().sum() for p in self.replica.params().values()))

    def load(self, blob: bytes, exact: bool = False) -> None:
        """Adopt a snapshot: a peer's (recovery), or rank 0's (the other ranks: ``exact``)."""
        self.adopt(unpack_tree(blob), exact)

    def adopt(self, state: dict[str, Any], exact: bool = False) -> None:
        """Take over a state: a peer's snapshot or our own local checkpoint as a newcomer
        (what was trained since its bases stays unpushed: core/learner_state.py), or rank
        0's as an exact copy of it (``exact``)."""
        self.replica.load_state(state["trainer"])
        if exact:
            self.sync.load_state(state["sync"])
        else:
            self.sync.load_peer_state(state["sync"], self.params())
        self.sync.incarnation = self.incarnation

    def snapshot_state(self, peer: bool = False, copy: bool = True) -> dict[str, Any]:
        """Everything a newcomer copies (docs/design.md §5.1); taken between two steps.
        ``peer``: without the bases, which a newcomer replaces by the values it copied
        (LearnerSync.load_peer_state): a quarter of the bytes, sent for nothing. ``copy=False``:
        the live tensors, for a caller done with them before the next step (a local save
        streamed to disk: no second copy of the state in memory)."""
        sync = self.sync.state_dict(copy=copy and not peer)
        if peer:
            del sync["bases"]
        return {"trainer": self.replica.state(copy=copy), "sync": sync, "learner": self.m}

    def snapshot(self) -> bytes:
        return pack_tree(self.snapshot_state(copy=False))  # pack_tree copies

    # -- recovery ---------------------------------------------------------------------------
    def resume_local(self) -> bool:
        """A resumed run: start from our newest local checkpoint (weights, inner optimizer,
        step, data position, base versions) and register with it; the syncer sends the
        fragments merged since. False when there is none (then a peer, else the syncer)."""
        state = load_latest(self.saves.directory, self.saves.identity, self.saves.key)
        if state is None:
            return False
        self.adopt(state)
        self.link.register(self.status())
        self.events(
            "recovered",
            learner=self.m,
            peer=None,
            source="local",
            step=self.sync.step,
            position=state["trainer"].get("position"),
        )
        return True

    def recover(self, kind: str = "recovered") -> None:
        """Copy a healthy peer (nobody pauses), else start from the syncer's fragments;
        ``kind``: the event that says so (``caught_up``: a late first start)."""
        peers = self.link.request_peers(timeout=30.0)  # the furthest trained first
        whole = {pid: where for pid, where in peers.addresses.items() if " " not in where}
        # no deadline for the whole copy (16 GB at 1B parameters), only for a stall; a
        # snapshot far larger than ours (params, two moments, bases) is refused unallocated
        limit = 2 * (self.replica.state_bytes() + self.sync.plan.total_bytes) + (64 << 20)
        fragments = self.sync.plan.num_fragments

        def refuse(copied: Copied) -> str | None:
            # the syncer's versions now, after the copy: the donor's snapshot may hold merges
            # made since the first ask, never one the syncer has not made yet
            now = self.link.request_peers(timeout=10.0).versions
            return snapshot_refusal(copied.tree, now, fragments)

        copied = copy_from_peers(  # (a sharded peer's rows are no whole state: not asked)
            whole, self.run_id, self.secret, self.m, max_bytes=limit, refuse=refuse
        )
        if copied is not None:
            pid, copy = copied
            self.adopt(copy.tree)
            self.bytes_peer += copy.nbytes
            self.link.register(self.status())
            self.events(kind, learner=self.m, peer=int(pid), bytes=copy.nbytes, step=self.sync.step)
            return
        self.recover_from_syncer(kind)  # nobody to copy

    def recover_from_syncer(self, kind: str) -> None:
        """The syncer's global fragments, fresh inner state, the global step."""
        self.link.register(self.status())
        self.link.await_welcome()  # a welcome, or the link gives up (it then says why)
        if self.link.fatal is not None:
            return
        welcome = self.link.welcome or protocol.Welcome(0, [])
        step = welcome.global_step
        self.sync.step = step
        self.replica.steps = step
        wanted = {p for p, v in enumerate(welcome.versions) if v > 0}
        deadline = time.monotonic() + 30.0
        got: dict[int, tuple[int, list[Any]]] = {}
        while wanted and time.monotonic() < deadline:
            for p, (version, values) in self.link.take_inbox().items():
                if version > got.get(p, (0, []))[0]:
                    got[p] = (version, values)
                    wanted.discard(p)
            time.sleep(0.01)
        self.take_fragments([(p, v, vals) for p, (v, vals) in sorted(got.items())])
        self.link.register(self.status())  # at the global step now: counted from there
        self.events(kind, learner=self.m, peer=None, source="syncer", step=step)

    def take_fragments(self, applies: list[Apply]) -> None:
        """Apply the syncer's global fragments a recovery received."""
        params = self.replica.params()
        for p, version, values in applies:
            self.sync.apply(p, version, values, params)
