"""What `ddiloco bandwidth --recovery` says a peer copy moves is what a learner's snapshot holds."""

from __future__ import annotations

import json

import pytest
import torch

from ddiloco.cli import main
from ddiloco.cluster.bandwidth import recovery
from ddiloco.config import TrainConfig
from ddiloco.core.learner_state import LearnerSync
from ddiloco.core.plans import build_plan, tensor_specs
from ddiloco.data.corpus import BatchStream
from ddiloco.errors import ConfigError
from ddiloco.models.registry import build_model
from ddiloco.runtime.processes.transport.tree import Layout
from ddiloco.trainer import Trainer


def test_the_planned_snapshot_is_the_size_of_a_real_one():
    torch.manual_seed(0)
    model = build_model("gpt-tiny")
    tokens = torch.randint(0, 256, (5000,), dtype=torch.uint8)
    trainer = Trainer(model, BatchStream(tokens, 2, 64, 1), TrainConfig(batch_size=2), 100)
    sync = LearnerSync(
        0, build_plan(tensor_specs(model), 4, "balanced", sync_every=4), trainer.params()
    )
    trainer.train_step()  # AdamW's moments exist from the first step on
    peer_sync = {k: v for k, v in sync.state_dict().items() if k != "bases"}  # snapshot_state
    real = Layout({"trainer": trainer.state(), "sync": peer_sync, "learner": 0}).size
    planned = recovery(sum(p.numel() for p in model.parameters()))["snapshot_bytes"]
    assert planned == pytest.approx(real, rel=0.01)


def test_the_recovery_command_prints_the_copy_time_per_link(capsys):
    assert main(["bandwidth", "--recovery", "--params", "1e9", "--link", "1", "0.05"]) == 0
    out = capsys.readouterr().out
    assert "12 GB" in out and "1.6 min" in out and "32.0 min" in out
    argv = ["bandwidth", "--recovery", "--model", "gpt-tiny", "--link", "0.05", "--json"]
    assert main(argv) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["model"] == "gpt-tiny" and data["bytes_per_param"] == pytest.approx(12, rel=0.01)
    assert data["links"][0]["seconds"] == pytest.approx(data["snapshot_bytes"] * 8 / 5e7)
    with pytest.raises(ConfigError):
        recovery(1e9, [0.0])
