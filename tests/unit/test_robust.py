"""Robust merging: weights from the ledger's credit, bounded answer norms, progress credit."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ddiloco.config import load_config
from ddiloco.config_sync import RobustMergeConfig, SyncConfig
from ddiloco.core.ledger import OUTLIER, TokenLedger
from ddiloco.core.merge import tensor_norms, token_weight
from ddiloco.core.outer import OuterConfig, make_outer_optimizer
from ddiloco.core.plans import TensorSpec, build_plan
from ddiloco.core.restart_ledger import RestartLedger
from ddiloco.core.robust import (
    NormWindow,
    RobustConfig,
    answer_norm,
    clip_scales,
    credit_progress,
    credited_counters,
    lower_median,
    pace,
    scaled,
)
from ddiloco.core.rounds import AnswerMeta, RoundConfig, Verdict
from ddiloco.core.syncer_state import MergeResult, SyncerConfig, SyncerState, merge_step
from ddiloco.errors import ConfigError

SPECS = [
    TensorSpec("blocks.0.w", (8, 4), 4),
    TensorSpec("blocks.1.w", (8, 4), 4),
]
TOKENS = 64  # per step
STEPS = 4  # per round


def _params() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {s.name: torch.randn(s.shape, generator=g) for s in SPECS}


class Bench:
    """A syncer with ``learners`` learners, rounds for fragment 0 only, a ledger fed as a
    runtime feeds it, and the learners' bookkeeping (bases, counters, sequence numbers)."""

    def __init__(
        self,
        learners: int = 4,
        ledger: TokenLedger | None = None,
        robust: RobustConfig | None = None,
        quorum: int = 1,
    ) -> None:
        plan = build_plan(SPECS, 1, "tensor", sync_every=STEPS)
        cfg = SyncerConfig(
            RoundConfig(quorum=quorum),
            "rda",
            OuterConfig("sgd", lr=1.0),
            robust if robust is not None else RobustConfig(),
        )
        self.syncer = SyncerState(plan, _params(), cfg, ledger=ledger)
        self.ledger = ledger
        self.m = learners
        self.step = 0
        self.seq = [0] * learners
        self.base = [0] * learners
        self.c_steps = [0] * learners
        for m in range(learners):
            self.syncer.join(m)
        self.now = 0.0
        self.last: AnswerMeta | None = None

    def train(self) -> int:
        """Every learner takes STEPS steps; returns the round id opened for fragment 0."""
        opened = []
        for _ in range(STEPS):
            self.step += 1
            for m in range(self.m):
                self.c_steps[m] += 1
                if self.ledger is not None:
                    self.ledger.trained(m, TOKENS)
                opened += self.syncer.on_progress(m, self.step, self.now, step_seconds=1.0)
        (rnd,) = {r.round_id: r for r in opened}.values()
        return rnd.round_id

    def delta(self, m: int, scale: float = 0.01) -> list[torch.Tensor]:
        g = torch.Generator().manual_seed(1000 * self.step + m)
        return [torch.randn(t.shape, generator=g) * scale for t in self.syncer.fragments[0]]

    def answer(
        self,
        m: int,
        rnd: int,
        delta: list[torch.Tensor],
        c_tokens: int | None = None,
        c_steps: int | None = None,
    ) -> Verdict:
        steps = self.c_steps[m] if c_steps is None else c_steps
        tokens = self.c_steps[m] * TOKENS if c_tokens is None else c_tokens
        meta = AnswerMeta(m, 0, self.seq[m], 0, rnd, self.base[m], self.step, steps, tokens)
        self.seq[m] += 1
        self.last = meta
        if self.ledger is not None:
            self.ledger.answered(m, 0, meta.key, tokens)
        return self.syncer.on_answer(meta, delta, self.now)

    def merge(self) -> MergeResult:
        self.now += 100.0  # past any grace window
        (result,) = self.syncer.poll(self.now)
        result.book(self.ledger)
        for m in range(self.m):
            self.base[m] = result.version
            self.c_steps[m] = 0
            if self.ledger is not None:
                self.ledger.rebased(m, 0)
        return result

    def honest_round(self, liar: int | None = None) -> MergeResult:
        rnd = self.train()
        for m in range(self.m):
            if m != liar:
                assert self.answer(m, rnd, self.delta(m)) is Verdict.ACCEPTED
        return self.merge()


