"""The token ledger as plain data, and a restarted syncer's ledger (core.restart_ledger)
reconciled with learners."""

from __future__ import annotations

import json

import msgpack
import pytest

from ddiloco.core.ledger import OVERWRITTEN, TokenLedger
from ddiloco.core.restart_ledger import RestartLedger
from ddiloco.errors import ConfigError


def busy_ledger(carry: bool = False) -> TokenLedger:
    ledger = TokenLedger(3, carry=carry)
    ledger.trained(0, 100)
    ledger.trained(1, 80)
    ledger.answered(0, 0, (0, 7, 0), 60)
    ledger.answered(0, 0, (0, 7, 1), 100)
    ledger.superseded((0, 7, 0), (0, 7, 1))
    ledger.answered(1, 2, (1, 9, 0), 80)
    ledger.merged_answer((0, 7, 1), 0.5)
    ledger.rebased(1, 1)
    ledger.answered(1, 0, (1, 9, 1), 40)  # still in flight
    ledger.wasted_answer((1, 9, 0), "stale")
    ledger.crashed(0)
    return ledger


@pytest.mark.parametrize(
    "codec",
    [
        lambda s: json.loads(json.dumps(s)),
        lambda s: msgpack.unpackb(msgpack.packb(s, use_bin_type=True), raw=False),
    ],
    ids=["json", "msgpack"],
)
@pytest.mark.parametrize("carry", [False, True], ids=["overwrite", "carry"])
def test_a_ledger_round_trips_through_plain_data_and_goes_on_identically(codec, carry):
    ledger = busy_ledger(carry)
    state = codec(ledger.to_state())
    copy = TokenLedger.from_state(state)
    assert copy.to_state() == ledger.to_state()
    assert copy.summary() == ledger.summary()
    assert copy.pending() == ledger.pending() and copy.is_open((1, 9, 1))
    for book in (ledger, copy):  # the copy keeps counting where the original would
        book.trained(1, 20)
        book.merged_answer((1, 9, 1), 0.25)
        book.rebased(1, 0)  # carry: the 60 tokens after its answer stay pending
        book.close()
    assert copy.to_state() == ledger.to_state() and copy.balanced()
    assert copy.summary()["tokens_carried"] == ((80 + 60) / 3 if carry else 0)  # both rebases
    assert ("overwritten" in copy.summary()["tokens_wasted"]) is not carry


def test_a_carrying_ledgers_state_is_refused_by_one_that_overwrites_and_back():
    with pytest.raises(ConfigError, match="carry"):
        TokenLedger(3).load_state(busy_ledger(carry=True).to_state())
    with pytest.raises(ConfigError, match="carry"):
        TokenLedger(3, carry=True).load_state(busy_ledger().to_state())


def test_a_state_for_another_plan_damaged_or_unbalanced_is_refused():
    state = busy_ledger().to_state()
    with pytest.raises(ConfigError, match="fragments"):
        TokenLedger(4).load_state(state)
    with pytest.raises(ConfigError, match="malformed"):
        TokenLedger.from_state({**state, "merged": [1, -2, 3]})
    with pytest.raises(ConfigError, match="balance"):
        TokenLedger.from_state({**state, "trained_tokens": state["trained_tokens"] + 1})
    with pytest.raises(ConfigError, match="plain state"):
        bad = TokenLedger(1)
        bad.trained(0, 1)
        bad.answered(0, 0, object(), 1)
        bad.to_state()


