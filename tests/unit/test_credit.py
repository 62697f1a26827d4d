"""The step budget: a learner is credited the steps it can have trained, not what it claims."""

from __future__ import annotations

from ddiloco.core.credit import StepBudget

TPS = 100  # tokens per step


def test_a_liar_among_honest_learners_is_credited_at_most_factor_times_their_rate():
    budget = StepBudget(factor=4.0, horizon=60.0, bootstrap_rate=1000.0)
    for m in range(4):
        budget.join(m, 0, 0.0)
    claimed = 0
    liar_steps = 0
    for i in range(1, 201):  # honest learners: 10 steps a second, one report a step
        now = i * 0.1
        for m in range(3):
            assert budget.credit(m, i, TPS, TPS, now) == (1, TPS)  # never held back
        claimed += 1000
        liar_steps += budget.credit(3, claimed, claimed * TPS, TPS, now)[0]
    # 20 s at 4 x 10 steps/s, plus what it could take before the fleet's rate was known
    assert liar_steps <= 4 * 10 * 20 + 1000 + 5 * 1000
    assert budget.step_of(3) == liar_steps  # the credited step, not the claimed one


def test_a_new_lifes_first_report_is_credited_the_steps_its_tokens_fill():
    budget = StepBudget()
    budget.join(0, None, 0.0)
    assert budget.credit(0, 7, 5 * TPS, TPS, 0.5) == (5, 5 * TPS)  # 5 steps before welcome
    assert budget.step_of(0) == 7
    assert budget.credit(0, 8, TPS, TPS, 0.6) == (1, TPS)
    assert budget.credit(0, 8, TPS, TPS, 0.7) == (0, 0)  # the same step again: nothing


def test_a_learner_cut_off_for_a_while_reports_its_backlog_at_once():
    budget = StepBudget(factor=4.0, min_reports=2)
    for m in range(3):
        budget.join(m, 0, 0.0)
    for i in range(1, 11):
        for m in range(3):
            budget.credit(m, i, TPS, TPS, i * 0.1)
    # learner 2 silent for 10 s (a cut link), then its carried report of 100 steps
    assert budget.credit(2, 110, 100 * TPS, TPS, 11.0) == (100, 100 * TPS)


def test_claims_that_are_not_whole_non_negative_numbers_credit_nothing():
    budget = StepBudget()
    budget.join(0, 3, 0.0)
    for step, tokens in ((float("inf"), 1), (4, float("nan")), (-1, 1), (4, -5), ("4", 1)):
        assert budget.credit(0, step, tokens, TPS, 1.0) == (0, 0)
    assert budget.credit(9, 4, 1, TPS, 1.0) == (0, 0)  # not joined


def test_a_newcomer_that_adopted_the_global_step_is_counted_from_there_not_from_zero():
    # said hello at step 0, then copied a peer (or took the run's global step) and said hello
    # again at 9979: its reports, even a burst of them read in one turn, credit every token
    budget = StepBudget()
    budget.join(0, None, 0.0, ceiling=0)
    budget.hello_again(0, 9979)
    assert budget.credit(0, 9984, 5 * TPS, TPS, 0.1) == (5, 5 * TPS)
    for step in range(9985, 9990):  # five reports in the same instant
        assert budget.credit(0, step, TPS, TPS, 0.1) == (1, TPS)
    budget.hello_again(0, 20000)  # after its first report: the credited step holds
    assert budget.step_of(0) == 9989


def test_without_the_second_hello_the_jump_from_zero_starves_the_reports_behind_it():
    budget = StepBudget()
    budget.join(0, None, 0.0, ceiling=0)
    assert budget.credit(0, 9984, 5 * TPS, TPS, 0.1) == (1100, 5 * TPS)  # the allowance, gone
    assert budget.credit(0, 9985, TPS, TPS, 0.1) == (0, 0)  # trained, credited nothing
