"""The syncer state machine and the token ledger, driven by random event sequences."""

from __future__ import annotations

import random
from contextlib import contextmanager

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ddiloco.core.codec import CodecSpec, PackedTensors, encode_tensors
from ddiloco.core.fragments import gather, scatter
from ddiloco.core.learner_state import APPLY_RULES, LearnerSync
from ddiloco.core.ledger import TokenLedger
from ddiloco.core.outer import OuterConfig
from ddiloco.core.plans import TensorSpec, build_plan
from ddiloco.core.rounds import AnswerMeta, RoundConfig, Verdict
from ddiloco.core.syncer_state import SyncerConfig, SyncerState
from ddiloco.errors import ConfigError

SPECS = [
    TensorSpec("emb.weight", (6, 4), 4),
    TensorSpec("blocks.0.w", (4, 4), 4),
    TensorSpec("blocks.1.w", (4, 4), 4),
    TensorSpec("head.weight", (6, 4), 4),
]


def _params(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {s.name: torch.randn(s.shape, generator=g) for s in SPECS}


def _syncer(k: int = 1, ledger: TokenLedger | None = None, **rounds) -> SyncerState:
    plan = build_plan(SPECS, 2, "tensor", sync_every=2)
    cfg = SyncerConfig(RoundConfig(quorum=k, **rounds), "rda", OuterConfig("sgd", lr=1.0))
    return SyncerState(plan, _params(), cfg, plain_tensors={"emb.weight"}, ledger=ledger)


def test_single_learner_with_lr_one_sgd_lands_exactly_on_the_learner():
    syncer = _syncer()
    syncer.join(0)
    (rnd,) = syncer.on_progress(0, 1, now=0.0, step_seconds=1.0)
    p = rnd.fragment
    learner = {k: v + 0.25 for k, v in _params().items()}
    delta = [
        a - b for a, b in zip(gather(syncer.plan, p, learner), syncer.fragments[p], strict=True)
    ]
    meta = AnswerMeta(0, 0, 0, p, rnd.round_id, 0, 1, 1, 100)
    assert syncer.on_answer(meta, delta, now=0.1) is Verdict.ACCEPTED
    (result,) = syncer.poll(now=0.1)  # the only live learner answered: no need to wait
    assert result.version == 1 and result.weights == {0: 100.0 * 100.0}
    for got, want in zip(result.tensors, gather(syncer.plan, p, learner), strict=True):
        torch.testing.assert_close(got, want)


def test_an_answer_held_encoded_merges_to_the_bits_of_one_held_decoded():
    results = []
    for packed in (False, True):
        syncer = _syncer(k=2)
        for m in (0, 1):
            syncer.join(m)
        opened = [*syncer.on_progress(0, 1, now=0.0, step_seconds=1.0),
                  *syncer.on_progress(1, 1, now=0.0, step_seconds=1.0)]  # fmt: skip
        rnd = opened[0]
        for m in (0, 1):
            g = torch.Generator().manual_seed(m)
            delta = [torch.randn(t.shape, generator=g).bfloat16().float()
                     for t in syncer.fragments[rnd.fragment]]  # fmt: skip
            keep = PackedTensors(encode_tensors(delta, CodecSpec("bf16"))) if packed else None
            meta = AnswerMeta(m, 0, 0, rnd.fragment, rnd.round_id, 0, 1, 1, 100 + m)
            assert syncer.on_answer(meta, delta, now=0.1, keep=keep) is Verdict.ACCEPTED
            assert not packed or syncer.held[meta.key].delta is keep
        (result,) = syncer.poll(now=0.1)
        results.append([t.clone() for t in result.tensors])
    assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))


