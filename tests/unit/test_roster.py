"""The syncer's roster (syncer/roster.py): one record per learner slot, its presence a named
state changed through one method per event."""

from __future__ import annotations

from ddiloco.runtime.processes.syncer.roster import Presence, Roster


def test_a_slot_goes_up_down_and_left_through_its_events():
    roster = Roster()
    assert not roster.hello(0, 11, "10.0.0.1:5556")  # a first life: not a restart
    assert roster.get(0).presence is Presence.UP and roster.life(0) == 11
    roster.given_up(0)  # silent for the detection time
    assert roster.get(0).presence is Presence.DOWN and roster.registered() == [0]
    assert roster.hello(0, 12, "10.0.0.2:5556")  # a new life: a restart
    assert (roster.get(0).presence, roster.address(0)) == (Presence.UP, "10.0.0.2:5556")
    assert not roster.hello(0, 12, "10.0.0.2:5556")  # the same life again: not a restart
    roster.bye(0)
    assert roster.get(0).presence is Presence.LEFT and roster.life(0) is None
    assert roster.registered() == [] and 0 in roster  # still listed, as left
    assert not roster.hello(0, 13, "")  # back after a clean leave: not a restart either


def test_the_credit_budget_starts_each_life_once():
    roster = Roster()
    roster.hello(2, 7, "")
    assert roster.new_budget_life(2, 7) and not roster.new_budget_life(2, 7)
    roster.hello(2, 8, "")
    assert roster.new_budget_life(2, 8)


def test_unknown_slots_have_no_life_and_no_address():
    roster = Roster()
    roster.given_up(3)
    roster.bye(3)
    assert roster.life(3) is None and roster.address(3) == "" and roster.members() == []
