"""The syncer's round policy: when a fragment's round opens, which answers count, when it closes.

Pure bookkeeping over metadata (no tensors, no I/O): the runtime reports progress, answers and
the passing of time (``now`` is always an argument), and the policy says whom to ask, what to
drop and which rounds are ready to merge. The syncer's clock drives the schedule: the global
step is the progress of the K-th fastest live learner, and a round for fragment p opens when it
reaches a step t with t mod H == t_p (a per-learner schedule lets a slow learner drift out of
phase until every answer it sends is stale).

At the run's end, :meth:`RoundPolicy.finish` gives every fragment a final round asking every
live learner: it closes when each of them has answered (or at its deadline, with what came),
quorum or not, so what the learners trained since their last merged answers reaches the
global model instead of being thrown away. No round opens after it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum

from ddiloco.core.grace import Ema, GraceConfig, grace_window
from ddiloco.errors import ConfigError, require

ANCHORS = ("base", "current")  # what a late answer's delta is taken against (core/stale.py)


@dataclass(frozen=True)
class RoundConfig:
    """Quorum, staleness and overlap settings of the syncer."""

    quorum: int = 1  # K: distinct learners needed before a round may close
    max_staleness: int = 1  # accepted: current version - base version <= this
    overlap: int = 2  # tau: steps a learner keeps computing while a fragment is in flight
    grace: GraceConfig = field(default_factory=GraceConfig)
    stale_weight: float = 0.0  # lambda: a late answer weighs 1 / (1 + lambda s) (core/stale.py)
    anchor: str = "base"  # a late delta against its own base, or "current" (core/stale.py)

    def __post_init__(self) -> None:
        require(self.quorum >= 1, "quorum", self.quorum, "K must be >= 1")
        require(self.max_staleness >= 0, "max_staleness", self.max_staleness, "must be >= 0")
        require(self.overlap >= 0, "overlap", self.overlap, "tau must be >= 0")
        require(
            self.stale_weight >= 0.0 and math.isfinite(self.stale_weight),
            "stale_weight",
            self.stale_weight,
            "must be finite and >= 0",
        )
        require(self.anchor in ANCHORS, "anchor", self.anchor, f"known: {', '.join(ANCHORS)}")


# round_id of an answer a learner pushes on its own schedule (lock-step baselines): it is
# for the fragment's current or next round, whichever that is when it arrives.
UNSOLICITED = -1


@dataclass(frozen=True)
class AnswerMeta:
    """What a learner's answer says about itself (the tensors travel separately)."""

    learner: int
    incarnation: int  # bumped on every (re)start, so ids from a previous life stay distinct
    seq: int  # per incarnation, increasing
    fragment: int
    round_id: int
    base_version: int
    local_step: int
    c_steps: int
    c_tokens: int

    @property
    def key(self) -> tuple[int, int, int]:
        return (self.learner, self.incarnation, self.seq)

    def validate(self, num_fragments: int) -> None:
        """Refuse impossible metadata with an error naming the field."""
        require(0 <= self.fragment < num_fragments, "fragment", self.fragment, "out of range")
        require(self.round_id >= UNSOLICITED, "round_id", self.round_id, "must be >= -1")
        for name in ("learner", "incarnation", "seq", "base_version"):
            value = getattr(self, name)
            require(value >= 0, name, value, "must be >= 0")
        for name in ("local_step", "c_steps", "c_tokens"):
            value = getattr(self, name)
            require(value >= 0, name, value, "counters must be >= 0")


class Verdict(Enum):
    """What the policy did with an answer. Every non-accepted verdict is counted."""

    ACCEPTED = "accepted"
    WAITING = "waiting"  # no round open for its fragment: held for the next one
    DUPLICATE = "duplicate"  # the same answer again (retransmission): ignored, no tokens
    STALE = "stale"  # base too old: dropped, its tokens wasted
    BASE_ALREADY_MERGED = "base_already_merged"  # would re-apply merged progress: dropped
    INVALID = "invalid"  # base version or round from the future: dropped
    OUTLIER = "outlier"  # delta norm out of bounds (core/robust.py): refused, tokens wasted