def test_what_is_kept_in_place_of_a_delta_must_have_its_tensors():
    syncer = _syncer()
    syncer.join(0)
    (rnd,) = syncer.on_progress(0, 1, now=0.0)
    delta = [torch.zeros(t.shape) for t in syncer.fragments[rnd.fragment]]
    meta = AnswerMeta(0, 0, 0, rnd.fragment, rnd.round_id, 0, 1, 1, 10)
    with pytest.raises(ConfigError, match="keep"):
        syncer.on_answer(meta, delta, now=0.0, keep=PackedTensors(encode_tensors([], CodecSpec())))
    assert syncer.open_rounds[rnd.fragment].answers == {}


@pytest.mark.parametrize("share", [True, False])
def test_shared_initial_values_are_merged_in_place_and_a_copy_leaves_them_alone(share):
    plan = build_plan(SPECS, 2, "tensor", sync_every=2)
    cfg = SyncerConfig(RoundConfig(quorum=1), "rda", OuterConfig("sgd", lr=1.0))
    model = _params()
    syncer = SyncerState(plan, model, cfg, share_initial=share)
    syncer.join(0)
    (rnd,) = syncer.on_progress(0, 1, now=0.0, step_seconds=1.0)
    p = rnd.fragment
    learner = {k: v + 0.25 for k, v in _params().items()}
    delta = [a - b for a, b in zip(gather(plan, p, learner), syncer.fragments[p], strict=True)]
    syncer.on_answer(AnswerMeta(0, 0, 0, p, rnd.round_id, 0, 1, 1, 100), delta, now=0.1)
    (result,) = syncer.poll(now=0.1)
    assert result.version == 1
    merged, initial = gather(plan, p, learner), gather(plan, p, _params())
    for i, got in enumerate(gather(plan, p, model)):
        # shared: the model's own parameters are the global values; else left as they were
        assert torch.allclose(got, merged[i]) if share else torch.equal(got, initial[i])
        torch.testing.assert_close(result.tensors[i], merged[i])


@pytest.mark.parametrize("claimed", [1, 0, 10**9])
def test_the_schedule_factor_is_taken_at_the_credited_step_not_the_claimed_one(claimed):
    plan = build_plan(SPECS, 2, "tensor", sync_every=2)
    cfg = SyncerConfig(RoundConfig(quorum=1), "rda", OuterConfig("nesterov"))

    def factor(step: int) -> float:
        return 1.0 if step < 100 else 0.1

    syncer = SyncerState(plan, _params(), cfg, plain_tensors={"emb.weight"}, schedule=factor)
    syncer.join(0)
    (rnd,) = syncer.on_progress(0, 1, now=0.0, step_seconds=1.0)  # what it is credited with
    delta = [torch.full_like(t, 0.1) for t in syncer.fragments[rnd.fragment]]
    meta = AnswerMeta(0, 0, 0, rnd.fragment, rnd.round_id, 0, claimed, 1, 100)
    assert syncer.on_answer(meta, delta, now=0.1) is Verdict.ACCEPTED
    (result,) = syncer.poll(now=0.1)
    assert result.schedule_scale == 1.0  # step 0 of the schedule, whatever the claim


def test_non_finite_and_misshapen_updates_are_refused():
    syncer = _syncer()
    syncer.join(0)
    (rnd,) = syncer.on_progress(0, 1, now=0.0)
    meta = AnswerMeta(0, 0, 0, rnd.fragment, 0, 0, 1, 1, 10)
    shapes = [t.shape for t in syncer.fragments[rnd.fragment]]
    bad = [torch.zeros(s) for s in shapes]
    bad[0][0, 0] = float("nan")
    with pytest.raises(ConfigError, match="NaN"):
        syncer.on_answer(meta, bad, now=0.0)
    with pytest.raises(ConfigError, match=r"delta\[0\].shape"):
        syncer.on_answer(meta, [torch.zeros(1)] * len(shapes), now=0.0)
    with pytest.raises(ConfigError, match="delta"):
        syncer.on_answer(meta, [], now=0.0)
    assert syncer.open_rounds[rnd.fragment].answers == {}  # nothing half-applied


