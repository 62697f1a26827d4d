"""What the syncer knows and does, without any I/O: global fragments, rounds, merges.

Both runtimes drive this one object: they feed it progress reports, decoded answers and the
time, and send out what it returns (asks and merged fragments). It holds the global fragments
Theta_p in fp32, one outer optimizer per fragment, the round policy and (optionally) the
syncer-side half of the token ledger. With ``robust`` on (the default) an answer is weighed by
what the ledger credited, not what it claims, and its norm is bounded (core/robust.py). Given
the inner learning-rate ``schedule``, the outer momentum follows it (core/outer.py).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Collection, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch

from ddiloco.core.fragment_state import FragmentState, Key
from ddiloco.core.fragments import gather
from ddiloco.core.ledger import OUTLIER, SyncerLedger
from ddiloco.core.merge import MERGE_RULES, merge, tensor_norms
from ddiloco.core.merged import MergeResult
from ddiloco.core.outer import OuterConfig, OuterOptimizer, make_outer_optimizer
from ddiloco.core.plans import FragmentPlan
from ddiloco.core.robust import (
    NormWindow,
    RobustConfig,
    answer_norm,
    clip_scales,
    credited_counters,
    pace,
    refusal,
    scaled,
)
from ddiloco.core.rounds import (
    AnswerMeta,
    ClosedRound,
    Dropped,
    Round,
    RoundConfig,
    RoundPolicy,
    Supersession,
    Verdict,
)
from ddiloco.core.stale import UpdateHistory, anchor_answers, answer_weights
from ddiloco.errors import ConfigError, require

__all__ = ["MergeResult", "SyncerConfig", "SyncerState", "merge_step"]


@dataclass(frozen=True)
class SyncerConfig:
    """The syncer's algorithm settings."""

    rounds: RoundConfig = field(default_factory=RoundConfig)
    merge_rule: str = "rda"
    outer: OuterConfig = field(default_factory=OuterConfig)
    robust: RobustConfig = field(default_factory=RobustConfig)

    def __post_init__(self) -> None:
        require(
            self.merge_rule in MERGE_RULES,
            "merge_rule",
            self.merge_rule,
            f"known: {', '.join(MERGE_RULES)}",
        )


MIN_SCHEDULE_SCALE = 1e-6  # an outer gradient of steps at lr 0 changes no momentum unit
SCHEDULE_SAMPLES = 256  # steps an answer's mean factor is taken over, at most (evenly spread)


