"""What the status board adds to each snapshot for the page: the pace (tokens/s over the last
30 s, the ETA to the token budget), the tokens-over-time curve (bounded, thinned as the run
goes on), each learner's restarts (its random incarnation changing) and its share of its
last merge; the metrics carry them; an accepted action is answered in words."""

from __future__ import annotations

import http.client
import itertools
import json
from types import SimpleNamespace
from typing import Any

import pytest

from ddiloco.config import ProcessesConfig
from ddiloco.runtime.processes.syncer.actions import ActionGate
from ddiloco.runtime.processes.syncer.status import (
    PROGRESS_KEPT,
    StatusBoard,
    StatusServer,
    pace,
    prometheus,
)
from ddiloco.runtime.processes.syncer.status_page import PAGE

SECRET = bytes(range(32))


def snapshot(t: float, tokens: int, lives: tuple[str, ...] = ("3", "5")) -> dict[str, Any]:
    learners = [
        {"learner": m, "state": "up" if life else "left", "step": 1, "incarnation": life}
        for m, life in enumerate(lives)
    ]
    return {"t": t, "tokens": tokens, "budget": 100_000, "learners": learners, "rounds": 1}


def test_the_pace_is_measured_over_the_last_30_seconds_and_gives_an_eta():
    board = StatusBoard("r")
    for i in range(101):  # 50 s, a beat every 0.5 s: 3000 tokens/s, then 1000 tokens/s
        t = i * 0.5
        board.publish(snapshot(t, int(3000 * t if t <= 20 else 60_000 + 1000 * (t - 20))))
    s = board.snapshot()
    assert s["tokens"] == 90_000 and s["pace"]["tokens_per_second"] == 1000.0  # (not the mean)
    assert s["pace"]["eta_seconds"] == 10.0  # 10,000 tokens left at 1000 tokens/s
    board.publish(snapshot(51.0, 100_000))
    assert board.snapshot()["pace"]["eta_seconds"] == 0.0  # the budget is reached
    assert pace([(0.0, 0), (10.0, 20_000)], 100_000)["eta_seconds"] == 40.0
    # a time limit that comes first is the ETA (seen: "ETA 55m" in a run a 70 s limit ended)
    assert pace([(0.0, 0), (10.0, 20_000)], 100_000, 25.0)["eta_seconds"] == 15.0
    assert pace([(0.0, 0), (10.0, 20_000)], 100_000, 80.0)["eta_seconds"] == 40.0
    assert pace([(0.0, 5), (4.5, 900)], 100_000)["tokens_per_second"] is None  # too soon
    assert pace([(0.0, 5), (10.0, 5)], 100_000)["eta_seconds"] is None  # no progress: no guess
    assert pace([], None) == {"tokens_per_second": None, "eta_seconds": None, "window_seconds": 30}


def test_the_tokens_curve_stays_bounded_over_a_long_run():
    board = StatusBoard("r")
    for i in range(20_000):  # 10,000 s of beats
        board.publish(snapshot(i * 0.5, i * 10))
    curve = board.snapshot()["progress"]
    assert PROGRESS_KEPT // 2 <= len(curve) <= PROGRESS_KEPT
    assert curve[0] == (0.0, 0) and curve[-1][0] >= 9_900.0  # the whole run, thinned
    times = [t for t, _ in curve]
    assert times == sorted(times) and min(b - a for a, b in itertools.pairwise(times)) >= 1.0


def test_a_learner_restart_is_counted_from_its_incarnation_changing():
    board = StatusBoard("r")
    for lives in [("3", "5"), ("3", "5"), ("3", ""), ("3", "9"), ("3", "9"), ("3", "11")]:
        board.publish(snapshot(1.0, 0, lives))  # left, back as 9 (a return), restarted as 11
    rows = board.snapshot()["learners"]
    assert [r["restarts"] for r in rows] == [0, 2]
    assert rows[1]["incarnation"] == "11"  # the raw field stays, for machines


def test_a_merge_gives_each_learner_its_share_and_tokens():
    board = StatusBoard("r")
    answers = [
        SimpleNamespace(learner=0, fragment=2, base_version=6, c_tokens=1024),
        SimpleNamespace(learner=1, fragment=2, base_version=5, c_tokens=512),
    ]
    result = SimpleNamespace(
        version=8, weights={0: 3.0, 1: 1.0}, round=SimpleNamespace(answers=answers)
    )
    board.merged(result, 12.34567)  # type: ignore[arg-type]
    assert board.last_merged[0] == {
        "t": 12.346,
        "fragment": 2,
        "staleness": 1,
        "weight": 3.0,
        "share": 0.75,
        "tokens": 1024,
    }
    assert board.last_merged[1]["share"] == 0.25 and board.last_merged[1]["staleness"] == 2


def test_the_metrics_carry_the_pace_and_the_restarts():
    parser = pytest.importorskip("prometheus_client.parser")
    board = StatusBoard("r")
    board.publish(snapshot(0.0, 0))
    board.publish(snapshot(10.0, 20_000, ("3", "6")))
    text = prometheus(board.snapshot())
    families = {f.name: f for f in parser.text_string_to_metric_families(text)}
    assert families["ddiloco_tokens_per_second"].samples[0].value == 2000.0
    assert families["ddiloco_eta_seconds"].samples[0].value == 40.0
    restarts = {s.labels["learner"]: s.value for s in families["ddiloco_learner_restarts"].samples}
    assert restarts == {"0": 0.0, "1": 1.0}
    for name in ("tokens", "rounds", "tokens_merged"):  # each counter's samples its own
        assert families[f"ddiloco_{name}"].type == "counter", name
        assert families[f"ddiloco_{name}"].samples, name


@pytest.mark.parametrize(
    ("action", "said"),
    [
        ("kill", "learner 1 is being killed, as a crash would kill it"),
        ("leave", "learner 1 is asked to leave cleanly"),
    ],
)
def test_an_accepted_action_is_answered_202_in_words(action, said):
    board, gate = StatusBoard("r"), ActionGate(SECRET, ProcessesConfig())
    board.publish(snapshot(1.0, 0))
    server = StatusServer("127.0.0.1:0", board, gate)
    host, port = server.httpd.server_address[:2]
    try:
        c = http.client.HTTPConnection(str(host), int(port), timeout=5)
        c.request(
            "POST", f"/learners/1/{action}", headers={"Authorization": f"Bearer {SECRET.hex()}"}
        )
        reply = c.getresponse()
        body = json.loads(reply.read())
        c.close()
    finally:
        server.close()
    assert reply.status == 202
    assert body["accepted"] == action and body["learner"] == 1  # (the raw fields stay)
    assert body["message"].startswith(said)
    assert "202" not in body["message"]


def test_the_page_says_what_it_plots_and_in_what_units():
    for words in (
        "tokens trained (all learners)",
        "eval loss (nats/token)",
        "time since the launch (",
        "tokens/s",
        "ETA to the end of the run (token budget or time limit)",
        "share of merge",
        "restarts",
        "the learners do not send it to the syncer",
    ):
        assert words in PAGE, words
    assert "innerHTML" not in PAGE  # what the JSON carries is set as text, never as markup
