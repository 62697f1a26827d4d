"""A hello's fragment versions against the syncer's store (syncer/claims.py), without a
network: a learner holding a version the store never made is refused, and told which."""

from __future__ import annotations

from pathlib import Path

from ddiloco.runtime.processes.syncer.claims import ahead_of_store

STORE = Path("/runs/a/syncer_state")


def test_a_learner_at_or_behind_the_store_may_take_part():
    assert ahead_of_store(0, [3, 2, 0], [3, 4, 1], STORE) is None
    assert ahead_of_store(0, [0, 0], [0, 0], STORE) is None  # a fresh run


def test_a_learner_ahead_of_an_empty_store_is_told_the_store_was_lost_or_another():
    why = ahead_of_store(2, [0, 5, 1], [0, 0, 0], STORE)
    assert why is not None and "learner 2" in why and "up to 5" in why
    assert f"store {STORE} is empty" in why and "--store" in why


def test_a_learner_ahead_of_an_older_store_is_told_the_first_fragment_and_both_versions():
    why = ahead_of_store(1, [4, 9, 7], [4, 6, 8], STORE)
    assert why is not None and "fragment 1 at version 9" in why and "at version 6" in why
    assert "older than the run" in why