def schedule_scale(
    schedule: Callable[[int], float] | None,
    answers: Sequence[AnswerMeta],
    weights: Sequence[float],
) -> float:
    """The inner learning-rate factor of a round's outer gradient: each answer's mean factor
    over the steps its delta covers (``local_step - c_steps`` to ``local_step``), weighted as
    the merge weighs its delta; 1.0 without a schedule."""
    total = sum(weights)
    if schedule is None or total <= 0.0:
        return 1.0
    acc = 0.0
    for a, w in zip(answers, weights, strict=True):
        first = max(0, a.local_step - a.c_steps)
        span = range(first, max(a.local_step, first + 1))
        stride = max(1, len(span) // SCHEDULE_SAMPLES)
        steps = span[::stride]
        acc += w * sum(schedule(s) for s in steps) / len(steps)
    return max(acc / total, MIN_SCHEDULE_SCALE)


def period_fraction(opened_step: int, previous: int | None, sync_every: int) -> float:
    """The share of a sync period (``sync_every`` global steps) since the fragment's previous
    merged round opened, at most 1 (a first round, or one a period or more later: a whole
    outer step). Less only for a round opened sooner: the final rounds (core/outer.py)."""
    if previous is None or opened_step - previous >= sync_every:
        return 1.0
    return max(0.0, (opened_step - previous) / sync_every)


def workspace_views(workspace: torch.Tensor, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """``like``'s shapes laid over the front of a flat merge workspace."""
    views, offset = [], 0
    for t in like:
        views.append(workspace[offset : offset + t.numel()].view(t.shape))
        offset += t.numel()
    return views


@torch.no_grad()
def merge_step(
    fragment: list[torch.Tensor],
    outer: OuterOptimizer,
    deltas: Sequence[Sequence[torch.Tensor]],
    weights: Sequence[float],
    norms: Sequence[Sequence[float]],
    rule: str,
    plain: Sequence[bool],
    workspace: torch.Tensor,
    scale: float = 1.0,
    fraction: float = 1.0,
) -> float:
    """One merge of one fragment: the weighted outer gradient (RDA or mean) of the deltas,
    built in ``workspace``, then the outer step in place at the inner learning-rate factor
    ``scale`` (:func:`schedule_scale`), covering ``fraction`` of a sync period
    (:func:`period_fraction`). Returns the update's L2 norm.

    The one place the merge arithmetic lives: the syncer and any replay of its record (an
    audit, a restarted service) call it, so they get the same bits.
    """
    if sum(weights) <= 0.0:
        return 0.0
    merged = merge(
        deltas,
        weights,
        rule,
        plain,
        norms=norms,
        out=workspace_views(workspace, fragment),
        scale=-1.0,  # outer gradient = Theta_base - theta = -delta
    )
    norm = math.sqrt(sum(n * n for n in tensor_norms(merged)))
    outer.step(fragment, merged, scale, fraction)  # may consume ``merged``: the norm is taken first
    return norm


@dataclass
class Held:
    """An accepted answer waiting for its merge: its delta, its tensors' norms (computed
    once, on arrival) and, under robust merging, its pace (norm / sqrt(credited steps))."""

    delta: Sequence[torch.Tensor]  # (a list, or the wire's bytes: :class:`PackedTensors`)
    norms: list[float]
    pace: float | None = None


class SyncerState:
    """The syncer's pure state machine."""

    def __init__(
        self,
        plan: FragmentPlan,
        initial: Mapping[str, torch.Tensor],
        config: SyncerConfig,
        *,
        plain_tensors: Collection[str] = (),
        ledger: SyncerLedger | None = None,
        schedule: Callable[[int], float] | None = None,
        share_initial: bool = False,
    ) -> None:
        """``schedule``: the inner learning-rate factor (lr / peak lr) at an inner step, for
        an outer momentum that follows it; None: plain outer steps. ``share_initial``: the
        global values are ``initial``'s own tensors (CPU fp32 ones), merged in place, not a
        copy: a caller that keeps no other use for them saves one fp32 model."""
        self.plan = plan
        self.config = config
        self.schedule = schedule
        self._policy = RoundPolicy(plan.num_fragments, plan.due, plan.sync_every, config.rounds)
        with torch.no_grad():
            self.fragments = [
                [
                    t.detach().to("cpu", torch.float32, copy=not share_initial)
                    for t in gather(plan, p, initial)
                ]
                for p in range(plan.num_fragments)
            ]
        self.plain_mask = [
            [s.name in plain_tensors for s in frag.slices] for frag in plan.fragments
        ]
        self.outer: list[OuterOptimizer] = [
            make_outer_optimizer(config.outer) for _ in range(plan.num_fragments)
        ]
        self.ledger = ledger
        self.held: dict[tuple[int, int, int], Held] = {}  # accepted answers, until merged
        largest = max(sum(t.numel() for t in frag) for frag in self.fragments)
        self._workspace = torch.empty(largest, dtype=torch.float32)  # reused by every merge
        self.counts: dict[str, int] = {}
        self.norm_windows = [NormWindow(config.robust.norm_window) for _ in self.fragments]
        self.param_norms = [answer_norm(tensor_norms(f)) for f in self.fragments]  # ||Theta_p||
        # per fragment: the global step its last merged round opened at (None: none yet, or
        # not since a restart: the next outer step is a whole one)
        self._merged_opened: list[int | None] = [None] * plan.num_fragments
        # the last updates of each fragment, to anchor late answers on the current value
        self._history = (
            UpdateHistory(plan.num_fragments, config.rounds.max_staleness)
            if config.rounds.anchor == "current"
            else None
        )

    @property
    def versions(self) -> list[int]:
        return self._policy.versions

    # -- membership and what runtimes read: the one door (the round policy stays inside) ----
    def join(self, learner: int, step: int = 0) -> list[Round]:
        """A learner (re)joins at ``step``; returns the open rounds to ask it for."""
        return self._policy.join(learner, step)

    def leave(self, learner: int, now: float) -> None:
        """A learner left, crashed or was given up on: its held answers stay (they may merge)."""
        self._policy.leave(learner, now)

    @property
    def live(self) -> Mapping[int, int]:
        """The live learners and the step each last reported (read-only)."""
        return MappingProxyType(self._policy.progress)

    @property
    def global_step(self) -> int:
        return self._policy.global_step

    @property
    def open_rounds(self) -> Mapping[int, Round]:
        """Fragment -> its open round (read-only)."""
        return MappingProxyType(self._policy.open)

    def is_held(self, key: tuple[int, int, int]) -> bool:
        """Whether the answer ``key`` waits for a merge (accepted, not merged or dropped)."""
        return key in self.held

    def has_seen(self, key: tuple[int, int, int]) -> bool:
        """Whether the answer ``key`` came before (merged, held or dropped): a re-push."""
        return key in self._policy.seen

    def next_round_id(self, p: int) -> int:
        return self._policy.next_round_id[p]

    @property
    def step_seconds(self) -> float | None:
        """The fleet's step time (an EMA of the reports), None before the first."""
        return self._policy.step_time.value

    def merged_bases(self, p: int) -> dict[tuple[int, int], int]:
        """(learner, incarnation) -> the highest base version of theirs merged into ``p``."""
        return {(m, inc): b for (m, inc, q), b in self._policy.merged_base.items() if q == p}

    def clock_state(self) -> tuple[int, float | None, float | None]:
        """(global step, step-time EMA, sync-time EMA): the syncer clock's durable state."""
        policy = self._policy
        return policy.global_step, policy.step_time.value, policy.sync_time.value

    def load_clock(
        self, global_step: int, step_seconds: float | None = None, sync_seconds: float | None = None
    ) -> None:
        """Put the syncer clock back where :meth:`clock_state` was (a restart, a resume)."""
        self._policy.global_step = global_step
        if step_seconds is not None:
            self._policy.step_time.value = step_seconds
        if sync_seconds is not None:
            self._policy.sync_time.value = sync_seconds

    # -- inputs -----------------------------------------------------------------------------
    def on_progress(
        self, learner: int, step: int, now: float, step_seconds: float | None = None
    ) -> list[Round]:
        """A learner's progress report; returns the rounds to ask learners for."""
        opened = self._policy.on_progress(learner, step, now, step_seconds)
        self._apply_events()  # held answers that joined (or aged out of) the new rounds
        return opened

    def finish(self, now: float, deadline: float) -> list[Round]:
        """The run's end: the final rounds (:meth:`RoundPolicy.finish`), to ask learners for."""
        rounds = self._policy.finish(now, deadline)
        self._apply_events()  # held answers that joined (or aged out of) the final rounds
        return rounds

    @property
    def finished(self) -> bool:
        """After :meth:`finish`: every final round has closed."""
        return self._policy.finishing and not self._policy.open

    def on_answer(
        self,
        meta: AnswerMeta,
        delta: Sequence[torch.Tensor],
        now: float,
        *,
        keep: Sequence[torch.Tensor] | None = None,
    ) -> Verdict:
        """A learner's decoded answer: ``delta`` = theta_learner - Theta_base, per slice.
        ``keep``: what to hold until the merge in place of ``delta``, the same values in a
        smaller form, read one tensor at a time (the answer's bytes as they came,
        :class:`~ddiloco.core.codec.PackedTensors`: an answer waiting for its round then
        costs the syncer its encoded size, not fp32; issue 28)."""
        meta.validate(self.plan.num_fragments)
        self._check_delta(meta.fragment, delta)
        if keep is not None and len(keep) != len(delta):
            raise ConfigError("keep", len(keep), f"the delta has {len(delta)} tensors")
        norms: list[float] | None = None
        rate = 0.0
        if self.config.robust.enabled and self._policy.screen(meta) is Verdict.ACCEPTED:
            meta, steps = self._credited(meta)
            norms = tensor_norms(delta)  # while the data is hot in cache
            p, length = meta.fragment, answer_norm(norms)
            rate = pace(length, steps)
            why = refusal(
                self.config.robust, length, steps, self.param_norms[p], self.norm_windows[p]
            )
            if why is not None:
                self._policy.refuse(meta)
                self._count(Verdict.OUTLIER.value)
                self._count(f"outlier_{why}")
                if self.ledger is not None:
                    self.ledger.wasted_answer(meta.key, OUTLIER)
                return Verdict.OUTLIER
        verdict = self._policy.on_answer(meta, now)
        self._count(verdict.value)
        if verdict in (Verdict.ACCEPTED, Verdict.WAITING):
            computed = norms if norms is not None else tensor_norms(delta)
            kept = list(delta) if keep is None else keep
            self.held[meta.key] = Held(kept, computed, rate if norms is not None else None)
        elif verdict is not Verdict.DUPLICATE and self.ledger is not None:
            self.ledger.wasted_answer(meta.key, verdict.value)
        self._apply_events()
        return verdict

    def _credited(self, meta: AnswerMeta) -> tuple[AnswerMeta, int]:
        """The answer with its counters capped by the ledger's credit (robust.credited_counters)
        and the steps its pace is taken over (never more than the credited ones). The capped
        counters travel on in the round, so weights, records and replays agree. The runtime
        records the answer in the ledger first (``answered``); if the ledger refused its
        counters, what it credited the learner since base at this moment bounds them."""
        if self.ledger is None:
            return meta, meta.c_steps  # nothing to check against (unit tests): claims stand
        credit = self.ledger.credit(meta.key)
        if credit is None:
            credit = self.ledger.since_base(meta.learner, meta.fragment)
        tokens, steps = credited_counters(meta.c_tokens, meta.c_steps, *credit)
        pace_steps = min(steps, credit[1]) if credit[1] > 0 else steps
        if (tokens, steps) == (meta.c_tokens, meta.c_steps):
            return meta, pace_steps
        self._count("capped")
        return dataclasses.replace(meta, c_tokens=tokens, c_steps=steps), pace_steps

    def _at_credited_step(self, answer: AnswerMeta) -> AnswerMeta:
        """The answer as of the step its learner is credited with (its progress reports,
        bounded by core/credit.py under processes), not the step it claims: a learner's
        claim never picks the schedule factor its delta is merged at."""
        step = self._policy.progress.get(answer.learner)
        if step is None:  # (gone since it answered)
            step = min(answer.local_step, self._policy.global_step)
        return dataclasses.replace(answer, local_step=step)

    def _check_delta(self, p: int, delta: Sequence[torch.Tensor]) -> None:
        expected = self.fragments[p]
        if len(delta) != len(expected):
            raise ConfigError("delta", len(delta), f"fragment {p} has {len(expected)} tensors")
        for i, (d, e) in enumerate(zip(delta, expected, strict=True)):
            if d.shape != e.shape:
                raise ConfigError(f"delta[{i}].shape", tuple(d.shape), f"expected {tuple(e.shape)}")
            if not d.is_floating_point():
                raise ConfigError(f"delta[{i}].dtype", d.dtype, "expected a float tensor")
            if not bool(torch.isfinite(d).all()):
                raise ConfigError(f"delta[{i}]", "non-finite", "NaN/Inf update refused")

    def _apply_events(self) -> None:
        for event in self._policy.take_events():
            if isinstance(event, Supersession):
                self.held.pop(event.old, None)
                self._count("superseded")
                if self.ledger is not None:
                    self.ledger.superseded(event.old, event.new)
            elif isinstance(event, Dropped):
                self.held.pop(event.answer.key, None)
                self._count(event.verdict.value)
                if self.ledger is not None:
                    self.ledger.wasted_answer(event.answer.key, event.verdict.value)

    # -- merging ----------------------------------------------------------------------------
    def poll(
        self, now: float, writing: Callable[[], AbstractContextManager[Any]] = nullcontext
    ) -> list[MergeResult]:
        """Merge every round that is ready at ``now``; return the fragments to broadcast.
        Each merge runs inside ``writing()`` (the processes' syncer keeps an evaluation that
        reads the global values in place out of a merge that way; entered only when a round
        merges).

        Call order: the caller books each result (:meth:`MergeResult.book`) before anyone
        hears of it: at once on the simulated clock; the processes' syncer books, writes it
        to disk, then broadcasts (docs/design.md §6.1)."""
        results = []
        for closed in self._policy.ready(now):
            with writing():
                results.append(self._merge(closed))
        self._apply_events()
        return results

    @torch.no_grad()
    def _merge(self, closed: ClosedRound) -> MergeResult:
        p = closed.fragment
        rounds = self.config.rounds
        stale = [closed.version - a.base_version for a in closed.answers]
        for _ in range(sum(1 for s in stale if s > 0)):
            self._count("late")  # merged on a base older than the version it replaced
        counters = [(a.c_tokens, a.c_steps) for a in closed.answers]
        weights = answer_weights(counters, stale, rounds.stale_weight)
        held = [self.held.pop(a.key) for a in closed.answers]
        deltas = [h.delta for h in held]
        norms = [h.norms for h in held]
        anchored: list[bool] = []
        if self._history is not None:
            bases = [a.base_version for a in closed.answers]
            anchored = anchor_answers(self._history, p, closed.version, bases, deltas, norms)
            for _ in range(sum(anchored)):
                self._count("anchored")
        scales = [1.0] * len(deltas)
        if self.config.robust.enabled:
            scales = self._clip(p, closed, weights, deltas, norms, [h.pace for h in held])
        per_learner: dict[int, float] = {}
        for a, w in zip(closed.answers, weights, strict=True):
            per_learner[a.learner] = per_learner.get(a.learner, 0.0) + w
        spans = [self._at_credited_step(a) for a in closed.answers]
        factor = schedule_scale(self.schedule, spans, weights)
        fraction = (
            0.0
            if closed.final
            else period_fraction(closed.opened_step, self._merged_opened[p], self.plan.sync_every)
        )
        before = None if self._history is None else self._history.before(self.fragments[p])
        update_norm = merge_step(
            self.fragments[p],
            self.outer[p],
            deltas,
            weights,
            norms,
            self.config.merge_rule,
            self.plain_mask[p],
            self._workspace,
            factor,
            fraction,
        )
        version = self._policy.on_merged(closed)
        if self._history is not None:
            self._history.after(p, version, before, self.fragments[p])
        self._merged_opened[p] = closed.opened_step
        self._count("merged_rounds")
        if self.config.robust.enabled:
            self.param_norms[p] = answer_norm(tensor_norms(self.fragments[p]))
        return MergeResult(
            p,
            version,
            self.fragments[p],
            closed,
            per_learner,
            update_norm,
            tuple(scales),
            factor,
            fraction,
            tuple((a.key, w) for a, w in zip(closed.answers, weights, strict=True)),
            tuple(anchored),
        )

    def _clip(
        self,
        p: int,
        closed: ClosedRound,
        weights: Sequence[float],
        deltas: list[Sequence[torch.Tensor]],
        norms: list[list[float]],
        paces: list[float | None],
    ) -> list[float]:
        """Scale the round's too-fast answers down in place of ``deltas``/``norms``
        (robust.clip_scales), then add the round's paces to the fragment's window."""
        window = self.norm_windows[p]
        learners = [a.learner for a in closed.answers]
        assert all(x is not None for x in paces), "robust merging measured every answer's pace"
        known = [x for x in paces if x is not None]
        scales, added = clip_scales(self.config.robust, known, learners, weights, window)
        for i, s in enumerate(scales):
            if s < 1.0:
                deltas[i] = scaled(deltas[i], s)
                norms[i] = tensor_norms(deltas[i])
                self._count("clipped")
        for n in added:
            window.add(n)
        return scales

    @torch.no_grad()
    def fragment_state(self, p: int, applied: Sequence[Key] = ()) -> FragmentState:
        """Fragment ``p``'s durable state (reading only; the values and the outer state are
        the syncer's own tensors: copy what must outlive the next merge). ``applied`` is
        every answer key merged into it so far: the core forgets merged ids, the caller that
        must not merge one twice after a restart keeps them."""
        policy = self._policy
        return FragmentState(
            version=policy.versions[p],
            next_round_id=policy.next_round_id[p],
            values=self.fragments[p],
            outer=self.outer[p].state_dict(),
            applied=list(applied),
            merged_base=self.merged_bases(p),
            norm_window=list(self.norm_windows[p].values),
            merged_opened=self._merged_opened[p],
        )

    def load_fragment(self, p: int, state: FragmentState) -> None:
        """Put fragment ``p`` back where :meth:`fragment_state` was (a restarted syncer, a
        resumed run): values, outer optimizer, version, round ids, the answers already merged
        (none is merged twice), the norms of recent merges (empty: the bound warms up again)
        and the outer step's period clock."""
        shapes = [tuple(t.shape) for t in self.fragments[p]]
        require(
            [tuple(t.shape) for t in state.values] == shapes,
            f"fragment-{p}",
            "shapes",
            "do not match this model's plan",
        )
        for dst, src in zip(self.fragments[p], state.values, strict=True):
            dst.copy_(src)
        if self._history is not None:
            self._history.forget(p)
        self.param_norms[p] = answer_norm(tensor_norms(self.fragments[p]))
        self.norm_windows[p].load(state.norm_window)
        self.outer[p].load_state_dict(dict(state.outer))
        self._policy.versions[p] = state.version
        self._policy.next_round_id[p] = state.next_round_id
        self._policy.seen.update(state.applied)
        for (learner, incarnation), base in state.merged_base.items():
            self._policy.merged_base[(learner, incarnation, p)] = base
        if state.merged_opened is not None:
            self._merged_opened[p] = state.merged_opened

    def record_sync_time(self, seconds: float) -> None:
        """Merge + broadcast duration measured by the runtime, for the grace window."""
        self._policy.sync_time.update(seconds)

    def next_deadline(self) -> float | None:
        return self._policy.next_deadline()

    def _count(self, name: str) -> None:
        self.counts[name] = self.counts.get(name, 0) + 1