def test_a_merge_is_counted_when_its_caller_books_it_so_a_snapshot_counts_durable_ones():
    """The processes' syncer books each merge right before it writes it to disk: a snapshot
    taken with the first of two merges of one poll counts that one, not the second."""
    from ddiloco.core.rounds import AnswerMeta, ClosedRound
    from ddiloco.core.syncer_state import MergeResult

    ledger = RestartLedger(2)
    ledger.joined(0, 5, 0, [0, 0])
    ledger.reported(0, 1, 64, [], [0, 0])
    ledger.answered(0, 0, (0, 5, 0), 64, 0)
    ledger.answered(0, 1, (0, 5, 1), 64, 0)

    def merged(p: int) -> MergeResult:  # what SyncerState.poll returns for fragment p
        answer = AnswerMeta(0, 5, p, p, 0, 0, 1, 1, 64)
        rnd = ClosedRound(p, 0, 0, (answer,), 0.0, 0.0, 0.0, 0.0, 1)
        return MergeResult(p, 1, [], rnd, {0: 1.0}, 0.0, credits=((answer.key, 1.0),))

    first, second = merged(0), merged(1)  # two rounds merged in one poll
    assert ledger.merged == [0, 0]  # nothing is counted before it is booked
    first.book(ledger)
    snapshot = ledger.to_state()  # (written with the first merge's file)
    assert snapshot["merged"] == [64, 0] and snapshot["answers"][0][0] == [0, 5, 1]
    second.book(ledger)
    assert ledger.merged == [64, 64] and ledger.errors == 0
    second.book(ledger)  # booked twice: a contradiction, counted
    assert ledger.errors == 1


def test_a_restarted_ledger_reconciles_what_learners_told_the_lost_life():
    per_step, P = 10, 2
    old = RestartLedger(P)
    old.joined(0, 5, 0, [0, 0])
    for step in range(1, 5):
        old.reported(0, step, per_step, [], [0, 0])
    old.answered(0, 0, (0, 5, 0), 40, 0)
    old.answered(0, 1, (0, 5, 1), 40, 0)
    old.merged_answer((0, 5, 0), 1.0)  # fragment 0 -> version 1, durable with this snapshot
    snapshot = json.loads(json.dumps(old.to_state()))
    # what the dead syncer heard after its last snapshot, never made durable: two steps,
    # the rebase onto version 1 of fragment 0, an answer (superseding the open one)
    old.reported(0, 5, per_step, [], [1, 0])
    old.reported(0, 6, per_step, [0], [1, 0])
    old.answered(0, 1, (0, 5, 2), 60, 0)
    old.superseded((0, 5, 1), (0, 5, 2))

    new = RestartLedger(P)
    new.load_state(snapshot)
    assert new.absent() == [0]
    new.joined(0, 5, 7, [1, 0])  # the hello: it is on version 1 of fragment 0
    assert new.restart["lost_rebases"] == 1
    assert new.reported(0, 8, 2 * per_step, [], [1, 0]) == 4 * per_step  # 2 steps lost
    new.answered(0, 1, (0, 5, 1), 40, 0)  # re-pushed, open in the snapshot: same answer
    new.answered(0, 1, (0, 5, 2), 60, 0)  # re-pushed, never recorded: 20 new tokens
    new.answered(0, 0, (0, 5, 3), 30, 1)  # a new answer on the new base
    new.answered(0, 0, (0, 5, 99), 40, 0)  # an answer on a base it left: no new tokens
    new.superseded((0, 5, 1), (0, 5, 2))
    new.merged_answer((0, 5, 2), 1.0)
    new.merged_answer((0, 5, 3), 1.0)
    new.wasted_answer((0, 5, 99), "base_already_merged")
    new.close()
    assert new.errors == 0 and new.balanced()
    assert new.trained_tokens == 8 * per_step  # every step counted once
    assert new.merged == [40 + 30, 80 - 0 - 20] and new.restart["stale_repushes"] == 1
    # the steps the lost life heard of come back after the rebase it missed: step 5, in
    # truth overwritten on fragment 0, ends "unsynced" there, so the totals stay exact
    assert OVERWRITTEN not in new.wasted and new.wasted["unsynced_at_end"] == [10, 20]
    assert new.restart["repushed_open"] == 1


def test_answers_re_reported_early_are_not_counted_again_by_the_step_gap():
    old = RestartLedger(1)
    old.joined(0, 5, 0, [0])
    old.reported(0, 1, 10, [], [0])
    old.reported(0, 2, 10, [], [0])
    new = RestartLedger(1)
    new.load_state(old.to_state())
    new.joined(0, 5, 4, [0])
    new.answered(0, 0, (0, 5, 0), 40, 0)  # before any report: steps 3-4 re-reported here
    assert new.trained_tokens == 40
    assert new.reported(0, 5, 10, [], [0]) == 10  # the gap (3 steps) minus those 2
    assert new.trained_tokens == 50 and new.errors == 0 and new.balanced()