@dataclass
class Round:
    """One open round of one fragment."""

    fragment: int
    round_id: int
    version: int  # the fragment's version while the round is open
    opened_at: float
    asked: set[int]
    answers: dict[tuple[int, int, int], AnswerMeta] = field(default_factory=dict)
    quorum_at: float | None = None
    grace: float = 0.0
    final_at: float | None = None  # a final round (RoundPolicy.finish): closes by then
    finally_answered: set[int] = field(default_factory=set)  # answered the final ask
    opened_step: int = 0  # the global step it opened at (the outer momentum's clock)

    @property
    def learners(self) -> set[int]:
        """Learners with a fresh answer (on the current version) in this round. Late answers
        on an older base ride along in the merge but do not count: counting them would meet
        the quorum the moment the round opens, close it before the fresh answers arrive, and
        push those to the next round, forever one round late."""
        return {a.learner for a in self.answers.values() if a.base_version == self.version}

    @property
    def deadline(self) -> float | None:
        if self.final_at is not None:
            return self.final_at
        return None if self.quorum_at is None else self.quorum_at + self.grace


@dataclass(frozen=True)
class ClosedRound:
    """A round ready to merge, with everything the metrics need."""

    fragment: int
    round_id: int
    version: int
    answers: tuple[AnswerMeta, ...]
    opened_at: float
    quorum_at: float
    closed_at: float
    grace: float
    asked: int
    opened_step: int = 0
    final: bool = False  # a final round (RoundPolicy.finish)


@dataclass(frozen=True)
class Supersession:
    """An older answer replaced by a newer one of the same learner life and base: the newer
    delta already contains the older's progress, so the older's tokens ride with it."""

    old: tuple[int, int, int]
    new: tuple[int, int, int]


@dataclass(frozen=True)
class Dropped:
    """An answer held for a later round that had gone stale by the time the round opened."""

    answer: AnswerMeta
    verdict: Verdict


