"""An answer's way through the syncer service, from its learner's link to the core's verdict.

Call order, per answer: counted in the ledger as its learner's link delivered it
(:meth:`Answers.book`: a sharded learner's when rank 0's part came, in order with its
reports), decoded, judged by the core (:meth:`Answers.take`), then held until its round
merges (its bytes as they came, for the journal) or dropped with a ``verdict`` to its
learner. An answer on an old base gets its fragment sent again (the learner may have missed
the broadcast) and, in a final round, is asked for again. A sharded learner's parts are put
together by :mod:`.parts` first; one that never completes is dropped whole
(:meth:`Answers.incomplete`).

The service owns the run's token count and the progress credit: ``count_tokens`` adds tokens
an answer brought that no report did, ``count_progress`` credits the reports an answer says
were sent before it and never came (:meth:`.service.SyncerService.count_progress`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, MutableMapping, Sequence
from typing import Any

import torch

from ddiloco.core.codec import PackedTensors
from ddiloco.core.ledger import INCOMPLETE
from ddiloco.core.parts import PartError
from ddiloco.core.restart_ledger import RestartLedger
from ddiloco.core.rounds import UNSOLICITED, AnswerMeta, Verdict
from ddiloco.core.syncer_state import SyncerState
from ddiloco.runtime.processes import protocol
from ddiloco.runtime.processes.syncer.connections import Connections, Incoming
from ddiloco.runtime.processes.syncer.parts import AnswerParts, Head, Key
from ddiloco.runtime.processes.syncer.roster import Roster
from ddiloco.runtime.processes.syncer.totals import RunningTotals
from ddiloco.runtime.processes.transport.events import Events
from ddiloco.runtime.processes.transport.ratelog import Throttle
from ddiloco.runtime.processes.transport.wire import WireError, decode_update

Send = Callable[..., None]  # (learner, its protocol message, **the header's fields)
SendFragment = Callable[[list[int], int, int, list[torch.Tensor], list[Key]], int]


class Answers:
    """The answers in flight: held for the journal until merged (``journaled``), and the
    throttles of what an answer on an old base sets off. ``restored``: this syncer life
    restored a previous one's store (a re-pushed answer for a round that life never made
    durable joins the fragment's current round)."""

    def __init__(
        self,
        syncer: SyncerState,
        ledger: RestartLedger,
        totals: RunningTotals,
        parts: AnswerParts,
        conn: Connections,
        roster: Roster,
        events: Events,
        *,
        send: Send,
        send_fragment: SendFragment,
        count_tokens: Callable[[int], None],
        count_progress: Callable[[int, int, int, list[int]], Any],
        journaled: bool,
        restored: bool,
    ) -> None:
        self.syncer, self.ledger, self.totals, self.parts = syncer, ledger, totals, parts
        self.conn, self.roster, self.events = conn, roster, events
        self.send, self.send_fragment = send, send_fragment
        self.count_tokens, self.count_progress = count_tokens, count_progress
        self.counts: MutableMapping[str, int] = conn.counts
        self.journaled = journaled
        self.restored = restored
        self.num_fragments = len(syncer.fragments)
        self.shapes = [[tuple(t.shape) for t in frag] for frag in syncer.fragments]
        self.payloads: dict[Key, bytes] = {}  # journal inputs, until merged
        self.resent = Throttle(1.0)  # (learner, fragment): a fragment sent again
        self.asked_again = Throttle(0.2)  # ... asked again in a final round

    # -- handlers (the service's table: learner -> syncer) ----------------------------------
    def on_answer(self, m: int, message: protocol.Answer, payload: memoryview) -> None:
        answer, totals = message.answer, message.totals
        if answer.learner != m or self.roster.life(m) != answer.incarnation:
            self.send(m, protocol.Rehello())  # from a life not registered: re-push later
            return
        answer.validate(self.num_fragments)
        overtaken = self.totals.overtaken(m, answer.incarnation, totals, answer.fragment)
        caught_up = self.totals.caught_up(m, answer.incarnation, totals)
        if caught_up[0] or caught_up[1]:  # reports it was sent after never came: count them
            self.counts["progress_caught_up"] += 1
            self.count_progress(m, answer.local_step, *caught_up)
        if self.restored and answer.round_id >= self.syncer.next_round_id(answer.fragment):
            # re-pushed for a round the previous life opened but never made durable: the
            # answer itself is sound, so it joins the fragment's current or next round
            answer = dataclasses.replace(answer, round_id=UNSOLICITED)
            self.counts["forgotten_round"] += 1
        head = Head(answer, overtaken)
        try:
            if message.ranks > 1:  # rank 0's part of a sharded learner's answer
                whole = self.parts.add(answer.key, answer.fragment, 0, message.ranks, payload,
                                       self.events.now(), head)  # fmt: skip
                if whole is None and not self.parts.is_open(answer.key):
                    if not self.syncer.has_seen(answer.key):  # (else a re-push: judged)
                        self.verdict(m, answer, INCOMPLETE)  # dropped before its head came
                    return
                self.book(m, head)  # now, in order with its reports: not when its last part came
                if whole is not None:
                    self.take(m, *whole, None)
                return
            delta = decode_update(payload, self.shapes[answer.fragment])
        except WireError as exc:
            self.counts[f"refused_{exc.reason}"] += 1
            self.verdict(m, answer, "refused_" + exc.reason)
            return
        except PartError as exc:
            self.conn.refuse("refused_part", m, f"rank 0's part: {exc}")
            return
        self.book(m, head)
        self.take(m, head, delta, payload)

    def on_answer_part(self, m: int, part: protocol.AnswerPart, _: memoryview) -> None:
        """A part on the learner's own link: rank 0's part is an ``answer``, the others come
        on their ranks' links (:meth:`take_part`)."""
        self.conn.refuse("refused_part", m, f"rank {part.rank}'s part on learner {m}'s own link")

    def on_part_hello(self, m: int, hello: protocol.PartHello, _: memoryview) -> None:
        """A rank's hello on the learner's own link: it belongs on the rank's link."""
        self.conn.refuse("refused_part", m, f"rank {hello.rank}'s hello on learner {m}'s own link")

    def take_part(self, msg: Incoming) -> None:
        """A part on a sharded learner's rank link (rank >= 1): the answer it completes, if
        any, is taken (counted when rank 0's part came)."""
        whole = self.parts.receive(msg, self.conn.refuse)
        if whole is not None:
            self.take(msg.learner, *whole, None)

    # -- the way through --------------------------------------------------------------------
    def book(self, m: int, head: Head) -> None:
        """Count an answer in the ledger as its learner's link delivered it (its head: a
        sharded learner's answer is whole only when its last part comes on another link,
        maybe after a report of a rebase sent after it); a re-push is not new work."""
        answer = head.answer
        if self.syncer.has_seen(answer.key) or self.ledger.is_open(answer.key):
            return
        before = self.ledger.trained_tokens  # (re-reported tokens a restart missed)
        self.ledger.answered(
            m, answer.fragment, answer.key, answer.c_tokens, answer.base_version, head.overtaken
        )
        self.count_tokens(self.ledger.trained_tokens - before)

    def take(
        self, m: int, head: Head, values: Sequence[torch.Tensor], payload: memoryview | None
    ) -> None:
        """A whole answer, counted in the ledger (:meth:`book`), judged by the core
        (``payload``: as it came, None when put together from parts, whose ``values`` read
        each tensor from its parts as they came); held until its round merges as it came."""
        answer = head.answer
        packed = None if payload is None else bytes(payload)  # (the frame's buffer is reused)
        keep: Sequence[torch.Tensor] = values  # (parts: each tensor put together when read)
        delta = list(values)  # decoded once, for the core's checks; dropped after
        if packed is not None:
            keep = PackedTensors(packed, expected_shapes=self.shapes[answer.fragment])
        verdict = self.syncer.on_answer(answer, delta, self.events.now(), keep=keep)
        if verdict in (Verdict.ACCEPTED, Verdict.WAITING):
            if self.journaled:
                self.payloads[answer.key] = self.parts.journal(delta) if packed is None else packed
        else:
            self.verdict(m, answer, verdict.value)
            if verdict in (Verdict.BASE_ALREADY_MERGED, Verdict.STALE):
                self.resend(m, answer.fragment)
                self.ask_again(m, answer.fragment)

    def journal(self, keys: Sequence[Key]) -> list[bytes]:
        """The merged answers' payloads as they came, for the journal, no longer held."""
        return [self.payloads.pop(key, b"") for key in keys]

    def settle(self) -> None:
        """After the merges of a turn: let go of what the core no longer holds (superseded or
        dropped: never merged), and tell a sharded learner's ranks so."""
        for key in [k for k in self.payloads if not self.syncer.is_held(k)]:
            del self.payloads[key]
        for key in [k for k in self.parts.ranks if not self.syncer.is_held(k)]:
            self.parts.judged(key, "superseded")  # (merged ones were told so at the merge)

    def expire(self, now: float, ended: bool = False) -> None:
        """Drop the sharded answers whose parts can no longer all come (``ended``: the run's
        end, none can)."""
        for dropped in self.parts.expire(now, ended=ended):  # never merged half
            self.incomplete(dropped.head)

    def incomplete(self, head: Head | None) -> None:
        """A sharded learner's answer dropped missing a part: wasted in the ledger (booked
        when its head came) and rank 0 told (its other ranks were, :mod:`.parts`)."""
        if head is None:  # rank 0's part never came: nothing was booked, no one to tell
            return
        if self.ledger.is_open(head.answer.key):
            self.ledger.wasted_answer(head.answer.key, INCOMPLETE)
        self.verdict(head.answer.learner, head.answer, INCOMPLETE)

    def verdict(self, m: int, answer: AnswerMeta, verdict: str) -> None:
        self.send(m, protocol.Verdict(answer.key, verdict), fragment=answer.fragment)
        self.parts.judged(answer.key, verdict)  # (a sharded learner's other ranks too)
        self.events("drop", learner=m, fragment=answer.fragment, verdict=verdict)

    # -- what an answer on an old base sets off ---------------------------------------------
    def resend(self, m: int, p: int) -> None:
        """An answer on an old base: the learner may have missed a broadcast (dropped on the
        way, or in a slot it could not read), and a learner that never hears of a merge keeps
        answering on its old base. Send it the fragment again, at most once a second."""
        if self.resent.ready((m, p)):
            self.counts["resent_fragment"] += 1
            self.send_fragment([m], p, self.syncer.versions[p], self.syncer.fragments[p], [])

    def ask_again(self, m: int, p: int) -> None:
        """A final round still owed an answer by ``m``, whose answer was on an old base: ask
        again once the merged fragment has had time to arrive (at most every 0.2 s)."""
        rnd = self.syncer.open_rounds.get(p)
        if rnd is None or rnd.final_at is None or m not in rnd.asked - rnd.finally_answered:
            return
        if self.asked_again.ready((m, p)):
            self.counts["asked_again"] += 1
            ask = protocol.Ask(final=True)
            self.send(m, ask, fragment=rnd.fragment, round=rnd.round_id)
