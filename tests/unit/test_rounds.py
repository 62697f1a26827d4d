"""Round policy: schedule from the K-th fastest learner, quorum, grace, staleness, duplicates."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ddiloco.core.grace import Ema, GraceConfig, grace_window
from ddiloco.core.rounds import (
    UNSOLICITED,
    AnswerMeta,
    Dropped,
    RoundConfig,
    RoundPolicy,
    Supersession,
    Verdict,
)
from ddiloco.errors import ConfigError

H = 4


def _policy(k: int = 1, learners: int = 3, **kw) -> RoundPolicy:
    pol = RoundPolicy(H, lambda t: [t % H], H, RoundConfig(quorum=k, **kw))
    for m in range(learners):
        pol.join(m)
    return pol


def _answer(learner, fragment, round_id=0, base=0, seq=0, step=1, steps=1, tokens=10, life=0):
    return AnswerMeta(learner, life, seq, fragment, round_id, base, step, steps, tokens)


# -- grace ------------------------------------------------------------------------------------
@settings(max_examples=200)
@given(
    gamma=st.floats(0.0, 0.99),
    cap=st.floats(0.0, 4.0),
    tau=st.integers(0, 8),
    step=st.one_of(st.none(), st.floats(0.0, 100.0)),
    quorum=st.floats(0.0, 1000.0),
    sync=st.one_of(st.none(), st.floats(0.0, 1000.0)),
    enabled=st.booleans(),
)
def test_grace_is_never_negative_nor_above_cap(gamma, cap, tau, step, quorum, sync, enabled):
    cfg = GraceConfig(enabled=enabled, gamma=gamma, cap_steps=cap)
    g = grace_window(cfg, overlap=tau, step_seconds=step, quorum_seconds=quorum, sync_seconds=sync)
    assert g >= 0.0
    assert g <= (cap * step if step is not None else 0.0) + 1e-12


def test_grace_follows_the_slack_formula():
    cfg = GraceConfig(gamma=0.5, cap_steps=1.0)
    # slack = 2*1.0 - (0.2 + 0.6) = 1.2 -> 0.6
    assert grace_window(cfg, overlap=2, step_seconds=1.0, quorum_seconds=0.2, sync_seconds=0.6) == (
        pytest.approx(0.6)
    )
    assert grace_window(cfg, overlap=2, step_seconds=1.0, quorum_seconds=3, sync_seconds=0) == 0.0
    assert grace_window(cfg, overlap=9, step_seconds=1.0, quorum_seconds=0, sync_seconds=0) == 1.0
    assert (
        grace_window(cfg, overlap=2, step_seconds=1.5, quorum_seconds=0, sync_seconds=None) == 1.5
    )
    off = GraceConfig(enabled=False)
    assert grace_window(off, overlap=2, step_seconds=1.0, quorum_seconds=0, sync_seconds=0) == 0.0


def test_ema_starts_at_first_sample_and_smooths():
    e = Ema(0.5)
    assert e.value is None
    assert e.update(4.0) == 4.0
    assert e.update(2.0) == 3.0
    with pytest.raises(ConfigError, match="sample"):
        e.update(-1.0)


# -- schedule ---------------------------------------------------------------------------------
def test_rounds_open_on_the_kth_fastest_learners_step():
    pol = _policy(k=2)
    assert pol.on_progress(0, 3, now=1.0) == []  # only one learner at step 3: K=2 not there
    opened = pol.on_progress(1, 2, now=2.0)  # second fastest now at 2 -> steps 1, 2 due
    assert sorted(r.fragment for r in opened) == [1, 2]
    assert all(r.asked == {0, 1, 2} for r in opened)
    assert pol.global_step == 2


def test_a_jump_opens_each_fragment_once():
    pol = _policy(k=1)
    opened = pol.on_progress(0, 50, now=0.0)
    assert sorted(r.fragment for r in opened) == list(range(H))


def test_fewer_live_learners_than_k_stops_the_clock():
    pol = _policy(k=3, learners=3)
    pol.leave(2, now=0.0)
    assert pol.on_progress(0, 9, now=1.0) == []
    assert pol.global_step == 0


# -- quorum and grace -------------------------------------------------------------------------
def test_quorum_then_grace_then_close():
    pol = _policy(k=1)
    pol.on_progress(0, 1, now=0.0, step_seconds=1.0)  # opens fragment 1
    assert pol.on_answer(_answer(0, 1), now=0.3) is Verdict.ACCEPTED
    assert pol.ready(now=0.3) == []  # no sync estimate yet: grace = cap = 1 step
    assert pol.next_deadline() == pytest.approx(1.3)
    assert pol.on_answer(_answer(1, 1), now=0.8) is Verdict.ACCEPTED
    (closed,) = pol.ready(now=1.3)
    assert closed.fragment == 1 and len(closed.answers) == 2 and closed.grace == pytest.approx(1.0)
    assert pol.on_merged(closed, sync_seconds=0.4) == 1
    assert pol.versions[1] == 1


def test_round_closes_early_when_everyone_answered():
    pol = _policy(k=1, learners=2)
    pol.on_progress(0, 1, now=0.0, step_seconds=1.0)
    pol.on_answer(_answer(0, 1), now=0.1)
    pol.on_answer(_answer(1, 1), now=0.2)
    assert [c.fragment for c in pol.ready(now=0.2)] == [1]


def test_no_grace_closes_at_quorum():
    pol = _policy(k=2, grace=GraceConfig(enabled=False))
    pol.on_progress(0, 1, now=0.0, step_seconds=1.0)
    pol.on_progress(1, 1, now=0.0, step_seconds=1.0)
    pol.on_answer(_answer(0, 1), now=0.1)
    assert pol.ready(now=0.1) == []  # quorum K=2 not met
    pol.on_answer(_answer(1, 1), now=0.2)
    assert len(pol.ready(now=0.2)[0].answers) == 2


# -- the run's end ----------------------------------------------------------------------------
def test_finish_opens_a_final_round_per_fragment_that_waits_for_every_live_learner():
    pol = _policy(k=1, learners=3)
    pol.on_progress(0, 1, now=0.0, step_seconds=1.0)  # fragment 1 open, learner 0 answers it
    pol.on_answer(_answer(0, 1, step=1), now=0.1)
    rounds = pol.finish(now=1.0, deadline=31.0)
    assert [r.fragment for r in rounds] == list(range(H))
    assert all(r.asked == {0, 1, 2} for r in rounds)
    assert pol.next_deadline() == 31.0
    # its earlier answer does not count: the final one carries what it trained since
    assert pol.ready(now=1.5) == []
    final = rounds[1].round_id
    assert final == 1  # a new id: an answer to the earlier ask (round 0) is not the final one
    assert pol.on_answer(_answer(1, 1, round_id=0, step=2), now=1.6) is Verdict.ACCEPTED
    assert pol.ready(now=1.7) == []
    for m in range(3):
        answer = _answer(m, 1, round_id=final, step=5, seq=1)
        assert pol.on_answer(answer, now=2.0) is Verdict.ACCEPTED
    (closed,) = pol.ready(now=2.0)  # quorum 1 does not close a final round early: all did
    assert closed.fragment == 1 and {a.learner for a in closed.answers} == {0, 1, 2}
    assert [a.local_step for a in closed.answers if a.learner == 0] == [5]  # superseded
    assert any(isinstance(e, Supersession) for e in pol.take_events())
    assert pol.on_progress(1, 50, now=3.0) == []  # no round opens after the finish


def test_a_final_round_closes_at_its_deadline_with_what_came_and_without_answers_is_dropped():
    pol = _policy(k=2, learners=2)
    pol.finish(now=0.0, deadline=10.0)
    pol.on_answer(_answer(0, 0), now=1.0)  # quorum K=2 never met: it merges anyway at the end
    pol.leave(1, now=2.0)
    (closed,) = pol.ready(now=2.0)  # everyone still live has answered
    assert closed.fragment == 0 and len(closed.answers) == 1
    assert pol.ready(now=9.0) == []  # fragments 1-3: nobody answered, not yet due
    assert pol.ready(now=10.0) == [] and not pol.open  # due: nothing to merge, dropped


def test_finish_refuses_a_deadline_in_the_past():
    with pytest.raises(ConfigError, match="deadline"):
        _policy().finish(now=5.0, deadline=4.0)


# -- which answers count ----------------------------------------------------------------------
def test_duplicates_invalid_and_stale_answers():
    pol = _policy(k=1, max_staleness=1)
    pol.on_progress(0, 1, now=0.0)
    assert pol.on_answer(_answer(0, 1), now=0.0) is Verdict.ACCEPTED
    assert pol.on_answer(_answer(0, 1), now=0.0) is Verdict.DUPLICATE
    assert pol.on_answer(_answer(1, 1, base=5, seq=1), now=0.0) is Verdict.INVALID
    assert pol.on_answer(_answer(1, 1, round_id=7, seq=2), now=0.0) is Verdict.INVALID
    for v in range(2):  # advance fragment 1 to version 2
        (closed,) = pol.ready(now=10.0 + v)
        pol.on_merged(closed)
        pol.on_progress(0, 1 + H * (v + 1), now=10.0 + v)
        pol.on_answer(_answer(2, 1, round_id=v + 1, base=v + 1, seq=v), now=10.0 + v)
    assert pol.on_answer(_answer(1, 1, round_id=0, base=0, seq=9), now=20.0) is Verdict.STALE


def test_late_answer_waits_for_the_next_round_and_rides_along_without_quorum():
    pol = _policy(k=1, max_staleness=1)
    pol.on_progress(0, 1, now=0.0)
    pol.on_answer(_answer(0, 1), now=0.0)
    (closed,) = pol.ready(now=5.0)
    pol.on_merged(closed)  # fragment 1 at version 1, no round open
    late = _answer(1, 1, base=0, seq=1)  # computed on version 0: one version stale
    early = _answer(2, 1, base=1, round_id=UNSOLICITED, seq=1)  # pushed on its own schedule
    assert pol.on_answer(late, now=6.0) is Verdict.WAITING
    assert pol.on_answer(early, now=6.0) is Verdict.WAITING
    pol.on_progress(0, 1 + H, now=7.0)  # round 1 opens, held answers join it
    assert {a.learner for a in pol.open[1].answers.values()} == {1, 2}
    assert pol.open[1].learners == {2}  # only the fresh one counts for the quorum


def test_newer_answer_on_the_same_base_supersedes_the_older():
    pol = _policy(k=1)
    pol.on_progress(0, 1, now=0.0)
    pol.on_answer(_answer(0, 1, seq=0, step=1), now=0.0)
    pol.on_answer(_answer(0, 1, seq=1, step=2), now=0.1)
    events = pol.take_events()
    assert events == [Supersession((0, 0, 0), (0, 0, 1))]
    assert list(pol.open[1].answers) == [(0, 0, 1)]
    # a re-ordered older answer arriving after the newer one rides with it as well
    pol.on_answer(_answer(1, 1, seq=5, step=9), now=0.2)
    pol.on_answer(_answer(1, 1, seq=4, step=8), now=0.3)
    assert pol.take_events() == [Supersession((1, 0, 4), (1, 0, 5))]


def test_answer_on_an_already_merged_base_is_refused():
    pol = _policy(k=1)
    pol.on_progress(0, 1, now=0.0)
    pol.on_answer(_answer(0, 1, seq=0), now=0.0)
    pol.on_merged(pol.ready(now=9.0)[0])
    pol.on_progress(0, 1 + H, now=10.0)
    # learner 0 never received version 1 and answers again on base 0
    assert pol.on_answer(_answer(0, 1, round_id=1, seq=1), now=10.0) is (
        Verdict.BASE_ALREADY_MERGED
    )


def test_held_answer_that_goes_stale_is_reported():
    pol = _policy(k=1, max_staleness=0)
    pol.on_progress(0, 1, now=0.0)
    pol.on_answer(_answer(0, 1, seq=0), now=0.0)
    pol.on_merged(pol.ready(now=9.0)[0])
    held = _answer(1, 1, base=1, seq=0)
    assert pol.on_answer(held, now=9.5) is Verdict.WAITING
    pol.versions[1] = 2  # another merge happened meanwhile (e.g. restored state)
    pol.on_progress(0, 1 + H, now=10.0)
    assert pol.take_events() == [Dropped(held, Verdict.STALE)]


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"quorum": 0}, "quorum"),
        ({"max_staleness": -1}, "max_staleness"),
        ({"overlap": -1}, "overlap"),
    ],
)
def test_bad_config_names_the_field(kwargs, field):
    with pytest.raises(ConfigError, match=field):
        RoundConfig(**kwargs)


@pytest.mark.parametrize(
    "answer,field",
    [
        (_answer(0, 99), "fragment"),
        (_answer(0, 1, tokens=-1), "c_tokens"),
        (_answer(0, 1, steps=-2), "c_steps"),
        (_answer(0, 1, base=-1), "base_version"),
    ],
)
def test_bad_answers_name_the_field(answer, field):
    with pytest.raises(ConfigError, match=field):
        _policy().on_answer(answer, now=0.0)


def test_progress_from_unknown_learner_is_refused():
    with pytest.raises(ConfigError, match="learner"):
        _policy().on_progress(42, 1, now=0.0)