def test_a_new_life_after_a_restart_loses_the_old_one_and_unknown_calls_stay_errors():
    old = RestartLedger(1)
    old.joined(0, 5, 0, [0])
    old.reported(0, 1, 10, [], [0])
    old.joined(1, 6, 0, [0])
    old.reported(1, 1, 10, [], [0])
    new = RestartLedger(1)
    new.load_state(old.to_state())
    new.joined(0, 8, 0, [0])  # learner 0 died meanwhile: a new life
    assert new.wasted["crash"] == [10]
    new.answered(0, 0, (0, 8, 0), 50, 0)  # more than this life trained: a genuine error
    assert new.errors == 1
    for m in new.absent():  # learner 1 never came back
        new.crashed(m)
    new.close()
    assert new.wasted["crash"] == [20] and new.balanced()


# What setup.TolerantLedger (the RestartLedger before it moved to the core) wrote for the
# calls of _scenario: stores written before the move must load, and the format not drift.
OLD_STATE = {
    "answers": [[[1, 3, 0], 1, 1, 24, 24, 3]],
    "merged": [30, 0],
    "merged_weight": 1.0,
    "num_fragments": 2,
    "reserved": [[1, 1, 24]],
    "since_base": [[0, 0, 10], [0, 1, 40], [1, 0, 24], [1, 1, 24]],
    "steps_since_base": [[0, 0, 1], [0, 1, 4], [1, 0, 3], [1, 1, 3]],
    "tolerant": {
        "errors": 1,
        "floor": [[0, 0, 1], [0, 1, 0], [1, 0, 0], [1, 1, 0]],
        "last_step": [[0, 4, 10], [1, 3, 8]],
        "lives": [[0, 5], [1, 3]],
        "restart": {"lost_rebases": 0, "repushed_open": 0, "rereported": 0, "stale_repushes": 0},
    },
    "trained_by_learner": [[0, 40], [1, 24]],
    "trained_tokens": 64,
    "wasted": {},
}


def _scenario() -> RestartLedger:
    ledger = RestartLedger(2)
    ledger.joined(0, 5, 0, [0, 0])
    ledger.joined(1, 3, 0, [0, 0])
    for step in range(1, 4):
        ledger.reported(0, step, 10, [], [0, 0])
        ledger.reported(1, step, 8, [], [0, 0])
    ledger.answered(0, 0, (0, 5, 0), 30, 0)
    ledger.answered(1, 1, (1, 3, 0), 24, 0)
    ledger.merged_answer((0, 5, 0), 1.0)
    ledger.reported(0, 4, 10, [0], [1, 0])
    ledger.answered(0, 0, (0, 5, 1), 99, 1)  # more than trained: an error, not an exception
    return ledger


def test_the_durable_state_is_the_one_stores_already_hold():
    assert json.loads(json.dumps(_scenario().to_state())) == OLD_STATE
    new = RestartLedger(2)
    new.load_state(OLD_STATE)
    assert new.to_state() == OLD_STATE
    assert new.absent() == [0, 1] and new.errors == 1 and new.is_open((1, 3, 0))
    with pytest.raises(ConfigError, match=r"ledger\.tolerant"):
        RestartLedger(2).load_state({**OLD_STATE, "tolerant": {"lives": [["x", 1]]}})


def test_the_restart_ledger_wraps_a_token_ledger_whose_contract_it_does_not_claim():
    ledger = _scenario()
    assert not isinstance(ledger, TokenLedger) and isinstance(ledger.book, TokenLedger)
    assert ledger.answered(1, 0, (1, 3, 1), 24) == 0  # the book's own answered returns 24
    assert ledger.book.is_open((1, 3, 1)) and ledger.book.summary() == ledger.summary()
