"""The status page and the summary are pure functions of a frozen view (syncer/view.py) that
the service builds each beat: the view is a copy (the service going on does not change it),
and both renderings read nothing else."""

from __future__ import annotations

import dataclasses
import json

import pytest
from test_syncer_handlers import service  # noqa: F401  (the fixture: a real SyncerService)

from ddiloco.report.summary import Uptime
from ddiloco.runtime.processes.syncer.status import snapshot_of
from ddiloco.runtime.processes.syncer.summary import service_summary
from ddiloco.runtime.processes.syncer.view import LearnerView, SyncerView, uptime_at, view_of


def test_a_view_is_a_copy_the_service_going_on_does_not_change(service):  # noqa: F811
    service.conn.sessions[0] = 11
    service.dispatch(0, "hello", {"inc": 11, "step": 0, "versions": [0, 0]}, memoryview(b""))
    view = view_of(service, 100.0)
    before = json.dumps(snapshot_of(view), sort_keys=True)
    assert [(v.learner, v.presence) for v in view.learners][:1] == [(0, "up")]
    service.counts["refused_meta"] += 5  # the service goes on
    service.conn.wire.refused["replay"] += 1
    service.dispatch(0, "bye", {"why": "SIGTERM"}, memoryview(b""))
    assert json.dumps(snapshot_of(view), sort_keys=True) == before
    with pytest.raises(dataclasses.FrozenInstanceError):
        view.tokens = 5  # type: ignore[misc]
    later = view_of(service, 101.0)
    assert later.learners[0].presence == "left" and later.refused != view.refused


def test_the_page_and_the_summary_read_only_the_view():
    view = SyncerView(
        run="r", t=12.3456, data_source="builtin:tinyshakespeare", tokens=4096, budget=8192,
        time_limit=60.0, global_step=8, versions=(3, 2),
        learners=(LearnerView(0, "up", 8, 7, "127.0.0.1:5556", 0.25, {"fragment": 1.0}),
                  LearnerView(1, "down", None, None, "", None, None)),
        answers={"merged_rounds": 5, "stale": 1},
        ledger={"tokens_merged": 3000, "tokens_wasted": {"crash": 96.0}, "tokens_carried": 0,
                "balanced": True},
        ledger_errors=0, ledger_contradictions=(), ledger_restart={}, ledger_late_answers=2,
        refused={"replay": 1}, gatekeeper={}, actions={"enabled": False}, service={},
        bytes_sent=10, bytes_received=20, uptime=0.9, learner_uptime=0.8, down_seconds=2.0,
        step_seconds=0.5, tokens_per_step=64, checkpoint=None, checkpoint_writes={},
        evaluations={"evals": 2}, store_writes=7,
    )  # fmt: skip
    page = snapshot_of(view)
    assert page["t"] == 12.346 and page["rounds"] == 5 and page["versions"] == [3, 2]
    assert page["budget"] == 8192 and page["time_limit"] == 60.0
    assert [row["state"] for row in page["learners"]] == ["up", "down"]
    assert page["learners"][0]["incarnation"] == "7" and page["learners"][1]["incarnation"] == ""
    assert page["uptime"] == 0.9 and page["learner_uptime"] == 0.8  # (the page's "uptime")
    assert "pace" not in page and "restarts" not in page["learners"][0]  # the board's, not here
    assert page["ledger"] == {"tokens_merged": 3000, "tokens_wasted": {"crash": 96.0},
                              "balanced": True}  # fmt: skip
    summary = service_summary(view, final=3.5)
    assert summary["rounds"] == 5 and summary["learner_uptime"] == 0.8
    assert summary["store_writes"] == 7 and summary["ledger_late_answers"] == 2
    assert 0.0 < summary["goodput"] < 1.0  # 2 s down at 0.5 s a step: 256 tokens lost
    assert service_summary(view, final=3.5) == summary  # pure


def test_the_uptime_a_view_shows_counts_the_stretch_since_the_last_change():
    up = Uptime(2, start=None)
    up.account(10.0, 0)  # the first hello: counting starts
    up.account(20.0, 0)  # 10 s with nobody live (down), then 3 live from 20 s on
    assert up.share(40.0) == 0.0  # (the open stretch is not accounted until a change)
    assert uptime_at(up, 40.0, 3) == pytest.approx(20.0 / 30.0)  # what the page shows
    assert uptime_at(up, 40.0, 1) == 0.0  # under the quorum: still down
    assert uptime_at(Uptime(2, start=None), 5.0, 3) == 1.0  # before any hello
    up.account(40.0, 3)  # the service accounts at the end: the summary's is the same
    assert uptime_at(up, 40.0, 3) == up.share(40.0)
