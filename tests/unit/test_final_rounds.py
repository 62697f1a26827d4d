"""The syncer's final rounds (syncer/final_rounds.py), without a network: each learner is
asked for one owed fragment at a time, in fragment order and at its own pace; a learner that
does not answer holds up no one else's answers and the rounds end at their deadline."""

from __future__ import annotations

import threading
import time

import torch

from ddiloco.core.outer import OuterConfig
from ddiloco.core.plans import TensorSpec, build_plan
from ddiloco.core.restart_ledger import RestartLedger
from ddiloco.core.rounds import AnswerMeta, Round, RoundConfig, Verdict
from ddiloco.core.syncer_state import SyncerConfig, SyncerState
from ddiloco.runtime.processes.syncer.final_rounds import FinalRounds
from ddiloco.runtime.processes.transport.events import Events

SPECS = [TensorSpec(f"blocks.{i}.w", (4, 4), 4) for i in range(3)]


def rig(answering: set[int]):
    """Two live learners; those in ``answering`` answer each final ask at the next turn."""
    plan = build_plan(SPECS, 3, "tensor", sync_every=3)
    cfg = SyncerConfig(RoundConfig(quorum=1), "rda", OuterConfig("sgd", lr=1.0))
    syncer = SyncerState(plan, {s.name: torch.zeros(s.shape) for s in SPECS}, cfg)
    for m in (0, 1):
        syncer.join(m)
    records: list[dict] = []
    events = Events(time.time(), sink=records.append)
    asked: list[tuple[int, int]] = []  # (learner, fragment), in order
    pending: list[tuple[int, Round]] = []

    def ask(rnd: Round, learners: list[int]) -> None:
        for m in learners:
            asked.append((m, rnd.fragment))
            if m in answering:
                pending.append((m, rnd))

    def turn() -> None:
        while pending:
            m, rnd = pending.pop(0)
            delta = [torch.full_like(t, 0.1) for t in syncer.fragments[rnd.fragment]]
            meta = AnswerMeta(m, 0, len(asked), rnd.fragment, rnd.round_id, 0, 2, 1, 10)
            assert syncer.on_answer(meta, delta, events.now()) is Verdict.ACCEPTED
        syncer.poll(events.now())
        time.sleep(0.001)

    final = FinalRounds(syncer, RestartLedger(3), events, turn=turn, ask=ask,
                        stop=threading.Event(), detect_seconds=0.1)  # fmt: skip
    return final, syncer, asked, records


def test_every_learner_answers_every_fragment_once_more_one_fragment_at_a_time():
    final, syncer, asked, records = rig(answering={0, 1})
    final.run(seconds=5.0)
    assert syncer.finished
    assert [f for m, f in asked if m == 0] == [0, 1, 2] == [f for m, f in asked if m == 1]
    (done,) = [r for r in records if r["kind"] == "final_rounds"]
    assert done["merged"] == done["fragments"] == 3 and done["seconds"] < 5.0


def test_a_silent_learner_holds_up_no_one_and_the_rounds_end_at_their_deadline(caplog):
    final, syncer, asked, records = rig(answering={0})
    final.run(seconds=0.3)
    assert syncer.finished
    assert [f for m, f in asked if m == 0] == [0, 1, 2]  # learner 0 was not held up
    assert {f for m, f in asked if m == 1} == {0}  # learner 1 still owed fragment 0
    assert "ran out their" in caplog.text
    (done,) = [r for r in records if r["kind"] == "final_rounds"]
    assert done["seconds"] >= 0.3
