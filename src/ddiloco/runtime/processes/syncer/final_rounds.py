"""The end of a run on the syncer: every live learner answers every fragment once more.

At the token budget the service hands the loop to :class:`FinalRounds`: first it waits a
little for learners a restarted syncer does not know yet (a syncer killed in its final rounds
restarts past the budget, and its learners, alive and waiting for the stop, register again
within seconds: issue 29), then the core opens a final round of every fragment
(``SyncerState.finish``) and each learner is asked for its next owed fragment, one at a
time, until every round has merged or ``processes.final_round_seconds`` have passed.

Call order: :meth:`FinalRounds.run` once, from the service's thread, after the last turn of
the budget; it drives the service only through ``turn`` (one turn of the loop, finishing:
messages, merges, beats; no evaluation or checkpoint) and ``ask``. A SIGTERM (``stop``) ends
it at once.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from ddiloco.core.restart_ledger import RestartLedger
from ddiloco.core.rounds import Round
from ddiloco.core.syncer_state import SyncerState
from ddiloco.runtime.processes.transport.events import Events

log = logging.getLogger(__name__)

FINAL_ASK_SECONDS = 1.0  # a final round asks the learners it still waits for again this often


class FinalRounds:
    """The final rounds of one syncer life (see the module doc)."""

    def __init__(
        self,
        syncer: SyncerState,
        ledger: RestartLedger,
        events: Events,
        *,
        turn: Callable[[], None],
        ask: Callable[[Round, list[int]], None],
        stop: threading.Event,
        detect_seconds: float,
    ) -> None:
        self.syncer = syncer
        self.ledger = ledger
        self.events = events
        self.turn = turn
        self.ask = ask
        self.stop = stop
        self.detect_seconds = detect_seconds

    def run(self, seconds: float) -> None:
        """Ask every live learner for every fragment once more (a final ask: it stops
        stepping until the stop), one fragment after the other; each final round merges
        when all of them have answered, or once ``seconds`` (for all of them) have passed,
        with what came. ``seconds`` <= 0: no final rounds."""
        if seconds <= 0:
            return
        # (learners reconnect within seconds of a restart; one that died meanwhile must not
        # hold the end up for long)
        self.await_restored_learners(min(seconds, 3 * self.detect_seconds))
        if not self.syncer.live:
            return
        started = self.events.now()
        merged = self.syncer.counts.get("merged_rounds", 0)
        self.syncer.finish(started, started + seconds)
        asked: dict[int, tuple[Round, float]] = {}  # learner -> the round it was asked, when
        while not self.syncer.finished and not self.stop.is_set():
            now = time.monotonic()
            for m, rnd in self.next_asks().items():
                last = asked.get(m)  # asked again after a while: an ask lost on the way
                if last is None or last[0] is not rnd or now - last[1] >= FINAL_ASK_SECONDS:
                    asked[m] = (rnd, now)
                    self.ask(rnd, [m])
            self.turn()
        took = self.events.now() - started
        if took >= seconds:
            log.warning(
                "syncer: the final rounds ran out their %.0fs (processes.final_round_seconds): "
                "a learner did not answer every fragment; merged what came",
                seconds,
            )
        self.events(
            "final_rounds",
            seconds=round(took, 4),
            merged=self.syncer.counts.get("merged_rounds", 0) - merged,
            fragments=self.syncer.plan.num_fragments,
        )

    def await_restored_learners(self, seconds: float) -> None:
        """Wait (at most ``seconds``) for the learners of the ledger's snapshot that this
        syncer life has not heard from, so that the final rounds ask them too, instead of
        ending at once with their last answers unmerged (issue 29)."""
        absent = self.ledger.absent()  # lives of the ledger's snapshot not heard from yet
        if not absent:
            return
        log.warning(
            "syncer: restarted at the end of the run; waiting up to %.0fs for learner%s %s "
            "to register again before the final rounds",
            seconds,
            "s" if len(absent) > 1 else "",
            ", ".join(map(str, sorted(absent))),
        )
        deadline = time.monotonic() + seconds
        while self.ledger.absent() and time.monotonic() < deadline and not self.stop.is_set():
            self.turn()
        if self.ledger.absent():
            log.warning(
                "syncer: learner%s %s did not come back; the final rounds go on without",
                "s" if len(self.ledger.absent()) > 1 else "",
                ", ".join(map(str, sorted(self.ledger.absent()))),
            )

    def next_asks(self) -> dict[int, Round]:
        """Each learner's next final ask: the first open final round it still owes. One
        fragment at a time, each learner at its own pace: the answers held here are M
        fragments, not the M models that asking every fragment at once gathered (issue 28),
        and a slow or silent learner holds up no other learner's answers."""
        owed: dict[int, Round] = {}
        for rnd in sorted(self.syncer.open_rounds.values(), key=lambda r: r.fragment):
            for m in rnd.asked - rnd.finally_answered:
                owed.setdefault(m, rnd)
        return owed
