"""A learner's snapshot survives the trip to bytes and back: weights, AdamW, step, position."""

from __future__ import annotations

import torch

from ddiloco.config import TrainConfig
from ddiloco.core.learner_state import LearnerSync
from ddiloco.core.plans import build_plan, tensor_specs
from ddiloco.data.corpus import BatchStream
from ddiloco.models.registry import build_model
from ddiloco.runtime.processes.transport.tree import pack_tree, unpack_tree
from ddiloco.trainer import Trainer


def test_plain_values_and_tensors_of_any_dtype_and_rank_round_trip():
    tree = {
        "a": [torch.tensor(3.5), torch.arange(6).view(2, 3), torch.zeros(0, 4)],
        "b": (1, 0.5, None, "x", True),
        7: {"bf16": torch.ones(3, dtype=torch.bfloat16), "mask": torch.tensor([True, False])},
    }
    back = unpack_tree(pack_tree(tree))
    assert back["b"] == (1, 0.5, None, "x", True)
    assert torch.equal(back["a"][0], tree["a"][0]) and back["a"][0].dim() == 0
    assert torch.equal(back["a"][1], tree["a"][1]) and back["a"][2].shape == (0, 4)
    assert back[7]["bf16"].dtype == torch.bfloat16 and back[7]["mask"].tolist() == [True, False]


def test_a_newcomer_loaded_from_a_snapshot_trains_exactly_like_its_peer():
    torch.manual_seed(0)
    tokens = torch.randint(0, 256, (5000,), dtype=torch.uint8)
    config = TrainConfig(batch_size=2, warmup_steps=1)

    def learner() -> tuple[Trainer, LearnerSync]:
        torch.manual_seed(0)
        model = build_model("gpt-tiny")
        trainer = Trainer(model, BatchStream(tokens, 2, 64, 1), config, 100)
        plan = build_plan(tensor_specs(model), 2, "balanced", sync_every=2)
        return trainer, LearnerSync(0, plan, trainer.params())

    peer, peer_sync = learner()
    for _ in range(3):
        peer.train_step()
        peer_sync.stepped(128)
    blob = pack_tree({"trainer": peer.state(), "sync": peer_sync.state_dict()})
    newcomer, new_sync = learner()
    state = unpack_tree(blob)
    newcomer.load_state(state["trainer"])
    new_sync.load_state(state["sync"])  # exact: the bases too (another rank of the peer)
    assert all(
        torch.equal(a, b)
        for fa, fb in zip(new_sync.bases, peer_sync.bases, strict=True)
        for a, b in zip(fa, fb, strict=True)
    )
    assert new_sync.step == 3 and newcomer.stream.position == peer.stream.position
    loss_peer, _ = peer.train_step()
    loss_new, _ = newcomer.train_step()
    assert loss_new == loss_peer
    for a, b in zip(peer.model.parameters(), newcomer.model.parameters(), strict=True):
        assert torch.equal(a, b)
