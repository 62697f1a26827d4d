"""Merge rules: token weights, weighted mean, radial-directional averaging."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ddiloco.core.codec import CodecSpec, PackedTensors, encode_tensors
from ddiloco.core.merge import merge, radial_directional_average, token_weight, weighted_mean
from ddiloco.errors import ConfigError

weights_st = st.lists(st.floats(0.1, 10.0), min_size=1, max_size=8)


def _updates(num: int, shapes: list[tuple[int, ...]], seed: int) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(s, generator=g) for s in shapes] for _ in range(num)]


def test_token_weight_is_tokens_times_tokens_per_step():
    assert token_weight(1000, 10) == 1000 * 100
    assert token_weight(0, 0) == 0.0
    assert token_weight(0, 5) == 0.0
    assert token_weight(5, 0) == 0.0


@pytest.mark.parametrize("field,args", [("c_tokens", (-1, 3)), ("c_steps", (3, -1))])
def test_token_weight_refuses_negative_counters(field, args):
    with pytest.raises(ConfigError, match=field):
        token_weight(*args)


@settings(max_examples=40, deadline=None)
@given(m=st.integers(1, 16), dim=st.integers(16, 64), seed=st.integers(0, 10_000))
def test_rda_keeps_mean_norm_for_orthogonal_inputs(m, dim, seed):
    """Orthogonal outer gradients: a plain mean shrinks like 1/sqrt(M), RDA keeps the norm."""
    g = torch.Generator().manual_seed(seed)
    basis, _ = torch.linalg.qr(torch.randn(dim, dim, generator=g, dtype=torch.float64))
    norms = torch.rand(m, generator=g, dtype=torch.float64) * 3 + 0.5
    weights = (torch.rand(m, generator=g, dtype=torch.float64) + 0.1).tolist()
    updates = [[(basis[:, i] * norms[i]).float()] for i in range(m)]
    (out,) = radial_directional_average(updates, weights)
    expected = sum(w * float(n) for w, n in zip(weights, norms, strict=True)) / sum(weights)
    assert float(out.norm()) == pytest.approx(expected, rel=1e-4)
    if m >= 4:  # and the plain mean really does shrink
        (mean,) = weighted_mean(updates, [1.0] * m)
        assert float(mean.norm()) < 0.8 * float(
            torch.stack([u[0] for u in updates]).norm(dim=1).mean()
        )


@settings(max_examples=40, deadline=None)
@given(weights=weights_st, seed=st.integers(0, 10_000), rule=st.sampled_from(["rda", "mean"]))
def test_equal_inputs_merge_to_themselves(weights, seed, rule):
    (base,) = _updates(1, [(7, 5), (11,)], seed)
    out = merge([base] * len(weights), weights, rule)
    for o, b in zip(out, base, strict=True):
        torch.testing.assert_close(o, b, rtol=1e-5, atol=1e-6)


@settings(max_examples=40, deadline=None)
@given(
    weights=weights_st,
    seed=st.integers(0, 10_000),
    rule=st.sampled_from(["rda", "mean"]),
    scale=st.floats(1e-3, 1e3),
    data=st.data(),
)
def test_merges_are_permutation_and_weight_scale_invariant(weights, seed, rule, scale, data):
    updates = _updates(len(weights), [(6, 4), (9,), ()], seed)
    reference = merge(updates, weights, rule, plain_mask=[False, True, False])
    order = data.draw(st.permutations(range(len(weights))))
    permuted = merge(
        [updates[i] for i in order], [weights[i] for i in order], rule, [False, True, False]
    )
    scaled = merge(updates, [w * scale for w in weights], rule, [False, True, False])
    for a, b, c in zip(reference, permuted, scaled, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(a, c, rtol=1e-4, atol=1e-5)


def test_rda_uses_weighted_mean_for_flagged_tensors():
    updates = _updates(3, [(4, 4), (8, 4)], seed=1)
    weights = [1.0, 2.0, 3.0]
    rda = radial_directional_average(updates, weights, plain_mask=[False, True])
    mean = weighted_mean(updates, weights)
    torch.testing.assert_close(rda[1], mean[1])
    assert not torch.allclose(rda[0], mean[0])


def test_rda_falls_back_to_mean_when_directions_cancel():
    v = torch.tensor([1.0, 2.0, -3.0])
    out = radial_directional_average([[v], [-v]], [1.0, 1.0])
    torch.testing.assert_close(out[0], torch.zeros(3))
    out = radial_directional_average([[v], [-v * 3]], [1.0, 1.0])  # directions cancel, norms not
    torch.testing.assert_close(out[0], -v)  # the weighted mean, not a zero or a blown-up step


def test_zero_weight_learners_are_ignored():
    updates = _updates(3, [(5,)], seed=2)
    with_zero = merge(updates, [1.0, 0.0, 2.0])
    without = merge([updates[0], updates[2]], [1.0, 2.0])
    torch.testing.assert_close(with_zero[0], without[0])


def test_rda_norm_is_weighted_mean_of_norms_for_random_inputs():
    updates = _updates(5, [(64,)], seed=3)
    weights = [1.0, 2.0, 3.0, 4.0, 5.0]
    (out,) = radial_directional_average(updates, weights)
    norms = [float(u[0].norm()) for u in updates]
    expected = sum(w * n for w, n in zip(weights, norms, strict=True)) / sum(weights)
    assert math.isclose(float(out.norm()), expected, rel_tol=1e-5)


@pytest.mark.parametrize(
    "updates,weights,field",
    [
        ([], [], "updates"),
        ([[torch.ones(3)]], [1.0, 2.0], "weights"),
        ([[torch.ones(3)], [torch.ones(4)]], [1.0, 1.0], r"updates\[1\]\[0\].shape"),
        ([[torch.ones(3)], [torch.ones(3), torch.ones(1)]], [1.0, 1.0], r"updates\[1\]"),
        ([[torch.ones(3)]], [-1.0], r"weights\[0\]"),
        ([[torch.ones(3)]], [float("nan")], r"weights\[0\]"),
        ([[torch.ones(3)]], [0.0], "weights"),
        ([[torch.ones(3, dtype=torch.int64)]], [1.0], "dtype"),
    ],
)
def test_bad_input_names_the_field(updates, weights, field):
    with pytest.raises(ConfigError, match=field):
        merge(updates, weights)


def test_unknown_rule_and_bad_mask():
    with pytest.raises(ConfigError, match="merge_rule"):
        merge([[torch.ones(2)]], [1.0], rule="median")
    with pytest.raises(ConfigError, match="plain_mask"):
        merge([[torch.ones(2)]], [1.0], plain_mask=[True, False])


@pytest.mark.parametrize("rule", ["rda", "mean"])
def test_updates_kept_encoded_merge_to_the_same_bits_as_decoded_ones(rule):
    decoded = [[t.bfloat16().float() for t in u] for u in _updates(3, [(7, 5), (9,)], seed=4)]
    packed = [PackedTensors(encode_tensors(u, CodecSpec("bf16"))) for u in decoded]
    want = merge(decoded, [1.0, 0.0, 3.0], rule, plain_mask=[False, True])
    got = merge(packed, [1.0, 0.0, 3.0], rule, plain_mask=[False, True])
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    odd = PackedTensors(encode_tensors([torch.ones(7, 5), torch.ones(8)], CodecSpec("bf16")))
    with pytest.raises(ConfigError, match=r"updates\[1\]\[1\].shape"):
        merge([packed[0], odd], [1.0, 1.0], rule)
