"""Running totals on every progress report and answer (syncer/totals.py): a report lost or
late on the way costs the ledger nothing, and an answer that arrives after a later rebase or
answer is counted as late, not as a contradiction."""

from __future__ import annotations

from ddiloco.core.restart_ledger import RestartLedger
from ddiloco.runtime.processes.syncer.totals import RunningTotals


def test_a_lost_report_is_counted_by_the_next_one_and_a_late_one_adds_nothing():
    totals = RunningTotals(2)
    totals.start(0, incarnation=7, from_zero=True)
    assert totals.reported(0, 7, (10, [0, 0]), 10, []) == (10, [])
    # the report of tokens 10..20 with a rebase of fragment 1 is lost
    assert totals.reported(0, 7, (30, [0, 1]), 10, []) == (20, [1])
    assert totals.reported(0, 7, (20, [0, 1]), 10, [1]) == (0, [])  # it arrives late
    assert totals.last[0].tokens == 30 and totals.last[0].rebases == [0, 1]


def test_an_answer_counts_the_reports_sent_before_it_that_never_came():
    totals = RunningTotals(1)
    totals.start(0, 7, from_zero=True)
    totals.reported(0, 7, (10, [0]), 10, [])
    assert totals.caught_up(0, 7, (30, [1])) == (20, [0])
    assert totals.reported(0, 7, (30, [1]), 20, [0]) == (0, [])  # the lost one, late
    assert totals.caught_up(0, 7, (30, [1])) == (0, [])  # a re-push adds nothing


def test_a_life_not_counted_from_its_start_is_taken_up_at_its_first_report():
    totals = RunningTotals(1)
    totals.start(0, 7, from_zero=False)  # restored from the store: part of it counted
    assert totals.caught_up(0, 7, (500, [3])) == (0, [])  # an answer may be an old re-push
    assert totals.reported(0, 7, (500, [3]), 10, []) == (10, [])  # its own increment
    assert totals.reported(0, 7, (520, [3]), 10, []) == (20, [])  # from its totals on
    totals.start(0, 7, from_zero=True)  # a hello again of the same life changes nothing
    assert totals.last[0].tokens == 520
    totals.start(0, 8, from_zero=True)  # a new life starts at zero
    assert totals.reported(0, 8, (10, [0]), 10, []) == (10, [])


def test_messages_without_totals_count_their_own_increment():
    totals = RunningTotals(1)
    totals.start(0, 7, from_zero=True)
    assert totals.reported(0, 7, None, 10, [0]) == (10, [0])
    assert totals.caught_up(0, 7, None) == (0, [])
    assert not totals.overtaken(0, 7, None, 0)


def test_an_answer_overtaken_by_a_rebase_of_its_fragment_is_late_not_a_contradiction():
    totals, ledger = RunningTotals(2), RestartLedger(2)
    totals.start(0, 7, from_zero=True)
    ledger.joined(0, 7, 0, [0, 0])
    ledger.reported(0, 1, 40, [], [0, 0])
    totals.reported(0, 7, (40, [0, 0]), 40, [])
    # the answer on fragment 0 (40 tokens, rebases [0, 0]) is delayed; the learner rebases
    # fragment 0 and reports 10 more tokens, which arrive first
    ledger.reported(0, 2, 10, [0], [1, 0])
    totals.reported(0, 7, (50, [1, 0]), 10, [0])
    late = totals.overtaken(0, 7, (40, [0, 0]), 0)
    assert late and not totals.overtaken(0, 7, (40, [0, 0]), 1)
    ledger.answered(0, 0, (0, 7, 1), 40, 0, overtaken=late)
    ledger.merged_answer((0, 7, 1), 1.0)
    assert ledger.errors == 0 and ledger.late_answers == 1 and ledger.balanced()


def test_an_answer_below_a_later_one_on_the_same_base_is_late_not_a_contradiction():
    ledger = RestartLedger(1)
    ledger.joined(0, 7, 0, [0])
    ledger.reported(0, 2, 80, [], [0])
    ledger.answered(0, 0, (0, 7, 2), 80, 0)  # the later answer arrives first
    ledger.answered(0, 0, (0, 7, 1), 40, 0)
    ledger.merged_answer((0, 7, 2), 1.0)
    ledger.wasted_answer((0, 7, 1), "base_already_merged")
    assert ledger.errors == 0 and ledger.late_answers == 1 and ledger.balanced()
    assert ledger.summary()["tokens_merged"] == 80