def _fragment(bench: Bench) -> list[torch.Tensor]:
    return [t.clone() for t in bench.syncer.fragments[0]]


def _distance(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return math.sqrt(sum(float((x - y).square().sum()) for x, y in zip(a, b, strict=True)))


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


# -- weights from the ledger's credit -------------------------------------------------------
def test_a_claim_of_10e12_tokens_weighs_no_more_than_its_credited_tokens():
    """The processes runtime's ledger refuses the claim (it counts an error); the syncer then
    weighs the answer by what the ledger credited the learner since its base."""
    ledger = RestartLedger(1)
    bench = Bench(ledger=ledger)
    rnd = bench.train()
    for m in range(3):
        bench.answer(m, rnd, bench.delta(m))
    assert bench.answer(3, rnd, bench.delta(3), c_tokens=10**12) is Verdict.ACCEPTED
    result = bench.merge()
    assert ledger.errors == 2  # the refused claim, then its merge: the ledger never held it
    honest = token_weight(STEPS * TOKENS, STEPS)
    assert result.weights == {0: honest, 1: honest, 2: honest, 3: honest}
    assert bench.syncer.counts["capped"] == 1
    liar = next(a for a in result.round.answers if a.learner == 3)
    assert (liar.c_tokens, liar.c_steps) == (STEPS * TOKENS, STEPS)  # what the round records


def test_claiming_one_step_for_many_steps_tokens_buys_no_extra_weight():
    bench = Bench(ledger=TokenLedger(1))
    rnd = bench.train()
    for m in range(3):
        bench.answer(m, rnd, bench.delta(m))
    bench.answer(3, rnd, bench.delta(3), c_steps=1)  # tokens honest, steps understated
    result = bench.merge()
    assert result.weights[3] == result.weights[0] == token_weight(STEPS * TOKENS, STEPS)


def test_an_answer_claiming_less_than_its_credit_keeps_its_claim():
    bench = Bench(ledger=TokenLedger(1))
    rnd = bench.train()
    bench.answer(0, rnd, bench.delta(0), c_tokens=TOKENS, c_steps=1)
    assert bench.merge().weights == {0: token_weight(TOKENS, 1)}
    assert "capped" not in bench.syncer.counts


def test_without_a_ledger_or_with_robust_off_the_claim_stands():
    for bench in (Bench(), Bench(ledger=RestartLedger(1), robust=RobustConfig(enabled=False))):
        rnd = bench.train()
        bench.answer(0, rnd, bench.delta(0))
        bench.answer(1, rnd, bench.delta(1), c_tokens=10**12)
        result = bench.merge()
        assert result.weights[1] == token_weight(10**12, STEPS)
        assert result.weights[1] / sum(result.weights.values()) > 0.999  # the old exposure


@settings(max_examples=300, deadline=None)
@given(
    c_tokens=st.integers(0, 10**15),
    c_steps=st.integers(0, 10**6),
    credit_tokens=st.integers(0, 10**7),
    credit_steps=st.integers(1, 10**4),
)
def test_credited_counters_never_weigh_more_than_the_credit(
    c_tokens, c_steps, credit_tokens, credit_steps
):
    tokens, steps = credited_counters(c_tokens, c_steps, credit_tokens, credit_steps)
    assert 0 <= tokens <= min(c_tokens, credit_tokens) and steps >= c_steps
    bound = token_weight(credit_tokens, credit_steps)
    assert token_weight(tokens, steps) <= bound * (1 + 1e-12)
    assert credited_counters(credit_tokens, credit_steps, credit_tokens, credit_steps) == (
        credit_tokens,
        credit_steps,
    )


def test_the_ledger_keeps_credits_through_its_plain_state():
    ledger = TokenLedger(2)
    ledger.trained_steps(0, 300, 3)
    ledger.trained(0, 100)
    ledger.answered(0, 1, (0, 0, 0), 400)
    assert ledger.credit((0, 0, 0)) == (400, 4) and ledger.since_base(0, 1) == (400, 4)
    copy = TokenLedger.from_state(ledger.to_state())
    assert copy.credit((0, 0, 0)) == (400, 4) and copy.since_base(0, 0) == (400, 4)
    old = ledger.to_state()  # a state written before credits were kept
    old["answers"] = [row[:4] for row in old["answers"]]
    del old["steps_since_base"]
    assert TokenLedger.from_state(old).credit((0, 0, 0)) == (400, 0)
    ledger.rebased(0, 1)
    assert ledger.since_base(0, 1) == (0, 0) and ledger.credit((0, 0, 0)) == (400, 4)
    with pytest.raises(ConfigError, match="steps"):
        ledger.trained_steps(0, 1, -1)


# -- norm bounds ----------------------------------------------------------------------------
def test_a_1e6_delta_is_refused_and_the_fragment_is_the_honest_merge():
    attacked, honest = Bench(ledger=TokenLedger(1)), Bench(ledger=TokenLedger(1))
    for bench in (attacked, honest):
        bench.honest_round()  # one warm round: the window holds 4 samples
    rnd = attacked.train()
    honest.train()
    for m in range(3):
        attacked.answer(m, rnd, attacked.delta(m))
        honest.answer(m, rnd, honest.delta(m))
    huge = [t * 1e8 for t in attacked.delta(3)]  # 1e6 x the fragment's own norm
    assert attacked.answer(3, rnd, huge) is Verdict.OUTLIER
    assert attacked.last is not None  # the same answer re-pushed is a duplicate, not judged
    assert attacked.syncer.on_answer(attacked.last, huge, attacked.now) is Verdict.DUPLICATE
    got, want = attacked.merge(), honest.merge()
    assert all(torch.isfinite(t).all() for t in got.tensors) and _same(got.tensors, want.tensors)
    counts = attacked.syncer.counts
    assert counts["outlier"] == 1 and counts["outlier_absurd"] == 1
    assert attacked.ledger is not None and attacked.ledger.wasted[OUTLIER] == [STEPS * TOKENS]


@pytest.mark.parametrize("warm", [False, True])
def test_without_the_absurd_bound_a_1e6_delta_is_still_bounded(warm):
    """Warm: refused against the window; a fragment's first round: clipped against the round's
    own median. Either way the fragment stays finite and within norm_clip of the honest one."""
    config = RobustConfig(norm_absurd=1e30)
    attacked, honest = Bench(robust=config), Bench(robust=config)
    for bench in (attacked, honest):
        if warm:
            bench.honest_round()
    start = _fragment(honest)
    rnd = attacked.train()
    honest.train()
    for m in range(3):
        attacked.answer(m, rnd, attacked.delta(m))
        honest.answer(m, rnd, honest.delta(m))
    verdict = attacked.answer(3, rnd, [t * 1e8 for t in attacked.delta(3)])
    assert verdict is (Verdict.OUTLIER if warm else Verdict.ACCEPTED)
    got, want = attacked.merge().tensors, honest.merge().tensors
    assert all(torch.isfinite(t).all() for t in got)
    gap, step = _distance(got, want), _distance(want, start)
    assert gap <= (0.0 if warm else config.norm_clip) * step


def test_a_long_delta_is_clipped_to_norm_clip_times_the_reference_or_refused():
    config = RobustConfig(norm_clip=4.0, norm_refuse=32.0, norm_absurd=1e6)
    bench = Bench(ledger=TokenLedger(1), robust=config)
    bench.honest_round()
    window = bench.syncer.norm_windows[0]
    assert len(window) == 4
    rnd = bench.train()
    for m in range(3):
        bench.answer(m, rnd, bench.delta(m))
    before = _fragment(bench)
    assert bench.answer(3, rnd, bench.delta(3, scale=0.01 * 10)) is Verdict.ACCEPTED
    result = bench.merge()
    assert bench.syncer.counts["clipped"] == 1
    assert [s < 1.0 for s in result.scales] == [False, False, False, True]
    moved = _distance(result.tensors, before)
    honest_norm = max(answer_norm(tensor_norms(bench.delta(m))) for m in range(3))
    assert moved <= 2.0 * honest_norm  # RDA: the radius is a weighted mean of clipped norms
    rnd = bench.train()
    assert bench.answer(3, rnd, bench.delta(3, scale=0.01 * 100)) is Verdict.OUTLIER
    assert bench.syncer.counts["outlier_too_fast"] == 1


def test_a_first_round_liar_is_clipped_by_the_rounds_own_median():
    bench = Bench(ledger=TokenLedger(1), robust=RobustConfig(norm_absurd=1e6))
    rnd = bench.train()
    bench.answer(0, rnd, bench.delta(0))
    assert bench.answer(1, rnd, bench.delta(1, scale=1.0)) is Verdict.ACCEPTED  # 100x
    result = bench.merge()
    assert result.scales[0] == 1.0 and result.scales[1] < 0.1
    assert bench.syncer.counts["clipped"] == 1


def test_a_zero_delta_claiming_many_steps_does_not_freeze_the_fragment():
    def attack(robust: bool) -> float:
        bench = Bench(robust=RobustConfig(enabled=robust))  # no ledger: the claim stands
        rnd = bench.train()
        for m in range(3):
            bench.answer(m, rnd, bench.delta(m))
        zero = [torch.zeros_like(t) for t in bench.syncer.fragments[0]]
        verdict = bench.answer(3, rnd, zero, c_tokens=10**12, c_steps=10**6)
        assert verdict is (Verdict.OUTLIER if robust else Verdict.ACCEPTED)
        before = _fragment(bench)
        after = bench.merge().tensors
        return _distance(after, before)

    honest = Bench()
    before = _fragment(honest)
    moved = honest.honest_round(liar=3).tensors
    want = _distance(moved, before)
    assert attack(robust=True) == pytest.approx(want, rel=1e-6)
    assert attack(robust=False) < 1e-3 * want  # what the unchecked merge lets one answer do


def test_before_warmup_only_the_absurd_bound_refuses():
    config = RobustConfig(norm_warmup=3, norm_absurd=4.0)
    bench = Bench(learners=1, robust=config)
    rnd = bench.train()
    big = [t * 3.0 for t in bench.syncer.fragments[0]]  # 3 x ||Theta||: accepted
    assert bench.answer(0, rnd, big) is Verdict.ACCEPTED
    assert bench.merge().scales == (1.0,)  # one answer, a cold window: nothing to clip against
    rnd = bench.train()
    absurd = [t * 5.0 for t in bench.syncer.fragments[0]]
    assert bench.answer(0, rnd, absurd) is Verdict.OUTLIER
    assert bench.syncer.counts["outlier_absurd"] == 1


def test_the_window_keeps_the_last_samples_and_its_lower_median():
    window = NormWindow(3)
    assert window.median() is None
    for v in (5.0, 1.0, 2.0, 3.0, 4.0):
        window.add(v)
    assert list(window.values) == [2.0, 3.0, 4.0] and window.median() == 3.0
    window.load([1.0, 10.0])
    assert window.median() == 1.0  # of an even count, the lower one: half must lie to move it
    assert lower_median([]) is None and lower_median([2.0, 1.0, 3.0, 100.0]) == 2.0
    with pytest.raises(ConfigError):
        window.load([float("nan")])


def test_clip_scales_take_one_sample_per_learner_and_ignore_weightless_answers():
    config = RobustConfig(norm_clip=2.0, norm_warmup=3)
    window = NormWindow(8)
    scales, added = clip_scales(config, [1.0, 50.0, 1.2], [0, 1, 2], [1.0, 1.0, 1.0], window)
    assert scales[0] == scales[2] == 1.0 and scales[1] == pytest.approx(2.4 / 50.0)
    assert added == [1.0, pytest.approx(2.4), 1.2]
    # a liar answering three times and a weightless answer: one sample each, weighted ones only
    paces, learners = [1.0, 1.1, 9.0, 9.0, 9.0, 50.0], [0, 2, 1, 1, 1, 3]
    scales, added = clip_scales(config, paces, learners, [1.0] * 5 + [0.0], window)
    assert scales[:2] == [1.0, 1.0] and scales[2:5] == [pytest.approx(2.2 / 9.0)] * 3
    assert added == [1.0, pytest.approx(2.2), 1.1]
    # a warm window holds the reference up when a round has a single (slow) answer
    for v in (1.0, 1.0, 1.0):
        window.add(v)
    assert clip_scales(config, [0.01], [0], [1.0], window)[0] == [1.0]
    assert clip_scales(config, [5.0], [0], [1.0], window)[0] == [pytest.approx(0.4)]
    # below warmup and with one answer nothing is clipped
    assert clip_scales(config, [5.0], [0], [1.0], NormWindow(8))[0] == [1.0]


def test_robust_off_is_the_unchecked_merge_and_on_equals_it_for_honest_answers():
    """robust = false: the claimed weights and raw deltas of the old merge, liars included;
    robust = true: bit for bit the same fragments while nothing is clipped."""
    fragments = {}
    for robust in (True, False):
        bench = Bench(ledger=TokenLedger(1), robust=RobustConfig(enabled=robust))
        for _ in range(5):
            bench.honest_round()
        fragments[robust] = _fragment(bench)
        assert not {"clipped", "outlier", "capped"} & set(bench.syncer.counts)
    assert _same(fragments[True], fragments[False])
    bench = Bench(ledger=RestartLedger(1), robust=RobustConfig(enabled=False))
    start = _fragment(bench)
    rnd = bench.train()
    deltas = [bench.delta(0), [t * 1e6 for t in bench.delta(1)]]
    bench.answer(0, rnd, deltas[0])
    bench.answer(1, rnd, deltas[1], c_tokens=10**12, c_steps=1)
    result = bench.merge()
    weights = [token_weight(STEPS * TOKENS, STEPS), token_weight(10**12, 1)]
    workspace = torch.empty(sum(t.numel() for t in start))
    norms = [tensor_norms(d) for d in deltas]
    merge_step(
        start,
        make_outer_optimizer(OuterConfig("sgd", lr=1.0)),
        deltas,
        weights,
        norms,
        "rda",
        [False, False],
        workspace,
    )
    assert _same(result.tensors, start)


def test_a_replay_with_the_recorded_scales_and_counters_gets_the_same_bits():
    """What an audit of the merge record needs: the round's (credited) counters and scales."""
    bench = Bench(ledger=RestartLedger(1), robust=RobustConfig(norm_absurd=1e6))
    start = _fragment(bench)
    rnd = bench.train()
    deltas = [bench.delta(0), bench.delta(1), bench.delta(2, scale=1.0)]
    for m, d in enumerate(deltas):
        bench.answer(m, rnd, d, c_tokens=10**9 if m == 2 else None)
    result = bench.merge()
    assert result.scales[2] < 1.0 and bench.syncer.counts["capped"] == 1
    weights = [token_weight(a.c_tokens, a.c_steps) for a in result.round.answers]
    replayed = [scaled(d, s) if s < 1.0 else d for d, s in zip(deltas, result.scales, strict=True)]
    workspace = torch.empty(sum(t.numel() for t in start))
    merge_step(
        start,
        make_outer_optimizer(OuterConfig("sgd", lr=1.0)),
        replayed,
        weights,
        [tensor_norms(d) for d in replayed],
        "rda",
        [False, False],
        workspace,
    )
    assert _same(result.tensors, start)


def test_a_restored_fragment_keeps_its_window():
    bench = Bench(ledger=TokenLedger(1))
    bench.honest_round()
    syncer, other = bench.syncer, Bench().syncer
    state = syncer.fragment_state(0)
    other.load_fragment(0, state)
    assert list(other.norm_windows[0].values) == list(syncer.norm_windows[0].values)
    assert other.param_norms[0] == syncer.param_norms[0]
    other.load_fragment(0, dataclasses.replace(state, norm_window=[]))
    assert len(other.norm_windows[0]) == 0  # an older record: the bound warms up again


# -- progress credit ------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("last", "step", "tokens", "max_steps", "want"),
    [
        (10, 11, 64, 5, (1, 64)),  # an honest step
        (10, 13, 3 * 64, 5, (3, 192)),  # a report covering three steps
        (10, 11, 10**12, 5, (1, 64)),  # tokens beyond one step's batch: one step's worth
        (10, 10**9, 10**12, 5, (5, 320)),  # a huge jump: at most max_steps
        (10, 10**9, 10**12, math.inf, (10**9 - 10, (10**9 - 10) * 64)),  # no time bound
        (10, 11, 10.9, 5, (1, 10)),  # fractional tokens: rounded down
        (10, 10, 64, 5, (0, 0)),  # the step did not advance
        (10, 9, 64, 5, (0, 0)),  # nor went back
        (10, 11, -1, 5, (0, 0)),  # negative tokens
        (10, -1, 64, 5, (0, 0)),  # negative step
        (10, 11, math.nan, 5, (0, 0)),
        (10, 11, math.inf, 5, (0, 0)),
        (10, math.inf, 64, 5, (0, 0)),
        (10, math.nan, 64, 5, (0, 0)),
        (10, 11.5, 64, 5, (0, 0)),  # a fractional step
        (10, 12.0, 128.0, 5, (2, 128)),  # whole floats are steps
        (10, 11, 64, 0.5, (0, 0)),  # no time for a step
        (10, 11, 64, math.nan, (0, 0)),
        (10, 11, True, 5, (0, 0)),  # not a number
    ],
)
def test_credit_progress_edge_cases(last, step, tokens, max_steps, want):
    assert credit_progress(last, step, tokens, 64, max_steps) == want


