"""The step boundary (core/boundary.py) by hand: what a learner sends, applies and waits for
between two steps, never-waiting (Decoupled) and lock-step (Streaming DiLoCo, DiLoCo)."""

from __future__ import annotations

import torch

from ddiloco.core.boundary import StepBoundary
from ddiloco.core.fragments import gather
from ddiloco.core.learner_state import LearnerSync
from ddiloco.core.plans import TensorSpec, build_plan
from ddiloco.core.rounds import UNSOLICITED

SPECS = [TensorSpec("a.w", (2, 3), 3), TensorSpec("b.w", (4,), 4)]
PLAN = build_plan(SPECS, 2, "tensor", sync_every=2)  # fragment p is due at steps = p (mod 2)


def learner(waits: bool, overlap: int = 1) -> tuple[StepBoundary, dict[str, torch.Tensor]]:
    params = {"a.w": torch.zeros(2, 3), "b.w": torch.zeros(4)}
    sync = LearnerSync(0, PLAN, params)
    return StepBoundary(sync, overlap=overlap, waits_for_merge=waits), params


def step(boundary: StepBoundary, params: dict[str, torch.Tensor]) -> None:
    for t in params.values():
        t.add_(1.0)
    boundary.sync.stepped(8)


def merged(boundary: StepBoundary, p: int, value: float) -> tuple[int, list[torch.Tensor]]:
    """Fragment ``p`` merged by the syncer: the next version, every value ``value``."""
    current = gather(PLAN, p, {s.name: torch.zeros(s.shape) for s in SPECS})
    return boundary.sync.versions[p] + 1, [torch.full_like(t, value) for t in current]


def test_a_learner_that_never_waits_answers_exactly_what_it_was_asked():
    boundary, params = learner(waits=False)
    step(boundary, params)
    assert boundary.answers({}, params) == []  # nothing due of its own: it is asked
    (answer,) = boundary.answers({1: 7}, params)
    assert (answer.meta.fragment, answer.meta.round_id, answer.meta.c_steps) == (1, 7, 1)
    assert all(torch.equal(d, torch.ones_like(d)) for d in answer.delta)  # theta - base
    assert not boundary.must_wait()
    step(boundary, params)
    assert [a.meta.fragment for a in boundary.answers({0: 8, 1: 9}, params)] == [0, 1]


def test_answers_come_before_the_merges_they_would_lose():
    boundary, params = learner(waits=False)
    step(boundary, params)
    (answer,) = boundary.answers({0: 3}, params)  # the progress is taken first ...
    assert boundary.apply({0: merged(boundary, 0, 5.0)}, params) == [0]  # ... then overwritten
    assert sum(float(d.sum()) for d in answer.delta) > 0
    p0 = PLAN.fragments[0].slices[0].name
    assert torch.all(params[p0] == 5.0)
    # an older version than the one held is ignored, and nothing is said rebased
    stale = (boundary.sync.versions[0], merged(boundary, 0, -1.0)[1])
    assert boundary.apply({0: stale}, params) == [] and torch.all(params[p0] == 5.0)


def test_a_lock_step_learner_pushes_on_its_schedule_and_waits_for_the_merge():
    boundary, params = learner(waits=True, overlap=1)
    step(boundary, params)  # step 1: fragment 1 is due
    (push,) = boundary.answers({}, params)
    assert (push.meta.fragment, push.meta.round_id) == (1, UNSOLICITED)
    assert boundary.answers({}, params, step_end=False) == []  # not twice at one step
    assert boundary.answers({1: 4}, params) == []  # pushed on this base: the ask is answered
    assert not boundary.must_wait()  # tau = 1: it may step once more meanwhile ...
    step(boundary, params)  # step 2: fragment 0 is due
    assert [a.meta.fragment for a in boundary.answers({}, params)] == [0]
    assert boundary.must_wait()  # ... not twice: fragment 1's merge has not come back
    assert boundary.apply({1: merged(boundary, 1, 2.0)}, params) == [1]
    assert not boundary.must_wait()  # (fragment 0, pushed at this step, may come later)
    assert boundary.answers({0: 9}, params, step_end=False) == []  # pushed on this base
    # the syncer's final rounds: every ask is owed, pushed or not
    assert [a.meta.fragment for a in boundary.answers({0: 9}, params, final=True)] == [0]


def test_a_replaced_state_owes_nothing():
    boundary, params = learner(waits=True)
    step(boundary, params)
    boundary.answers({}, params)
    step(boundary, params)
    assert boundary.must_wait()
    boundary.forget()  # a crash, a copy from a peer
    assert not boundary.must_wait() and boundary.sent == {}
