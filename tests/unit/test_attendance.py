"""A learner is down from when it went silent (or its old life's last word, for a restart
quicker than detection) until it contributes again, not until it says hello."""

from __future__ import annotations

import pytest

from ddiloco.runtime.processes.syncer.attendance import Attendance


def started(learners: int = 2) -> Attendance:
    a = Attendance(quorum=1, detect_seconds=2.0)
    a.change(0.0, 0)  # the first hello starts the clock
    for m in range(learners):
        a.heard(m, 0.0)
        a.back(m, restarted=False)  # a first start: no outage
    return a


def test_a_detected_learner_is_down_until_its_answers_are_merged_again():
    a = started()
    a.heard(1, 8.0)
    a.heard(0, 10.0)
    assert a.overdue([0, 1], 10.5) == [1]
    assert a.down_total(10.5) == pytest.approx(2.0)  # since detect_seconds back
    a.heard(1, 20.0)
    a.back(1, restarted=True)  # a new life said hello: still not contributing
    assert a.down_total(25.0) == pytest.approx(25.0 - 8.5)
    a.contributed([0], 28.0)
    assert a.down_total(28.0) == pytest.approx(28.0 - 8.5)
    a.contributed([0, 1], 30.0)
    assert a.down_total(40.0) == pytest.approx(30.0 - 8.5)  # over
    assert a.learner_uptime(100.0, 2) == pytest.approx(1 - 21.5 / 200)


def test_a_restart_quicker_than_detection_is_down_from_its_old_lifes_last_word():
    a = started()
    a.heard(1, 5.0)
    a.heard(1, 7.0)  # the new life's hello (its first message)
    a.back(1, restarted=True)
    a.contributed([1], 12.0)
    assert a.down_total(50.0) == pytest.approx(7.0)


def test_a_first_start_and_a_rehello_are_no_outage():
    a = started()
    a.heard(0, 5.0)
    a.back(0, restarted=False)  # the same life says hello again (a syncer restart)
    a.contributed([0, 1], 6.0)
    assert a.down_total(10.0) == 0.0
    assert a.learner_uptime(10.0, 2) == 1.0