class _Learner:
    """A learner's real synchronization state (core/learner_state.py) and its parameters."""

    def __init__(self, lid: int, syncer: SyncerState, apply: str) -> None:
        self.id, self.life, self.apply = lid, 0, apply
        self.params = {k: v.clone() for k, v in _params().items()}
        self.sync = LearnerSync(lid, syncer.plan, self.params, apply=apply)

    def restart(self, syncer: SyncerState) -> None:
        """A new life: the global fragments, counters at zero."""
        self.life += 1
        for p, values in enumerate(syncer.fragments):
            scatter(syncer.plan, p, self.params, values)
        step = self.sync.step
        self.sync = LearnerSync(
            self.id,
            syncer.plan,
            self.params,
            incarnation=self.life,
            apply=self.apply,
            versions=syncer.versions,
        )
        self.sync.step = step


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    k=st.integers(1, 3),
    staleness=st.integers(0, 2),
    apply=st.sampled_from(APPLY_RULES),
    stale_weight=st.sampled_from([0.0, 1.0]),
    anchor=st.sampled_from(["base", "current"]),
)
def test_ledger_balances_under_random_event_sequences(
    seed, k, staleness, apply, stale_weight, anchor
):
    """Crashes, losses, duplicates, reordering, late answers (weighted down and anchored on
    the current value, or not), under every apply rule: every token is accounted for, and
    the learners' counters never claim more than the ledger credits (carried progress is
    neither lost nor counted twice); every fragment stays finite."""
    rng = random.Random(seed)
    carry = apply == "carry"
    ledger = TokenLedger(2, carry=carry)
    late = {"stale_weight": stale_weight, "anchor": anchor}
    syncer = _syncer(k=k, ledger=ledger, max_staleness=staleness, **late)
    learners = [_Learner(m, syncer, apply) for m in range(3)]
    for lr in learners:
        syncer.join(lr.id)
    in_flight: list[tuple[AnswerMeta, list[torch.Tensor]]] = []
    now = 0.0
    for _ in range(120):
        now += rng.random()
        lr = rng.choice(learners)
        action = rng.random()
        if action < 0.45:  # a training step
            tokens = rng.randint(1, 50)
            for t in lr.params.values():
                t.add_(0.01 * rng.random())
            lr.sync.stepped(tokens)
            ledger.trained(lr.id, tokens)
            for rnd in syncer.on_progress(lr.id, lr.sync.step, now, step_seconds=1.0):
                for m in sorted(rnd.asked):
                    answer = learners[m].sync.answer(rnd.fragment, rnd.round_id, learners[m].params)
                    meta = answer.meta
                    since, _ = ledger.counters(m, meta.fragment)
                    assert meta.c_tokens == since  # the learner claims what the ledger credits
                    ledger.answered(m, meta.fragment, meta.key, meta.c_tokens)
                    in_flight.append((meta, answer.delta))
        elif action < 0.75 and in_flight:  # deliver one message (any order), maybe twice
            meta, delta = in_flight.pop(rng.randrange(len(in_flight)))
            if rng.random() < 0.1:
                ledger.wasted_answer(meta.key, "lost_in_flight")
                continue
            syncer.on_answer(meta, delta, now)
            if rng.random() < 0.1:
                assert syncer.on_answer(meta, delta, now) is Verdict.DUPLICATE
        elif action < 0.95:
            for result in syncer.poll(now + rng.random() * 2):
                result.book(ledger)  # (the caller books a merge: MergeResult.book)
                p = result.fragment
                for rec in learners:
                    if rec.id in syncer.live:
                        values = syncer.fragments[p]
                        if rec.sync.apply(p, result.version, values, rec.params):
                            ledger.rebased(rec.id, p)
                            since, _ = ledger.counters(rec.id, p)
                            assert rec.sync.c_tokens[p] == since
        else:  # crash and restart with a new life
            ledger.crashed(lr.id)
            syncer.leave(lr.id, now)
            lr.restart(syncer)
            syncer.join(lr.id, lr.sync.step)
        assert ledger.balanced()
    for meta, _ in in_flight:
        ledger.wasted_answer(meta.key, "lost_in_flight")
    ledger.close()
    summary = ledger.summary()
    assert summary["balanced"] and summary["tokens_pending"] == 0
    total = summary["tokens_merged"] + sum(summary["tokens_wasted"].values())
    assert total == pytest.approx(summary["tokens"])
    assert all(v >= 0 for v in summary["tokens_wasted"].values())
    if carry:
        assert "overwritten" not in summary["tokens_wasted"]  # nothing is thrown away
    else:
        assert summary["tokens_carried"] == 0
    assert all(bool(torch.isfinite(t).all()) for f in syncer.fragments for t in f)


