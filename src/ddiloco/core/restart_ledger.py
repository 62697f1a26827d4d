"""The token ledger of a syncer that can restart, fed over a network that can contradict it.

:class:`RestartLedger` wraps a :class:`~ddiloco.core.ledger.TokenLedger` (``book``) and adds
what a syncer with durable state needs around it: a call that contradicts the book is counted
in ``errors`` instead of raising, and a ledger loaded from a snapshot reconciles what
learners told the lost syncer life after it (docs/decisions.md 33). It wraps rather than
subclasses because its contracts differ (see the class docstring). Pure bookkeeping like
the book: no tensors, no I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from ddiloco.core.ledger import CRASH, TokenLedger
from ddiloco.errors import ConfigError

MAX_CONTRADICTIONS = 10  # errors named in the summary (the rest are counted)
STATE_KEY = "tolerant"  # this wrapper's section of the durable state (name kept for old stores)


class RestartLedger:
    """A :class:`TokenLedger`, tolerant of contradictions and reconciled across restarts.

    A learner given up for dead may come back, so a record can contradict what the ledger
    knows: such a call is counted in ``errors`` (the summary then reports the ledger as
    unbalanced) instead of stopping the syncer.

    A restarted syncer loads the ledger from its latest durable snapshot (taken atomically
    with each merge's fragment file, and between merges); what learners reported to the dead
    syncer after that snapshot is reconciled from what they say next: a rebase it missed
    shows in the learner's hello (a base version beyond the last one counted), trained tokens
    it missed in the first progress report's step count, or else in an answer whose counter
    exceeds what the ledger saw (counted as trained then: they are re-reported, never
    invented); an answer re-pushed from before the restart adds no tokens twice.
    Reconciliation holds only for learner lives restored from a snapshot.

    Where the contract differs from :class:`TokenLedger`'s:

    * no recording method raises on a contradiction (``errors`` counts it); only
      :meth:`load_state` raises, on a snapshot it cannot use;
    * :meth:`answered` returns 0, not the answer's new tokens, and takes the answer's
      ``base`` version; a re-pushed answer may add no tokens, or count missed ones as trained;
    * :meth:`reported` returns the tokens it counted, the restart's missed ones included;
    * :meth:`to_state` adds a ``"tolerant"`` section, and :meth:`load_state` treats every
      life in the snapshot as spanning a restart.
    """

    def __init__(self, num_fragments: int, *, carry: bool = False) -> None:
        self.book = TokenLedger(num_fragments, carry=carry)
        self.errors = 0
        self.late_answers = 0  # answers overtaken by a later rebase or answer (see answered)
        self.contradictions: list[str] = []  # the first errors, named (the summary's)
        self.lives: dict[int, int] = {}  # learner -> incarnation the ledger's state is of
        self.floor: dict[tuple[int, int], int] = {}  # base version of the last counted rebase
        self.last_step: dict[int, tuple[int, int]] = {}  # learner -> (step, tokens per step)
        self.restart: dict[str, int] = {
            "rereported": 0,
            "lost_rebases": 0,
            "stale_repushes": 0,
            "repushed_open": 0,
        }
        self.spans_restart: set[int] = set()  # lives restored from a snapshot
        self.unconfirmed: set[int] = set()  # ... not yet heard from (no hello yet)
        self.gap_check: set[int] = set()  # ... whose first progress report is still due
        self.restored_open: set[object] = set()  # answers open in the snapshot
        self._early: dict[int, int] = {}  # tokens answers re-reported before the gap check
        self.max_missed = 1 << 62  # tokens one learner's restart gap may add (the service sets it)

    def _guard(self, fn: Callable[..., object], *args: object) -> None:
        try:
            fn(*args)
        except ConfigError as exc:
            self.errors += 1
            if len(self.contradictions) < MAX_CONTRADICTIONS:  # what, for the summary
                self.contradictions.append(f"{fn.__name__}{args}: {exc}")

    # -- the learner side, as the syncer service reports it --------------------------------
    def joined(self, learner: int, incarnation: int, step: int, versions: list[int]) -> None:
        """A hello. A new life: whatever the old one held is lost. The first hello of a life
        restored from a snapshot: the fragments it rebased onto since then are rebased here
        (before any token it reports to this syncer life)."""
        old = self.lives.get(learner)
        if old is not None and old != incarnation:
            self.crashed(learner, CRASH)
        if self.lives.get(learner) != incarnation:  # a life this ledger starts now
            self.lives[learner] = incarnation
            self.last_step[learner] = (step, 0)
            for p, v in enumerate(versions[: self.num_fragments]):
                self.floor[(learner, p)] = int(v)
            return
        if learner in self.unconfirmed:
            self.unconfirmed.discard(learner)
            for p, v in enumerate(versions[: self.num_fragments]):
                if int(v) > self.floor.get((learner, p), 0):
                    self.restart["lost_rebases"] += 1
                    self.rebased(learner, p, int(v))

    def reported(
        self,
        learner: int,
        step: int,
        tokens: int,
        rebased: list[int],
        versions: list[int],
        steps: int = 1,
    ) -> int:
        """A progress report (rebases first, then the step's tokens); returns the tokens it
        counts, with those a restarted syncer missed (the steps since the last report, at
        most :attr:`max_missed` tokens: the gap is the learner's claim). ``step`` and
        ``tokens`` are what the syncer credited (core/credit.py), ``steps`` their steps."""
        for p in rebased:
            self.rebased(learner, p, versions[p] if 0 <= p < len(versions) else None)
        last, per_step = self.last_step.get(learner, (step, 0))
        missed = 0
        if learner in self.gap_check:  # the first report since a restart: steps it missed
            self.gap_check.discard(learner)
            early = self._early.pop(learner, 0)  # already re-reported by answers
            missed = min(self.max_missed, max(0, (step - last) * per_step - tokens - early))
            self.restart["rereported"] += missed
        elif step > last and tokens > 0 and tokens % (step - last) == 0:
            per_step = tokens // (step - last)
        self.last_step[learner] = (max(step, last), per_step)
        extra = missed // per_step if per_step else 0
        self._guard(self.book.trained_steps, learner, tokens + missed, steps + extra)
        return tokens + missed

    def trained(self, learner: int, tokens: int) -> None:
        """As :meth:`TokenLedger.trained`; a contradiction counts an error."""
        self._guard(self.book.trained, learner, tokens)

    def answered(
        self,
        learner: int,
        fragment: int,
        key: object,
        c_tokens: int,
        base: int | None = None,
        overtaken: bool = False,
    ) -> int:
        """Record an answer on ``base`` (its base version, if known); always returns 0.

        For a life restored from a snapshot: the answer open in it, re-pushed, is the same
        answer (nothing recorded); one sent before a rebase or a later answer the ledger
        counted carries no new tokens; tokens beyond what the ledger saw count as trained.
        A late answer (a frame that arrived after a later one: ``overtaken`` by a rebase of
        its fragment the ledger counted, or below an answer on the same base) carries no new
        tokens either: they were counted with the rebase, or the later answer
        (:attr:`late_answers` counts them).
        """
        if learner in self.spans_restart and 0 <= fragment < self.num_fragments:
            if key in self.restored_open and self.is_open(key):
                self.restored_open.discard(key)  # the same answer, re-pushed
                self.restart["repushed_open"] += 1
                return 0
            since, reserved = self.counters(learner, fragment)
            older = base is not None and base < self.floor.get((learner, fragment), 0)
            if (older or c_tokens < reserved) and not self.is_open(key):
                # sent before a rebase (or a later answer) the ledger counted: no new tokens
                self.restart["stale_repushes"] += 1
                self._guard(self.book.answered, learner, fragment, key, reserved)
                return 0
            c_tokens = min(c_tokens, since + self.max_missed)  # the claim is all there is
            if c_tokens > since:  # trained before the restart, reported to the lost life
                self.restart["rereported"] += c_tokens - since
                if learner in self.gap_check:
                    self._early[learner] = self._early.get(learner, 0) + c_tokens - since
                self.trained(learner, c_tokens - since)
        if 0 <= fragment < self.num_fragments and learner in self.lives:
            reserved = self.counters(learner, fragment)[1]
            if overtaken or c_tokens < reserved:
                self.late_answers += 1
                self._guard(self.book.answered, learner, fragment, key, reserved)
                return 0
        self._guard(self.book.answered, learner, fragment, key, c_tokens)
        return 0

    def rebased(self, learner: int, fragment: int, version: int | None = None) -> None:
        """As :meth:`TokenLedger.rebased`, remembering ``version`` as the learner's floor."""
        self._guard(self.book.rebased, learner, fragment)
        if version is not None:
            key = (learner, fragment)
            self.floor[key] = max(self.floor.get(key, 0), version)

    def crashed(self, learner: int, reason: str = CRASH) -> None:
        """As :meth:`TokenLedger.crashed`; the life is forgotten."""
        self._guard(self.book.crashed, learner, reason)
        self.lives.pop(learner, None)
        self.last_step.pop(learner, None)
        for p in range(self.num_fragments):
            self.floor.pop((learner, p), None)
        self._early.pop(learner, None)
        for restored in (self.spans_restart, self.unconfirmed, self.gap_check):
            restored.discard(learner)

    def absent(self) -> list[int]:
        """Lives restored from a snapshot that never said hello to this syncer life."""
        return sorted(self.unconfirmed)

    # -- the syncer side (what core.syncer_state.SyncerState calls) --------------------------
    def merged_answer(self, key: object, weight: float) -> None:
        """As :meth:`TokenLedger.merged_answer` (the service books a merge right before it
        writes it to disk: ``MergeResult.book``)."""
        self._guard(self.book.merged_answer, key, weight)

    def wasted_answer(self, key: object, reason: str) -> None:
        self._guard(self.book.wasted_answer, key, reason)

    def superseded(self, old: object, new: object) -> None:
        self._guard(self.book.superseded, old, new)

    def credit(self, key: object) -> tuple[int, int] | None:
        return self.book.credit(key)

    def since_base(self, learner: int, fragment: int) -> tuple[int, int]:
        return self.book.since_base(learner, fragment)

    def close(self) -> None:
        """End of run, as :meth:`TokenLedger.close`."""
        self.book.close()

    # -- the book's totals, read through -----------------------------------------------------
    @property
    def num_fragments(self) -> int:
        return self.book.num_fragments

    @property
    def trained_tokens(self) -> int:
        return self.book.trained_tokens

    @property
    def merged(self) -> list[int]:
        return self.book.merged

    @property
    def wasted(self) -> dict[str, list[int]]:
        return self.book.wasted

    def counters(self, learner: int, fragment: int) -> tuple[int, int]:
        return self.book.counters(learner, fragment)

    def is_open(self, key: object) -> bool:
        return self.book.is_open(key)

    def pending(self) -> list[int]:
        return self.book.pending()

    def balanced(self) -> bool:
        return self.book.balanced()

    def summary(self) -> dict[str, object]:
        return self.book.summary()

    # -- the durable state ------------------------------------------------------------------
    def to_state(self) -> dict[str, Any]:
        """The book's state plus this wrapper's, under ``"tolerant"``."""
        state = self.book.to_state()
        state[STATE_KEY] = {
            "errors": self.errors,
            "lives": [[m, inc] for m, inc in sorted(self.lives.items())],
            "floor": [[m, p, v] for (m, p), v in sorted(self.floor.items())],
            "last_step": [[m, s, t] for m, (s, t) in sorted(self.last_step.items())],
            "restart": dict(self.restart),
        }
        return state

    def load_state(self, state: Mapping[str, Any]) -> None:
        """Load a snapshot as a restarted syncer: every life in it spans a restart. Raises
        :class:`ConfigError` on a snapshot that is malformed or for another plan."""
        self.book.load_state(state)
        extra = state.get(STATE_KEY, {})
        try:
            self.errors = int(extra.get("errors", 0))
            self.lives = {int(m): int(inc) for m, inc in extra.get("lives", [])}
            self.floor = {(int(m), int(p)): int(v) for m, p, v in extra.get("floor", [])}
            self.last_step = {int(m): (int(s), int(t)) for m, s, t in extra.get("last_step", [])}
            self.restart.update({str(k): int(v) for k, v in extra.get("restart", {}).items()})
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"ledger.{STATE_KEY}", type(exc).__name__, str(exc)) from None
        self.spans_restart = set(self.lives)
        self.unconfirmed = set(self.lives)
        self.gap_check = set(self.lives)
        self.restored_open = {
            tuple(a[0]) if isinstance(a[0], list) else a[0] for a in state["answers"]
        }
