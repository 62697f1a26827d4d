"""Late answers (core/stale.py): staleness-aware weights and anchoring on the current value,
in the syncer's state machine and in the journal's replay."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ddiloco.core.codec import CodecSpec, encode_tensors
from ddiloco.core.fragments import gather
from ddiloco.core.grace import GraceConfig
from ddiloco.core.merge import token_weight
from ddiloco.core.outer import OuterConfig
from ddiloco.core.plans import TensorSpec, build_plan
from ddiloco.core.rounds import AnswerMeta, RoundConfig, Verdict
from ddiloco.core.stale import UpdateHistory, stale_discount
from ddiloco.core.syncer_state import SyncerConfig, SyncerState
from ddiloco.errors import ConfigError
from ddiloco.runtime.processes.syncer.store_journal import journal_header, replay_journal

SPECS = [TensorSpec("a.w", (4, 3), 3), TensorSpec("b.w", (5, 3), 3)]
NO_GRACE = GraceConfig(enabled=False)


def _initial() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {s.name: torch.randn(s.shape, generator=g) for s in SPECS}


def _syncer(rule: str = "mean", **rounds) -> SyncerState:
    """One fragment a step (P = H = 2), K = 1 without grace: a round closes at its first
    answer, so the test says which answers meet in which round."""
    plan = build_plan(SPECS, 2, "tensor", sync_every=2)
    config = SyncerConfig(
        RoundConfig(quorum=1, grace=NO_GRACE, **rounds), rule, OuterConfig("sgd", lr=1.0)
    )
    return SyncerState(plan, _initial(), config)


def _open(syncer: SyncerState, step: int, p: int) -> int:
    """Move both learners to ``step``; the round id of fragment ``p``'s round it opens."""
    for m in (0, 1):
        syncer.on_progress(m, step, now=float(step))
    return syncer.open_rounds[p].round_id


def test_the_discount_is_one_for_a_fresh_answer_and_falls_with_age():
    assert stale_discount(0, 5.0) == 1.0 and stale_discount(3, 0.0) == 1.0
    assert stale_discount(1, 1.0) == 0.5 and stale_discount(3, 1.0) == 0.25
    with pytest.raises(ConfigError, match="staleness"):
        stale_discount(-1, 1.0)
    with pytest.raises(ConfigError, match="stale_weight"):
        RoundConfig(stale_weight=-0.5)
    with pytest.raises(ConfigError, match="anchor"):
        RoundConfig(anchor="newest")


def _two_merges(syncer: SyncerState, d0: list[torch.Tensor], d1: list[torch.Tensor]) -> None:
    """Learner 0 answers fragment 0 on base 0 and is merged (version 1); learner 1's answer
    on the same base 0 comes after, one version late, and waits for the next round (which
    it does not open or close alone: late answers count for no quorum)."""
    for m in (0, 1):
        syncer.join(m)
    rid = _open(syncer, 2, 0)
    syncer.on_answer(AnswerMeta(0, 0, 0, 0, rid, 0, 2, 1, 64), d0, now=2.0)
    (first,) = syncer.poll(now=2.5)
    assert first.version == 1
    late = AnswerMeta(1, 0, 0, 0, rid, 0, 2, 1, 64)  # to the round that closed: held
    assert syncer.on_answer(late, d1, now=3.0) is Verdict.WAITING
    _open(syncer, 4, 0)


def _fresh(syncer: SyncerState, d: list[torch.Tensor]) -> None:
    """Learner 0's answer on the current version, which meets the late one in its round."""
    meta = AnswerMeta(0, 0, 1, 0, syncer.open_rounds[0].round_id, 1, 4, 1, 64)
    syncer.on_answer(meta, d, now=4.0)


def test_an_anchored_late_answer_is_its_learners_values_minus_the_current_ones():
    """Plain mean, sgd lr 1, equal weights: Theta_2 = Theta_1 + (d2 + d1') / 2 where the late
    answer's d1' is theta_1 - Theta_1 = d1 - d0 anchored, d1 (against Theta_0) as today."""
    for anchor in ("current", "base"):
        syncer = _syncer(anchor=anchor, max_staleness=2)
        theta0 = [t.clone() for t in syncer.fragments[0]]
        d0 = [torch.full_like(t, 0.5) for t in theta0]
        d1 = [torch.full_like(t, -0.25) for t in theta0]
        d2 = [torch.full_like(t, 0.125) for t in theta0]
        _two_merges(syncer, d0, d1)
        _fresh(syncer, d2)
        (second,) = syncer.poll(now=4.5)
        assert second.version == 2 and len(second.round.answers) == 2
        late = [b - a for a, b in zip(d0, d1, strict=True)] if anchor == "current" else d1
        want = [t + a + (b + c) / 2 for t, a, b, c in zip(theta0, d0, late, d2, strict=True)]
        if anchor == "current":
            assert sorted(second.anchored) == [False, True] and syncer.counts["anchored"] == 1
        else:
            assert second.anchored == () and "anchored" not in syncer.counts
        for got, w in zip(syncer.fragments[0], want, strict=True):
            torch.testing.assert_close(got, w)