def test_ledger_refuses_impossible_counters():
    ledger = TokenLedger(2)
    ledger.trained(0, 10)
    with pytest.raises(ConfigError, match="c_tokens"):
        ledger.answered(0, 0, "a", 11)
    with pytest.raises(ConfigError, match="fragment"):
        ledger.answered(0, 5, "a", 1)
    with pytest.raises(ConfigError, match="tokens"):
        ledger.trained(0, -1)
    with pytest.raises(ConfigError, match="key"):
        ledger.merged_answer("nope", 1.0)


def test_the_period_fraction_counts_global_steps_since_the_last_merged_round_opened():
    from ddiloco.core.syncer_state import period_fraction

    assert period_fraction(5, None, 8) == 1.0  # a first round: a whole outer step
    assert period_fraction(16, 8, 8) == 1.0 and period_fraction(30, 8, 8) == 1.0  # (capped)
    assert period_fraction(12, 8, 8) == 0.5
    assert period_fraction(8, 8, 8) == 0.0


def test_a_final_round_merges_without_pushing_momentum():
    syncer = _syncer()
    syncer.join(0)
    (rnd,) = syncer.on_progress(0, 1, now=0.0, step_seconds=1.0)
    delta = [torch.full_like(t, 0.1) for t in syncer.fragments[rnd.fragment]]
    meta = AnswerMeta(0, 0, 0, rnd.fragment, rnd.round_id, 0, 1, 1, 100)
    syncer.on_answer(meta, delta, now=0.1)
    (first,) = syncer.poll(now=0.1)
    assert first.fraction == 1.0
    for final in syncer.finish(now=1.0, deadline=5.0):
        d = [torch.full_like(t, 0.1) for t in syncer.fragments[final.fragment]]
        answer = AnswerMeta(0, 0, final.fragment + 1, final.fragment, final.round_id, 0, 2, 1, 10)
        if final.fragment == first.fragment:
            answer = AnswerMeta(0, 0, 9, final.fragment, final.round_id, 1, 2, 1, 10)
        assert syncer.on_answer(answer, d, now=1.1) is Verdict.ACCEPTED
    results = syncer.poll(now=1.1)
    assert len(results) == syncer.plan.num_fragments and syncer.finished
    assert {r.fraction for r in results} == {0.0}
    assert all(r.record(0)["fraction"] == 0.0 for r in results)


def test_each_merge_and_only_a_merge_runs_inside_the_callers_writing_guard():
    """The processes' syncer keeps an evaluation in place out of merges with this guard: a
    poll that merges nothing must not enter it (it would wait for an evaluation's slice)."""
    syncer, entered = _syncer(), []

    @contextmanager
    def writing():
        entered.append(syncer.versions[p])
        yield

    syncer.join(0)
    (rnd,) = syncer.on_progress(0, 1, now=0.0, step_seconds=1.0)
    p = rnd.fragment
    assert syncer.poll(now=0.05, writing=writing) == [] and entered == []  # nothing due
    delta = [torch.full_like(t, 0.5) for t in syncer.fragments[p]]
    meta = AnswerMeta(0, 0, 0, p, rnd.round_id, 0, 1, 1, 100)
    assert syncer.on_answer(meta, delta, now=0.1) is Verdict.ACCEPTED
    (result,) = syncer.poll(now=0.1, writing=writing)
    assert entered == [0] and result.version == 1  # entered once, before the write
