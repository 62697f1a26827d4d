"""The syncer state machine and the token ledger, driven by random event sequences."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ddiloco.core.ledger import TokenLedger
from ddiloco.core.outer import OuterConfig
from ddiloco.core.plans import TensorSpec, build_plan, gather
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
    syncer.policy.join(0)
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


def test_non_finite_and_misshapen_updates_are_refused():
    syncer = _syncer()
    syncer.policy.join(0)
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
    assert syncer.policy.open[rnd.fragment].answers == {}  # nothing half-applied


class _Learner:
    def __init__(self, lid: int, syncer: SyncerState) -> None:
        self.id, self.life, self.seq, self.step = lid, 0, 0, 0
        self.params = {k: v.clone() for k, v in _params().items()}
        self.base = [0] * syncer.plan.num_fragments
        self.c_steps = [0] * syncer.plan.num_fragments
        self.c_tokens = [0] * syncer.plan.num_fragments


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), k=st.integers(1, 3), staleness=st.integers(0, 2))
def test_ledger_balances_under_random_event_sequences(seed, k, staleness):
    """Crashes, losses, duplicates, reordering, late answers: every token is accounted for."""
    rng = random.Random(seed)
    ledger = TokenLedger(2)
    syncer = _syncer(k=k, ledger=ledger, max_staleness=staleness)
    learners = [_Learner(m, syncer) for m in range(3)]
    for lr in learners:
        syncer.policy.join(lr.id)
    in_flight: list[tuple[AnswerMeta, list[torch.Tensor]]] = []
    now = 0.0
    for _ in range(120):
        now += rng.random()
        lr = rng.choice(learners)
        action = rng.random()
        if action < 0.45:  # a training step
            tokens = rng.randint(1, 50)
            lr.step += 1
            for p in range(2):
                lr.c_steps[p] += 1
                lr.c_tokens[p] += tokens
            for t in lr.params.values():
                t.add_(0.01 * rng.random())
            ledger.trained(lr.id, tokens)
            for rnd in syncer.on_progress(lr.id, lr.step, now, step_seconds=1.0):
                for m in sorted(rnd.asked):
                    ask = learners[m]
                    p = rnd.fragment
                    meta = AnswerMeta(
                        m,
                        ask.life,
                        ask.seq,
                        p,
                        rnd.round_id,
                        ask.base[p],
                        ask.step,
                        ask.c_steps[p],
                        ask.c_tokens[p],
                    )
                    ask.seq += 1
                    ledger.answered(m, p, meta.key, meta.c_tokens)
                    delta = [torch.full_like(f, 0.01) for f in syncer.fragments[p]]
                    in_flight.append((meta, delta))
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
                for rec in learners:
                    if rec.id in syncer.policy.progress:
                        rec.base[result.fragment] = result.version
                        rec.c_steps[result.fragment] = rec.c_tokens[result.fragment] = 0
                        ledger.rebased(rec.id, result.fragment)
        else:  # crash and restart with a new life
            ledger.crashed(lr.id)
            syncer.policy.leave(lr.id, now)
            lr.life += 1
            lr.seq = 0
            lr.c_steps = [0, 0]
            lr.c_tokens = [0, 0]
            lr.base = list(syncer.versions)
            syncer.policy.join(lr.id, lr.step)
        assert ledger.balanced()
    for meta, _ in in_flight:
        ledger.wasted_answer(meta.key, "lost_in_flight")
    ledger.close()
    summary = ledger.summary()
    assert summary["balanced"] and summary["tokens_pending"] == 0
    total = summary["tokens_merged"] + sum(summary["tokens_wasted"].values())
    assert total == pytest.approx(summary["tokens"])
    assert all(v >= 0 for v in summary["tokens_wasted"].values())


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