def test_stale_weights_shrink_a_late_answer_against_a_fresh_one_in_its_round():
    syncer = _syncer(stale_weight=3.0, max_staleness=2)
    shapes = [t.shape for t in syncer.fragments[0]]
    _two_merges(syncer, [torch.ones(s) for s in shapes], [torch.ones(s) for s in shapes])
    _fresh(syncer, [torch.ones(s) for s in shapes])
    (result,) = syncer.poll(now=4.5)
    assert len(result.round.answers) == 2
    assert result.weights == {0: token_weight(64, 1), 1: token_weight(64, 1) / (1 + 3.0 * 1)}


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**16), depth=st.integers(1, 3), merges=st.integers(1, 6))
def test_a_rebased_delta_is_the_learners_values_minus_the_current_ones(seed, depth, merges):
    """Property: whatever the updates, rebase(delta from Theta_b) == theta - Theta_v while
    the history covers b..v, and nothing older than ``depth`` versions is kept."""
    g = torch.Generator().manual_seed(seed)
    history = UpdateHistory(1, depth)
    values = [torch.randn(3, 2, generator=g)]
    seen = [[t.clone() for t in values]]
    for v in range(1, merges + 1):
        before = history.before(values)
        values[0].add_(torch.randn(3, 2, generator=g))
        history.after(0, v, before, values)
        seen.append([t.clone() for t in values])
    theta = [torch.randn(3, 2, generator=g)]
    for base in range(merges + 1):
        covered = history.covers(0, base, merges)
        assert covered == (merges - base <= depth)
        if covered:
            delta = [theta[0] - seen[base][0]]
            (got,) = history.rebase(0, base, merges, delta)
            torch.testing.assert_close(got, theta[0] - values[0], atol=1e-5, rtol=1e-5)


def test_a_restart_forgets_the_kept_updates_and_merges_against_the_own_base():
    syncer = _syncer(anchor="current", max_staleness=2)
    theta0 = [t.clone() for t in syncer.fragments[0]]
    d = [torch.full_like(t, 0.5) for t in theta0]
    _two_merges(syncer, d, d)
    _fresh(syncer, d)
    syncer.load_fragment(0, syncer.fragment_state(0, frozenset()))  # as a restart does
    (second,) = syncer.poll(now=4.5)
    assert second.anchored == (False, False) and "anchored" not in syncer.counts


class _Journal:
    """What the audit reads: one record per merge, the answers' payloads as they arrived."""

    def __init__(self) -> None:
        self.records: list[tuple[dict, list[bytes]]] = []

    def journal(self):
        return iter(self.records)


def test_the_journal_replays_anchored_and_stale_weighted_merges_bit_for_bit():
    syncer = _syncer("rda", anchor="current", stale_weight=0.7, max_staleness=2)
    initial = [gather(syncer.plan, p, _initial()) for p in range(2)]
    journal, spec = _Journal(), CodecSpec("fp32")
    g = torch.Generator().manual_seed(1)
    payloads: dict[tuple[int, int, int], bytes] = {}
    for m in (0, 1):
        syncer.join(m)

    def answer(m: int, seq: int, p: int, rid: int, base: int, step: int) -> None:
        delta = [torch.randn(t.shape, generator=g) for t in syncer.fragments[p]]
        meta = AnswerMeta(m, 0, seq, p, rid, base, step, 2, 64)
        payloads[meta.key] = encode_tensors(delta, spec)
        syncer.on_answer(meta, delta, now=float(step))

    seq = [0, 0]
    for step in range(1, 13):
        for p, rnd in sorted(syncer.open_rounds.items()):
            # learner 1 answers on the version before the last (late) when it can
            for m in (0, 1):
                base = syncer.versions[p] - (m if syncer.versions[p] >= m else 0)
                answer(m, seq[m], p, rnd.round_id, base, step)
                seq[m] += 1
        for result in syncer.poll(now=step + 0.5):
            keys = [a.key for a in result.round.answers]
            journal.records.append((journal_header(result), [payloads[k] for k in keys]))
        for m in (0, 1):
            syncer.on_progress(m, step, now=float(step))
    assert syncer.counts.get("anchored", 0) >= 3
    masks = [[False] * len(f) for f in initial]
    replayed, merged = replay_journal(journal, initial, syncer.config, masks)
    for p in range(2):
        for got, want in zip(replayed[p], syncer.fragments[p], strict=True):
            assert torch.equal(got, want)
    assert max(merged.values()) == 1


def test_a_journal_record_whose_anchored_flags_do_not_match_its_answers_is_refused():
    from ddiloco.runtime.processes.syncer.store_format import StoreError

    syncer = _syncer(anchor="current", max_staleness=2)
    initial = [gather(syncer.plan, p, _initial()) for p in range(2)]
    journal = _Journal()
    delta = [torch.zeros(t.shape) for t in syncer.fragments[0]]
    header = {"fragment": 0, "version": 1, "answers": [[0, 0, 0, 0, 1, 64]],
              "anchored": [True, False]}  # fmt: skip
    journal.records.append((header, [encode_tensors(delta, CodecSpec("fp32"))]))
    with pytest.raises(StoreError, match="2 anchored flags for 1 answers"):
        replay_journal(journal, initial, syncer.config, [[False, False], [False, False]])