def test_credit_progress_without_a_batch_size_credits_nothing():
    assert credit_progress(0, 1, 64, 0, 5) == (0, 0)


@settings(max_examples=300, deadline=None)
@given(
    last=st.integers(0, 10**6),
    step=st.one_of(st.integers(-10, 10**12), st.floats(allow_nan=True, allow_infinity=True)),
    tokens=st.one_of(st.integers(-10, 10**15), st.floats(allow_nan=True, allow_infinity=True)),
    per_step=st.integers(1, 10**6),
    max_steps=st.floats(0.0, 1e4),
)
def test_credit_progress_never_credits_beyond_the_steps_that_passed(
    last, step, tokens, per_step, max_steps
):
    steps, credited = credit_progress(last, step, tokens, per_step, max_steps)
    assert isinstance(steps, int) and isinstance(credited, int)
    assert 0 <= steps <= max_steps and 0 <= credited <= steps * per_step
    if steps:
        assert step - last >= steps and credited <= tokens


# -- configuration --------------------------------------------------------------------------
def test_the_sync_config_passes_the_knobs_and_refuses_bad_ones():
    robust = SyncConfig().syncer_config().robust
    assert robust == RobustConfig() and robust.enabled
    off = load_config(None, ["sync.robust=false", "sync.norm_clip=8.0"]).sync.syncer_config()
    assert not off.robust.enabled and off.robust.norm_clip == 8.0
    for bad in (
        {"norm_clip": 0.5},
        {"norm_clip": 8.0, "norm_refuse": 4.0},
        {"norm_refuse": math.inf},
        {"norm_window": 0},
        {"norm_window": 4, "norm_warmup": 5},
        {"norm_warmup": 0},
        {"norm_absurd": 0.0},
    ):
        with pytest.raises(ConfigError):
            RobustMergeConfig(**bad)  # type: ignore[arg-type]


def test_pace_is_norm_over_root_steps():
    assert pace(6.0, 4) == 3.0 and pace(2.0, 0) == 2.0
