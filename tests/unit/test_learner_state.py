"""The apply rules of core/learner_state.py, by hand: what a merged fragment leaves behind."""

from __future__ import annotations

import pytest
import torch

from ddiloco.core.learner_state import LearnerSync
from ddiloco.core.plans import TensorSpec, build_plan
from ddiloco.errors import ConfigError

SPECS = [TensorSpec("a.w", (2, 3), 3), TensorSpec("b.w", (4,), 4)]
PLAN = build_plan(SPECS, 2, "tensor", sync_every=2)


def _learner(apply: str, blend: float = 0.5) -> tuple[LearnerSync, dict[str, torch.Tensor]]:
    params = {"a.w": torch.zeros(2, 3), "b.w": torch.zeros(4)}
    return LearnerSync(0, PLAN, params, apply=apply, blend=blend), params


def _fragment_of(name: str) -> int:
    return next(f.index for f in PLAN.fragments if [s.name for s in f.slices] == [name])


def _train(sync: LearnerSync, params: dict[str, torch.Tensor], by: float, tokens: int) -> None:
    for t in params.values():
        t.add_(by)
    sync.stepped(tokens)


@pytest.mark.parametrize("apply", ["overwrite", "blend", "carry"])
def test_each_rule_leaves_what_it_promises_and_moves_the_counters(apply):
    sync, params = _learner(apply, blend=0.25)
    f = _fragment_of("a.w")
    _train(sync, params, 1.0, 10)  # theta = B + 1
    answer = sync.answer(f, 0, params)  # the syncer's copy: S = B + 1
    assert torch.equal(answer.delta[0], torch.ones(2, 3))
    _train(sync, params, 2.0, 7)  # theta = B + 3: progress after the snapshot is 2, 7 tokens
    merged = [torch.full((2, 3), 5.0)]
    assert sync.apply(f, 1, merged, params)
    expected = {"overwrite": 5.0, "blend": 0.25 * 3.0 + 0.75 * 5.0, "carry": 5.0 + 2.0}[apply]
    assert torch.allclose(params["a.w"], torch.full((2, 3), expected))
    assert torch.equal(params["b.w"], torch.full((4,), 3.0))  # the other fragment: untouched
    kept = (1, 7) if apply == "carry" else (0, 0)
    assert (sync.c_steps[f], sync.c_tokens[f]) == kept
    assert sync.versions[f] == 1 and torch.equal(sync.bases[f][0], merged[0])
    # the next answer's delta is against the merged values: carried progress rides with it
    nxt = sync.answer(f, 1, params)
    assert nxt.meta.c_tokens == kept[1] and nxt.meta.base_version == 1
    assert torch.allclose(nxt.delta[0], params["a.w"] - 5.0)


def test_carry_without_an_answer_keeps_all_progress_since_the_base():
    sync, params = _learner("carry")
    f = _fragment_of("b.w")
    _train(sync, params, 1.5, 4)
    _train(sync, params, 1.5, 4)
    assert sync.apply(f, 1, [torch.full((4,), -1.0)], params)
    assert torch.allclose(params["b.w"], torch.full((4,), 2.0))
    assert (sync.c_steps[f], sync.c_tokens[f]) == (2, 8)


def test_an_old_version_changes_nothing_and_a_later_answer_moves_the_snapshot():
    sync, params = _learner("carry")
    f = _fragment_of("b.w")
    _train(sync, params, 1.0, 3)
    sync.answer(f, 0, params)
    _train(sync, params, 1.0, 3)
    sync.answer(f, 1, params)  # a second answer on the same base: the newer snapshot counts
    _train(sync, params, 1.0, 3)
    assert sync.apply(f, 2, [torch.zeros(4)], params)
    assert not sync.apply(f, 1, [torch.full((4,), 9.0)], params)  # older than held: ignored
    assert torch.allclose(params["b.w"], torch.ones(4))
    assert sync.c_tokens[f] == 3


def test_a_copied_learner_carries_only_what_it_trains_after_the_copy():
    peer, peer_params = _learner("carry")
    _train(peer, peer_params, 4.0, 5)  # unpushed progress: the peer's to push, not the copy's
    sync, params = _learner("carry")
    for name, t in peer_params.items():
        params[name].copy_(t)
    sync.load_peer_state(peer.state_dict(), params)
    _train(sync, params, 1.0, 2)
    f = _fragment_of("a.w")
    assert sync.apply(f, 1, [torch.full((2, 3), 10.0)], params)
    assert torch.allclose(params["a.w"], torch.full((2, 3), 11.0))
    assert sync.c_tokens[f] == 2


@pytest.mark.parametrize("apply", ["overwrite", "blend", "carry"])
def test_a_copied_learner_answers_only_what_it_trained_after_the_copy(apply):
    # the peer answered (the syncer may have merged it already) and trained on: a delta of
    # the copy against the peer's base would push the peer's progress a second time
    peer, peer_params = _learner(apply)
    f = _fragment_of("a.w")
    _train(peer, peer_params, 4.0, 5)
    peer.answer(f, 0, peer_params)
    _train(peer, peer_params, 3.0, 5)
    sync, params = _learner(apply)
    for name, t in peer_params.items():
        params[name].copy_(t)
    sync.load_peer_state(peer.state_dict(), params)
    assert sync.versions == peer.versions and sync.step == peer.step
    _train(sync, params, 1.0, 2)
    answer = sync.answer(f, 0, params)
    assert torch.equal(answer.delta[0], torch.ones(2, 3))
    assert (answer.meta.c_steps, answer.meta.c_tokens) == (1, 2)
    assert torch.equal(peer.answer(f, 0, peer_params).delta[0], torch.full((2, 3), 7.0))


def test_an_exact_copy_keeps_the_peers_bases():
    peer, peer_params = _learner("overwrite")
    _train(peer, peer_params, 4.0, 5)
    sync, params = _learner("overwrite")
    sync.load_state(peer.state_dict())
    for name, t in peer_params.items():
        params[name].copy_(t)
    f = _fragment_of("a.w")
    assert torch.equal(sync.answer(f, 0, params).delta[0], torch.full((2, 3), 4.0))


def test_unknown_rules_and_blends_out_of_range_are_refused():
    with pytest.raises(ConfigError, match="apply"):
        _learner("average")
    for alpha in (0.0, 1.0, -0.5):
        with pytest.raises(ConfigError, match="blend"):
            _learner("blend", blend=alpha)