class RoundPolicy:
    """Per-fragment rounds with versions, quorum K, the adaptive grace window and staleness."""

    def __init__(
        self,
        num_fragments: int,
        due: Callable[[int], Sequence[int]],
        sync_every: int,
        config: RoundConfig,
    ) -> None:
        require(num_fragments >= 1, "num_fragments", num_fragments, "must be >= 1")
        self.num_fragments = num_fragments
        self.due = due
        self.sync_every = sync_every
        self.config = config
        self.versions = [0] * num_fragments
        self.next_round_id = [0] * num_fragments
        self.open: dict[int, Round] = {}
        self.waiting: dict[int, dict[tuple[int, int, int], AnswerMeta]] = {}
        self.progress: dict[int, int] = {}  # live learner -> latest local step
        self.global_step = 0
        self.seen: set[tuple[int, int, int]] = set()
        self.merged_base: dict[tuple[int, int, int], int] = {}  # (learner, life, p) -> base
        self.step_time = Ema(config.grace.smoothing)
        self.sync_time = Ema(config.grace.smoothing)
        self.events: list[Supersession | Dropped] = []
        self.finishing = False  # finish() was called: final rounds only, no new ones

    # -- membership and progress ------------------------------------------------------------
    def join(self, learner: int, step: int = 0) -> list[Round]:
        """A learner is live from now on (first start, restart or scavenged join). Returns the
        open rounds it must now be asked for: a round waiting for its quorum (K = M after a
        crash) would otherwise wait for a learner nobody asked."""
        require(step >= 0, "step", step, "must be >= 0")
        self.progress[learner] = step
        for rnd in self.open.values():
            rnd.asked.add(learner)
        return [self.open[p] for p in sorted(self.open)]

    def leave(self, learner: int, now: float) -> None:
        """A learner is gone (crash detected or clean leave); it is no longer waited for."""
        self.progress.pop(learner, None)
        for rnd in self.open.values():
            rnd.asked.discard(learner)

    def on_progress(
        self, learner: int, step: int, now: float, step_seconds: float | None = None
    ) -> list[Round]:
        """Record a learner's progress; return the rounds this opens (ask their ``asked``)."""
        if learner not in self.progress:
            raise ConfigError("learner", learner, "progress from a learner that has not joined")
        require(step >= 0, "step", step, "must be >= 0")
        if step_seconds is not None:
            self.step_time.update(step_seconds)
        self.progress[learner] = max(self.progress[learner], step)
        target = self._kth_fastest()
        opened: list[Round] = []
        if target <= self.global_step or self.finishing:
            return opened
        crossed = range(self.global_step + 1, target + 1)
        self.global_step = target
        due: list[int] = []
        for t in crossed[-self.sync_every :]:  # one pass over H steps covers every fragment
            due.extend(p for p in self.due(t) if p not in due)
        for p in due:
            if p in self.open:  # still waiting for its quorum: ask again, keep the round
                self.open[p].asked |= set(self.progress)
                opened.append(self.open[p])
            else:
                opened.append(self._open(p, now))
        return opened

    def finish(self, now: float, deadline: float) -> list[Round]:
        """The run's end: a final round for every fragment (an open round becomes one),
        asking every live learner, to close when each has answered or at ``deadline``; no
        round opens after. Returns the rounds to ask their ``asked`` for."""
        require(deadline >= now, "deadline", deadline, f"must not be before now ({now})")
        self.finishing = True
        rounds = []
        for p in range(self.num_fragments):
            rnd = self.open.get(p)
            if rnd is None:
                rnd = self._open(p, now)
            else:  # a new id: an answer to the earlier ask rides along but is not final
                rnd.round_id = self.next_round_id[p]
                self.next_round_id[p] += 1
            rnd.asked |= set(self.progress)
            rnd.final_at = deadline
            rounds.append(rnd)
        return rounds

    def _kth_fastest(self) -> int:
        steps = sorted(self.progress.values(), reverse=True)
        if len(steps) < self.config.quorum:
            return self.global_step  # fewer live learners than K: the clock stands still
        return steps[self.config.quorum - 1]

    def _open(self, p: int, now: float) -> Round:
        rnd = Round(p, self.next_round_id[p], self.versions[p], now, set(self.progress))
        rnd.opened_step = self.global_step
        self.next_round_id[p] += 1
        self.open[p] = rnd
        for answer in self.waiting.pop(p, {}).values():
            verdict = self._freshness(answer)  # a held answer may have aged since it arrived
            if verdict is Verdict.ACCEPTED:
                self._admit(rnd, answer, now)
            else:
                self.events.append(Dropped(answer, verdict))
        return rnd

    # -- answers ----------------------------------------------------------------------------
    def on_answer(self, answer: AnswerMeta, now: float) -> Verdict:
        """Judge one answer that has fully arrived."""
        verdict = self.screen(answer)
        if verdict is not Verdict.DUPLICATE:
            self.seen.add(answer.key)
        if verdict is not Verdict.ACCEPTED:
            return verdict
        p = answer.fragment
        rnd = self.open.get(p)
        if rnd is None:
            self.waiting.setdefault(p, {})[answer.key] = answer
            return Verdict.WAITING
        return self._admit(rnd, answer, now)

    def screen(self, answer: AnswerMeta) -> Verdict:
        """What :meth:`on_answer` would say about the answer's metadata, without recording
        anything: DUPLICATE, INVALID, STALE, BASE_ALREADY_MERGED, or ACCEPTED (admissible)."""
        answer.validate(self.num_fragments)
        if answer.key in self.seen:
            return Verdict.DUPLICATE
        p = answer.fragment
        if answer.base_version > self.versions[p] or answer.round_id >= self.next_round_id[p]:
            return Verdict.INVALID
        return self._freshness(answer)

    def refuse(self, answer: AnswerMeta) -> None:
        """The syncer refused an admissible answer on its content: it is seen (a re-push is a
        duplicate) but joins no round."""
        self.seen.add(answer.key)

    def _freshness(self, answer: AnswerMeta) -> Verdict:
        if self.versions[answer.fragment] - answer.base_version > self.config.max_staleness:
            return Verdict.STALE
        life = (answer.learner, answer.incarnation, answer.fragment)
        if self.merged_base.get(life, -1) >= answer.base_version:
            return Verdict.BASE_ALREADY_MERGED
        return Verdict.ACCEPTED

    def _admit(self, rnd: Round, answer: AnswerMeta, now: float) -> Verdict:
        if rnd.final_at is not None and answer.round_id == rnd.round_id:
            rnd.finally_answered.add(answer.learner)  # an answer to the final ask
        for key, other in list(rnd.answers.items()):
            same_life = (other.learner, other.incarnation, other.base_version) == (
                answer.learner,
                answer.incarnation,
                answer.base_version,
            )
            if same_life:
                older, newer = sorted((other, answer), key=lambda a: (a.local_step, a.seq))
                self.events.append(Supersession(older.key, newer.key))
                if older is answer:
                    return Verdict.ACCEPTED  # its tokens ride with the newer answer
                del rnd.answers[key]
        rnd.answers[answer.key] = answer
        if rnd.quorum_at is None and len(rnd.learners) >= self.config.quorum:
            rnd.quorum_at = now
            rnd.grace = grace_window(
                self.config.grace,
                overlap=self.config.overlap,
                step_seconds=self.step_time.value,
                quorum_seconds=now - rnd.opened_at,
                sync_seconds=self.sync_time.value,
            )
        return Verdict.ACCEPTED

    def take_events(self) -> list[Supersession | Dropped]:
        """Supersessions and late drops since the last call, for the ledger and the metrics."""
        out, self.events = self.events, []
        return out

    # -- closing ----------------------------------------------------------------------------
    def ready(self, now: float) -> list[ClosedRound]:
        """Close and return the rounds whose quorum is met and whose grace is over (or whom
        every asked live learner has answered); a final round, when every asked learner has
        answered since it became final, or at its deadline (dropped if nobody answered)."""
        closed = []
        for p in sorted(self.open):
            rnd = self.open[p]
            deadline = rnd.deadline
            if deadline is None:
                continue
            if rnd.final_at is not None:  # any answer counts; with none, nothing to merge
                if not rnd.answers:
                    if now >= deadline or not rnd.asked:  # (everyone left)
                        del self.open[p]
                    continue
                everyone = rnd.asked <= rnd.finally_answered
            else:
                everyone = rnd.asked <= rnd.learners
            if now >= deadline or everyone:
                del self.open[p]
                closed.append(
                    ClosedRound(
                        p,
                        rnd.round_id,
                        rnd.version,
                        tuple(rnd.answers[k] for k in sorted(rnd.answers)),
                        rnd.opened_at,
                        rnd.quorum_at if rnd.quorum_at is not None else now,
                        now,
                        rnd.grace,
                        len(rnd.asked),
                        rnd.opened_step,
                        rnd.final_at is not None,
                    )
                )
        return closed

    def next_deadline(self) -> float | None:
        """The earliest time at which ``ready`` may close a round; None if none is pending."""
        deadlines = [d for r in self.open.values() if (d := r.deadline) is not None]
        return min(deadlines) if deadlines else None

    def on_merged(self, closed: ClosedRound, sync_seconds: float | None = None) -> int:
        """The runtime merged a closed round: bump the fragment's version and return it."""
        p = closed.fragment
        if closed.version != self.versions[p]:
            raise ConfigError("version", closed.version, f"fragment {p} is at {self.versions[p]}")
        for a in closed.answers:
            life = (a.learner, a.incarnation, p)
            self.merged_base[life] = max(self.merged_base.get(life, -1), a.base_version)
        if sync_seconds is not None:
            self.sync_time.update(sync_seconds)
        self.versions[p] += 1
        return self.versions[p]
