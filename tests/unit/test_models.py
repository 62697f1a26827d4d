"""The project's GPT (dense and mixture-of-experts) and the model registry."""

from __future__ import annotations

import pytest
import torch

from ddiloco.errors import ConfigError
from ddiloco.models.gpt import GPT, GPT_CONFIGS, GPTConfig, embedding_names
from ddiloco.models.registry import build_model


@pytest.mark.parametrize("name", ["gpt-tiny", "moe-tiny"])
def test_forward_backward_and_causality(name):
    torch.manual_seed(0)
    model = GPT(GPT_CONFIGS[name])
    x = torch.randint(0, 256, (2, 16))
    logits, loss = model(x, x)
    assert logits.shape == (2, 16, 256) and loss is not None and torch.isfinite(loss)
    loss.backward()
    assert all(p.grad is not None for n, p in model.named_parameters() if "experts" not in n)
    model.eval()
    changed = x.clone()
    changed[:, 10] = (changed[:, 10] + 1) % 256
    a, _ = model(x)
    b, _ = model(changed)
    torch.testing.assert_close(a[:, :10], b[:, :10])  # the future never leaks into the past


def test_sizes_span_the_advertised_range():
    counts = {n: sum(p.numel() for p in GPT(c).parameters()) for n, c in GPT_CONFIGS.items()}
    assert counts["gpt-1m"] == pytest.approx(0.9e6, rel=0.1)
    assert counts["gpt-50m"] == pytest.approx(48e6, rel=0.1)
    assert counts["moe-4m"] > counts["gpt-1m"]


def test_embeddings_are_flagged_for_the_plain_mean():
    assert embedding_names(GPT(GPT_CONFIGS["gpt-tiny"])) == {"tok_emb.weight", "pos_emb.weight"}


def test_moe_routes_to_top_k_and_reports_balance_loss():
    model = GPT(GPT_CONFIGS["moe-tiny"])
    model(torch.randint(0, 256, (2, 8)), torch.randint(0, 256, (2, 8)))
    aux = float(model.blocks[0].mlp.aux.detach())
    assert 0.0 < aux < 4.0  # E * sum(load * mean prob): about 1 when balanced, E at worst


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"n_embd": 10, "n_head": 3}, "model.n_embd"),
        ({"n_layer": 0}, "model.n_layer"),
        ({"n_experts": 2, "top_k": 3}, "model.top_k"),
    ],
)
def test_bad_shapes_name_the_field(kwargs, field):
    with pytest.raises(ConfigError, match=field):
        GPTConfig(**kwargs)


def test_sequence_longer_than_context_is_refused():
    model = GPT(GPT_CONFIGS["gpt-tiny"])
    with pytest.raises(ConfigError, match="sequence_length"):
        model(torch.zeros(1, 65, dtype=torch.long))


def test_registry_refuses_what_is_not_a_module():
    with pytest.raises(ConfigError, match=r"not a torch\.nn\.Module"):
        build_model("builtins:dict")
