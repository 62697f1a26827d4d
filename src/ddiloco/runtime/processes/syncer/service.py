"""The syncer as a service: a zmq ROUTER that drives the core's SyncerState on the wall clock.

Owns only the I/O around the core: decoding authenticated frames, feeding the core progress,
answers and ``now``, persisting every merge (:mod:`.store`) *before* broadcasting it, asking
learners, noticing dead ones (no message for ``detect_seconds``), restoring after a restart,
evaluating the global model (on a thread of its own: :mod:`.evaluator`), writing checkpoints
of it (every ``train.checkpoint_every`` tokens on a thread of its own, from a copy taken
between two merges, and after the last merge) and printing events for the launcher. Every
rule (rounds, quorum, grace, staleness, weights, RDA, outer step, ledger) is the core's. One
thread, one socket: nothing here waits on a learner.

Who may talk (docs/security.md) is :mod:`.connections`' concern: a message reaches a handler
here only when its signed sender is the learner its connection authenticated as, and it is
addressed to this syncer life. Its metadata is then parsed into its message class, every
field checked (:mod:`ddiloco.runtime.processes.protocol`, where every kind of both directions
is defined); a malformed message is refused, counted and logged (rate-limited), never an
exception out of the loop. Each handler ``on_<kind>(m, message, payload)`` takes the parsed
message (an answer's handlers are :class:`.answers.Answers`', which owns an answer's way from
the link to the core's verdict); a reply is ``self.send(m, protocol.<Kind>(...))``.

Call order, per message: connections checks it -> :meth:`SyncerService.handle` notes the
learner heard -> the handler feeds the core (a progress report is credited and counted in the
ledger before the core sees the step; an answer is counted in the ledger before the core
judges it). Per turn of the loop: :meth:`SyncerService.poll` takes the core's merges, books
each in the ledger, persists it, then broadcasts it (a merge is durable before any learner
sees it), then liveness, evaluations and checkpoints.

Learner -> syncer: hello, peers, progress, answer, inline (it cannot read our /dev/shm),
beat, bye. Syncer -> learner: welcome, peers, rehello (this syncer life's session; it does not
know this learner life: say hello again and re-push), ask (``final``: the run's end, stop
stepping and answer), fragment (a merged fragment, with the answer keys it merged), verdict
(an answer dropped), beat, no_shm (send inline), refused (this learner cannot take part: it
stops, saying why), stop, and an operator's kill or leave from the status page
(:mod:`.actions`). Progress is credited by a step budget (core/credit.py), never beyond what
the elapsed time allows.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from ddiloco.config import RunConfig
from ddiloco.core.credit import StepBudget
from ddiloco.core.ledger import CRASH, LEFT
from ddiloco.core.restart_ledger import RestartLedger
from ddiloco.core.rounds import Round
from ddiloco.core.syncer_state import MergeResult, SyncerState
from ddiloco.errors import ConfigError, DDiLoCoError
from ddiloco.runtime.processes import protocol
from ddiloco.runtime.processes.syncer.actions import ActionGate
from ddiloco.runtime.processes.syncer.answers import Answers
from ddiloco.runtime.processes.syncer.attendance import Attendance
from ddiloco.runtime.processes.syncer.broadcast import Broadcast
from ddiloco.runtime.processes.syncer.checkpoints import checkpoint_writer
from ddiloco.runtime.processes.syncer.claims import ahead_of_store
from ddiloco.runtime.processes.syncer.connections import Connections, Incoming
from ddiloco.runtime.processes.syncer.evaluator import Evaluator
from ddiloco.runtime.processes.syncer.final_rounds import FinalRounds
from ddiloco.runtime.processes.syncer.parts import AnswerParts
from ddiloco.runtime.processes.syncer.restore import restore_service
from ddiloco.runtime.processes.syncer.roster import Roster
from ddiloco.runtime.processes.syncer.status import StatusBoard, StatusServer, snapshot_of
from ddiloco.runtime.processes.syncer.store import (
    SyncerStore,
    fingerprint_of,
    journal_header,
    record_of,
)
from ddiloco.runtime.processes.syncer.summary import service_summary
from ddiloco.runtime.processes.syncer.totals import RunningTotals
from ddiloco.runtime.processes.syncer.view import view_of
from ddiloco.runtime.processes.transport.events import Events
from ddiloco.runtime.processes.transport.ratelog import Throttle
from ddiloco.runtime.processes.transport.tickets import TicketBook
from ddiloco.runtime.processes.transport.wire import Limits
from ddiloco.runtime.run import RunSetup

log = logging.getLogger(__name__)

Handler = Callable[[int, Any, memoryview], None]  # (learner, its protocol message, payload)

BEAT_SECONDS = 0.5  # liveness checks, ledger saves, the status page (beats: .connections)


class SyncerService:
    """One syncer process. ``run``: the run directory its checkpoints go into (default: the
    one its store is in); ``steps``: record each learner's reported steps and train losses
    as ``step`` records (a hand-started syncer writing a run directory: no launcher relays
    the learners' own); ``secret_file``: where the run secret came from (its ``syncer_up``
    record says so: the status page's buttons take it), None for the environment."""

    def __init__(
        self,
        setup: RunSetup,
        bind: str,
        run_id: str,
        secret: bytes,
        store_dir: Path,
        events: Events,
        *,
        journal: bool = False,
        detect_seconds: float = 5.0,
        stop: threading.Event | None = None,
        run: Path | None = None,
        steps: bool = False,
        secret_file: str | None = None,
    ) -> None:
        self.setup = setup
        self.config: RunConfig = setup.config
        self.events = events
        self.record_steps = steps
        self.announced = {"address": bind, "run_id": run_id, "secret_file": secret_file}
        sync = setup.method.sync
        self.plan = setup.plan
        self.ledger = RestartLedger(self.plan.num_fragments, carry=sync.apply == "carry")
        self.syncer = SyncerState(
            self.plan,
            setup.initial,
            sync.syncer_config(),
            plain_tensors=setup.plain,
            ledger=self.ledger,
            schedule=setup.outer_schedule(),
            share_initial=True,  # the global values live in the reference model's parameters
        )
        self.store = SyncerStore(
            store_dir,
            journal=journal,
            fingerprint=fingerprint_of(setup),
            fragments=self.plan.num_fragments,
        )
        records = self.store.load()
        start = restore_service(self.syncer, self.ledger, records, self.store.ledger_state)
        self.tokens, self.applied = start.tokens, start.applied
        if start.restored:
            events(
                "restored",
                versions=list(self.syncer.versions),
                global_step=start.step,
                tokens=self.tokens,
            )
        self.limits = Limits(max_payload=max(64 << 20, 4 * self.plan.total_bytes))
        shm = self.config.processes.shared_memory
        # the connection tickets admitted, kept in the store: a restarted syncer refuses a
        # handshake its earlier life admitted (a captured one, replayed)
        tickets = TicketBook(self.store.tickets_path)
        self.conn = Connections(
            bind,
            run_id,
            secret,
            setup.slots,
            self.limits,
            shm,
            clock=events.now,
            tickets=tickets,
            stuck_seconds=self.config.processes.stuck_seconds,
        )
        self.counts = self.conn.counts  # one tally of what was refused, dropped, re-sent
        # a sharded learner's answers, part by part, each from its rank's own link
        self.parts = AnswerParts(
            self.plan,
            2 * detect_seconds,
            lambda m, rank, msg: self.conn.send_part(m, rank, msg.KIND, meta=msg.meta()),
            self.counts,
        )
        # merged fragments to every learner; to a sharded one, each rank its rows on its link
        self.broadcast = Broadcast(self.plan, sync.codec.broadcast_spec(), self.send_rows)
        self.status = StatusBoard(run_id)
        self.actions = ActionGate(secret, self.config.processes)
        self.evaluator = Evaluator(
            setup,
            events,
            on_eval=self.status.evaluated,
            in_place=self.config.processes.eval_in_place,
            tokens_now=lambda: self.tokens,
        )
        self.checkpoints = checkpoint_writer(setup, Path(store_dir), run, self.tokens, secret)
        # what one step of a learner can hold, and how fast steps may be credited
        self.tokens_per_step = setup.tokens_per_step * self.config.processes.ranks
        self.step_slack = 2 * sync.sync_every + 8  # a hello's step beyond the credited ones
        self.budget = StepBudget()
        self.totals = RunningTotals(self.plan.num_fragments)  # a lost report costs nothing
        self.ledger.max_missed = int(
            self.tokens_per_step * self.budget.bootstrap_rate * self.budget.horizon
        )
        self.roster = Roster()  # each learner slot: its life, address, budget, presence
        self.attendance = Attendance(sync.rounds.quorum, detect_seconds)
        self.bytes_received = 0
        self.rank_hellos = Throttle(1.0)  # (learner, rank): a rank link caught up
        self.answers = Answers(
            self.syncer,
            self.ledger,
            self.totals,
            self.parts,
            self.conn,
            self.roster,
            events,
            send=self.send,
            send_fragment=self.send_fragment,
            count_tokens=self.count_tokens,
            count_progress=self.count_progress,
            journaled=self.store.journal_enabled,
            restored=start.restored,
        )
        self.next_eval = self.tokens
        self.last_beat = 0.0
        self.stop = stop or threading.Event()  # set (SIGTERM): end the run now, with a summary
        # the message kinds a learner may send, and who handles each (docs/extending.md)
        self.handlers: dict[str, Handler] = {
            "hello": self.on_hello,
            "inline": self.on_inline,
            "peers": self.on_peers,
            "progress": self.on_progress,
            "answer": self.answers.on_answer,
            "answer_part": self.answers.on_answer_part,
            "part_hello": self.answers.on_part_hello,
            "bye": self.on_bye,
            "beat": self.on_beat,
        }

    # -- the loop ---------------------------------------------------------------------------
    def serve(self) -> dict[str, Any]:
        """Run until the token budget (or the time limit) is reached, then the final rounds
        (not after a SIGTERM: that ends the run now); return the summary."""
        budget = self.config.train.tokens
        limit = self.config.train.max_virtual_seconds
        http = self.config.processes.http
        server = StatusServer(http, self.status, self.actions) if http else None
        url, actions = (server.url, self.actions.enabled) if server else (None, False)
        self.events(
            "syncer_up",
            session=self.conn.session,
            status_url=url,
            actions=actions,
            **self.announced,
        )
        try:
            while self.tokens < budget and not (limit and self.events.now() >= limit):
                if self.stop.is_set():
                    break
                self.turn(budget)
            if not self.stop.is_set():
                self.final_rounds()
            return self.finish()
        finally:
            if server is not None:
                server.close()

    def turn(self, budget: int, finishing: bool = False) -> None:
        """One turn of the loop: a burst of messages, the merges due, the beat; then, unless
        ``finishing`` (the final rounds), the evaluation and checkpoint due."""
        deadline = self.syncer.next_deadline()
        wait = BEAT_SECONDS if deadline is None else deadline - self.events.now()
        if self.conn.poll(min(wait, BEAT_SECONDS)):
            for _ in range(64):  # a burst, then give merges and beats a turn
                if self.tokens >= budget and not finishing:
                    break
                msg = self.conn.receive()
                if msg is False:
                    break
                if msg is not None:
                    self.handle(msg)
        self.poll()
        self.answers.expire(self.events.now())  # a sharded answer never merges half
        self.actions.carry_out(self.send, self.events)  # the status page's requests
        now = self.events.now()
        if now - self.last_beat >= BEAT_SECONDS:
            self.last_beat = now
            self.conn.handshakes.drain()
            self.check_liveness(now)
            self.store.save_ledger(self.ledger.to_state())  # narrows what a crash loses
            self.update_beats()
            self.status.publish(snapshot_of(view_of(self, now)))
        if finishing:
            return
        if self.next_eval <= self.tokens < budget:  # at the budget: finish() evaluates
            self.evaluate()
        if self.tokens < budget and self.checkpoints.due(self.tokens):  # copied now,
            self.checkpoints.submit(self.syncer.fragments, self.tokens)  # written later

    def final_rounds(self) -> None:
        """At the budget: every live learner answers every fragment once more
        (:mod:`.final_rounds`), the loop turning meanwhile without evaluations."""
        FinalRounds(
            self.syncer,
            self.ledger,
            self.events,
            turn=lambda: self.turn(self.config.train.tokens, finishing=True),
            ask=self.ask,
            stop=self.stop,
            detect_seconds=self.attendance.detect_seconds,
        ).run(self.config.processes.final_round_seconds)

    def ask(self, rnd: Round, learners: Iterable[int]) -> None:
        """Ask ``learners`` for an answer in ``rnd`` (a final round's ask says so)."""
        ask = protocol.Ask(final=rnd.final_at is not None)
        for m in sorted(learners):
            self.send(m, ask, fragment=rnd.fragment, round=rnd.round_id)

    def handle(self, msg: Incoming) -> None:
        """An authenticated message for this syncer life (:mod:`.connections` checked who
        sent it and for whom): heard from its learner, then its handler. On a sharded
        learner's rank link (rank >= 1) only its answer parts count; its liveness is its
        rank 0's."""
        self.bytes_received += msg.payload.nbytes
        if msg.rank:
            if msg.kind == protocol.PartHello.KIND:
                self.rank_hello(msg)
            else:
                self.answers.take_part(msg)
            return
        self.attendance.heard(msg.learner, msg.at)
        self.dispatch(msg.learner, msg.kind, msg.meta, msg.payload)

    def dispatch(self, m: int, kind: str, meta: dict[str, Any], payload: memoryview) -> None:
        """Run the handler of an authenticated message from learner ``m``; a malformed one
        is refused, counted and logged; nothing gets out."""
        handler, message = self.handlers.get(kind), protocol.FROM_LEARNER.get(kind)
        if handler is None or message is None:
            self.conn.refuse("refused_kind", m, f"unknown message kind {kind[:32]!r}")
            return
        try:
            handler(m, message.parse(meta, self.plan.num_fragments), payload)
        except DDiLoCoError as exc:  # malformed metadata, by the protocol's checks
            self.conn.refuse("refused_meta", m, f"{kind}: {exc}")
        except Exception as exc:
            self.conn.refuse("handler_error", m, f"{kind}: {type(exc).__name__}: {exc}")
            log.debug("syncer: handler error", exc_info=True)

    # -- messages ---------------------------------------------------------------------------
    def on_hello(self, m: int, hello: protocol.Hello, _: memoryview) -> None:
        inc, versions = hello.incarnation, hello.versions
        if inc != self.conn.sessions.get(m):
            raise ConfigError("meta.inc", inc, "is not the session this learner signs with")
        why = ahead_of_store(m, versions, self.syncer.versions, self.store.dir)
        if why is not None:
            self.conn.refuse("refused_ahead", m, why)  # its answers could never merge: say so
            self.send(m, protocol.Refused(why))
            return
        step = self.bounded_step(m, hello.step)
        self.broadcast.hello(m, hello.ranks)  # (before its first fragment, below)
        now = self.events.now()
        self.totals.start(m, inc, from_zero=self.ledger.lives.get(m) != inc)
        self.ledger.joined(m, inc, step, versions)  # a new life: what the old one held is lost
        self.account_uptime(now)
        self.attendance.back(m, restarted=self.roster.hello(m, inc, hello.peer))
        if self.roster.new_budget_life(m, inc):  # a life the budget has not seen: from
            # where the ledger counted it (a restored life), or its first report's tokens
            restored = m in self.ledger.spans_restart
            self.budget.join(
                m, self.ledger.last_step[m][0] if restored else None, now, ceiling=step
            )
        else:  # the same life again: a newcomer that adopted a peer's or the global step
            self.budget.hello_again(m, step)
        asks = self.syncer.join(m, step)
        self.send(m, protocol.Welcome(self.syncer.global_step, list(self.syncer.versions)))
        for rnd in asks:
            self.ask(rnd, [m])
        for p, version in enumerate(self.syncer.versions):
            if version > int(versions[p]):
                self.send_fragment([m], p, version, self.syncer.fragments[p], [])
        self.update_beats()
        self.events("joined", learner=m, incarnation=inc, step=step)

    def bounded_step(self, m: int, claimed: int) -> int:
        """The step learner ``m``'s hello is counted from: its claim, at most what the run
        has credited anyone (or its global step) plus ``step_slack`` (a copied peer's or a
        save's step is a step some learner reached; a claim beyond it would move the global
        step, and every round with it). A capped claim is counted and said."""
        known = [self.syncer.global_step, *(s for s, _ in self.ledger.last_step.values())]
        known += [s for k in self.budget.learners if (s := self.budget.step_of(k)) is not None]
        ceiling = max(known) + self.step_slack
        if claimed <= ceiling:
            return claimed
        self.counts["hello_step_capped"] += 1
        self.conn.say(
            "hello_step",
            "syncer: learner %d's hello claims step %d, beyond any step this run has credited "
            "(%d): counted from step %d (hello_step_capped)",
            m,
            claimed,
            max(known),
            ceiling,
        )
        return ceiling

    def on_beat(self, m: int, beat: protocol.Beat, _: memoryview) -> None:
        """A learner's link says it is alive while it sends nothing else (a long step, an
        evaluation): :meth:`handle` has noted it; nothing else to do."""

    def update_beats(self) -> None:
        """Who the network thread beats, and whether each is waited for (one that is not
        says hello again)."""
        live = self.syncer.live
        self.conn.beats = {m: m in live for m in self.roster.registered()}

    def on_inline(self, m: int, inline: protocol.Inline, _: memoryview) -> None:
        """Learner ``m`` cannot read our shared-memory slots: send it payloads inline, the
        merged fragments first (the broadcast it could not read was one of them: without it
        the learner would answer on an old base until a dropped answer made us resend)."""
        if m in self.conn.inline:
            return
        log.warning("syncer: learner %d sees another /dev/shm; sending it frames inline", m)
        self.conn.inline.add(m)
        for p, version in enumerate(self.syncer.versions):
            if version > 0:  # (a throttled resend may have gone to the slots: not counted)
                self.answers.resent.ready((m, p))
                self.counts["resent_fragment"] += 1
                self.send_fragment([m], p, version, self.syncer.fragments[p], [])

    def on_peers(self, m: int, ask: protocol.AskPeers, _: memoryview) -> None:
        """The live learners' recovery addresses, the furthest trained first (the learner
        tries them in this order): one at step 0 may be copying a peer itself and not answer
        for seconds, so it comes last (not left out: a learner's credited progress lags its
        steps, and early in a run a stepping peer can still be at 0 here). With them, our
        fragment versions: no honest peer holds a later one (a merge is durable before it is
        broadcast), so the newcomer refuses a snapshot that claims one."""
        live = self.syncer.live
        ahead = sorted((k for k in live if k != m), key=lambda k: (-live[k], k))
        peers = {str(k): self.roster.address(k) for k in ahead if self.roster.address(k)}
        self.send(m, protocol.Peers(peers, list(self.syncer.versions)))

    def on_progress(self, m: int, report: protocol.Progress, _: memoryview) -> None:
        if self.roster.life(m) != report.incarnation:
            self.send(m, protocol.Rehello())
            return
        inc = report.incarnation
        added = self.totals.reported(m, inc, report.totals, report.tokens, report.rebased)
        steps, step = self.count_progress(m, report.step, *added)
        if self.record_steps and steps and report.loss is not None:  # (no launcher relays theirs)
            self.events("step", learner=m, step=step, loss=report.loss, batch_tokens=added[0])
        if m not in self.syncer.live:  # a life we gave up (silent: frozen, cut
            self.send(
                m, protocol.Rehello()
            )  # off) trained these all the same: counted (its answers
            return  # claim them); it says hello to be waited for again
        if not steps:
            return
        for rnd in self.syncer.on_progress(m, step, self.events.now(), report.seconds):
            self.ask(rnd, rnd.asked)

    def count_progress(self, m: int, step: int, tokens: int, rebased: list[int]) -> tuple[int, int]:
        """Credit (core/credit.py) and count in the ledger learner ``m``'s progress to
        ``step``: ``tokens`` trained, ``rebased`` fragments applied first; returns (steps
        credited, the credited step)."""
        now = self.events.now()
        steps, credited = self.budget.credit(m, step, tokens, self.tokens_per_step, now)
        at = self.budget.step_of(m) or 0  # the credited step, not the claim
        if at < step or credited < tokens:
            self.counts["progress_capped"] += 1  # claimed more than it may be credited
        self.count_tokens(
            self.ledger.reported(m, at, credited, rebased, self.syncer.versions, steps)
        )
        return steps, at

    def count_tokens(self, tokens: int) -> None:
        """The run's tokens trained, as reported (a progress report, or an answer that
        brought tokens no report did: :mod:`.answers`)."""
        self.tokens += tokens

    def on_bye(self, m: int, bye: protocol.Bye, _: memoryview) -> None:
        self.account_uptime(self.events.now())
        self.syncer.leave(m, self.events.now())
        self.ledger.crashed(m, LEFT)
        self.roster.bye(m)
        self.update_beats()
        self.events("left", learner=m, why=bye.why)

    # -- merging ----------------------------------------------------------------------------
    def poll(self) -> None:
        started = time.monotonic()
        # each merge between two slices of an evaluation in place (:mod:`.evaluator`)
        for result in self.syncer.poll(self.events.now(), self.evaluator.gate.writing):
            result.book(self.ledger)  # counted as (and when) it is made durable, next
            self.persist(result)
            live = sorted(self.syncer.live)
            keys = [a.key for a in result.round.answers]
            nbytes = self.send_fragment(live, result.fragment, result.version, result.tensors, keys)
            for key in keys:
                self.parts.judged(key, "merged")
            self.syncer.record_sync_time(time.monotonic() - started)
            self.status.merged(result, self.events.now())
            self.attendance.contributed(
                (a.learner for a in result.round.answers), self.events.now()
            )
            self.events(**result.record(nbytes), tokens=self.tokens)  # (trained, as reported)
        self.answers.settle()

    def persist(self, result: MergeResult) -> None:
        """Write the merge to disk before anyone hears of it (an acknowledged merge is
        durable; an unacknowledged one is re-pushed by its learners after a crash)."""
        p = result.fragment
        answers = result.round.answers
        self.applied[p].extend(a.key for a in answers)
        if self.store.journal_enabled:
            self.store.append_journal(
                journal_header(result), self.answers.journal([a.key for a in answers])
            )
        self.store.save(
            record_of(self.syncer, p, self.tokens, self.applied[p], self.ledger.to_state())
        )

    def send(self, m: int, message: protocol.Message, **kw: Any) -> None:
        """Send ``message`` to learner ``m`` (``kw``: the header's fragment and round, the
        payload); dropped and counted when ``m`` has no connection (:mod:`.connections`)."""
        self.conn.send(m, message.KIND, meta=message.meta(), **kw)

    def send_fragment(
        self,
        to: list[int],
        p: int,
        version: int,
        tensors: list[torch.Tensor],
        keys: list[tuple[int, int, int]],
    ) -> int:
        """Fragment ``p`` to the learners ``to`` (a sharded one rank by rank, :mod:`.broadcast`);
        the bytes one learner receives."""
        return self.broadcast.fragment(to, p, version, tensors, keys)

    def send_rows(
        self, m: int, rank: int, message: protocol.Message, payload: bytes, p: int
    ) -> None:
        """One frame of a broadcast on learner ``m``'s link of rank ``rank`` (0: its own)."""
        if rank == 0:
            self.send(m, message, fragment=p, payload=payload)
        else:
            self.conn.send_part(m, rank, message.KIND, meta=message.meta(), fragment=p,
                                payload=payload)  # fmt: skip

    def rank_hello(self, msg: Incoming) -> None:
        """A sharded learner's rank link, new to this syncer life, says which versions its
        learner holds: its rows of each newer fragment (at most once a second a rank)."""
        m, rank = msg.learner, msg.rank
        try:
            hello = protocol.PartHello.parse(msg.meta, self.plan.num_fragments)
            if hello.rank != rank:
                raise ConfigError("meta.rank", hello.rank, f"on rank {rank}'s link")
        except DDiLoCoError as exc:
            self.conn.refuse("refused_part", m, f"rank {rank}'s hello: {exc}")
            return
        if self.rank_hellos.ready((m, rank)):
            fragments = self.syncer.fragments
            if self.broadcast.catch_up(m, hello, self.syncer.versions, fragments):
                self.counts["rank_caught_up"] += 1

    # -- liveness, evaluation, the end -----------------------------------------------------
    def check_liveness(self, now: float) -> None:
        """Give up the learners silent for ``detect_seconds``: no longer waited for; the
        ledger waits to see a new life (or the end)."""
        late = self.attendance.overdue(self.syncer.live, now, self.conn.heard)
        if late:
            self.account_uptime(now)
        for m in late:
            self.syncer.leave(m, now)
            self.roster.given_up(m)
            self.events("detected", learner=m)
        if late:
            self.update_beats()
        self.poll()

    def account_uptime(self, now: float) -> None:
        """Called before every membership change: time with >= K live learners is up."""
        self.attendance.change(now, len(self.syncer.live))

    def evaluate(self) -> None:
        """Start an evaluation of the global model on the evaluator's thread (skipped and
        counted while the previous one still runs)."""
        self.evaluator.submit(self.syncer.fragments, self.tokens)
        every = self.config.train.eval_every  # (on the run's grid: a resume keeps the cadence)
        self.next_eval = (self.tokens // every + 1) * every

    def write_final(self, loss: float) -> None:
        """The run's checkpoint, after the last merge (and the periodic one in flight); a
        failed write (a full disk) is logged and counted, the summary still comes."""
        self.checkpoints.wait()
        try:
            self.checkpoints.write_fragments(self.syncer.fragments, self.tokens, loss)
        except Exception as exc:  # (a CheckpointError names the file)
            self.checkpoints.counts["checkpoint_failed"] += 1
            log.error("syncer: the final checkpoint failed: %s: %s", type(exc).__name__, exc)

    def finish(self) -> dict[str, Any]:
        self.conn.stop_watching()  # (the learners are told to stop; the last steps are long)
        self.conn.handshakes.drain()
        self.answers.expire(self.events.now(), ended=True)  # none can complete now
        now = self.events.now()
        self.account_uptime(now)
        for m in self.roster.registered():
            self.send(m, protocol.Stop())
        self.evaluator.wait()  # the run's result is evaluated last, here
        final = self.setup.eval_loss(self.syncer.fragments)
        self.status.evaluated(self.tokens, final)
        self.events("eval", tokens=self.tokens, loss=final)
        self.write_final(final)
        # given up, or not back after a syncer restart: what it held died with it
        for m in sorted({*self.attendance.down_since, *self.ledger.absent()}):
            self.ledger.crashed(m, CRASH)
        self.ledger.close()
        view = view_of(self, now)
        self.status.publish(snapshot_of(view))
        summary = service_summary(view, final)
        self.events("summary", **summary)
        for _ in range(3):  # stop is not acknowledged: say it a few times
            time.sleep(0.1)
            for m in self.roster.registered():
                self.send(m, protocol.Stop())
        self.conn.close()
        return summary
