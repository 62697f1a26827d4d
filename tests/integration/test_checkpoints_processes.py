"""A model comes out of every processes run: the syncer's checkpoints (written on a thread
while it merges, the last after the last merge), the data-parallel job's rank 0's, and for a
run that stopped before its last checkpoint, an export from the syncer's store or the job's
rollback checkpoints."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from bases import SMALL

from ddiloco import train
from ddiloco.checkpoints.format import steps_in
from ddiloco.checkpoints.load import load_checkpoint
from ddiloco.cli import main
from ddiloco.config import load_config
from ddiloco.data.corpus import split_corpus
from ddiloco.runtime.run import make_eval_batches
from ddiloco.trainer import evaluate

STEP_TOKENS = 2 * 4 * 64  # learners x batch_size x gpt-tiny's context


def test_a_processes_run_checkpoints_and_exports_from_its_store(tmp_path, capsys):
    config = load_config(
        None,
        [
            *SMALL,
            "methods=['decoupled', 'data_parallel']",
            "train.tokens=12288",  # 24 equivalent steps
            "train.checkpoint_every=4096",  # every 8
            "data_parallel.checkpoint_every=10",
            "processes.max_wall_seconds=120",
            "chaos=[]",
        ],
    )
    run = tmp_path / "run"
    summaries = {s["method"]: s for s in train(config, run, quiet=True)}
    batches = make_eval_batches(config, split_corpus(config.data.source, 2), 64)
    for method, home in (
        ("decoupled", "checkpoints"),
        ("data_parallel", "checkpoints/data_parallel"),
    ):
        s = summaries[method]
        steps = steps_in(run / home)
        assert len(steps) >= 2 and s["checkpoint"] == f"{home}/step-{steps[-1]}", method
        final = load_checkpoint(run / s["checkpoint"])
        assert final.manifest["tokens"] // STEP_TOKENS == final.step == steps[-1]
        assert evaluate(final.model, batches) == pytest.approx(s["eval_loss"], abs=1e-4)
        assert s["eval_bpb"] == pytest.approx(s["eval_loss"] / 0.6931471805599453)
    assert summaries["decoupled"]["checkpoint_writes"]["checkpoint_failed"] == 0
    # the syncer holds the run secret: its checkpoints are authenticated (the DP job's are
    # digested only), and eval of the run checks them under the secret the run keeps
    assert "mac" in load_checkpoint(run / summaries["decoupled"]["checkpoint"]).manifest
    assert "mac" not in load_checkpoint(run / summaries["data_parallel"]["checkpoint"]).manifest
    assert main(["eval", str(run), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["eval_loss"] == pytest.approx(
        summaries["decoupled"]["eval_loss"], abs=1e-4
    )

    # the syncer's store holds the global model of the last merge: the final checkpoint's
    assert main(["export", str(run), "--store", "--out", str(tmp_path / "store")]) == 0
    assert "the processes' state" in capsys.readouterr().out
    final = load_checkpoint(run / summaries["decoupled"]["checkpoint"]).model.state_dict()
    exported = load_checkpoint(tmp_path / "store").model.state_dict()
    assert all(torch.equal(final[k], v) for k, v in exported.items())

    # a run that crashed early: export finds the newer store on its own (every checkpoint
    # but the first is gone; the store holds every merge after it)
    for step in steps_in(run / "checkpoints")[1:]:
        shutil.rmtree(run / "checkpoints" / f"step-{step}")
    (run / "summary.json").unlink()
    assert main(["export", str(run), "--out", str(tmp_path / "crashed")]) == 0
    assert "the processes' state" in capsys.readouterr().out
    assert load_checkpoint(tmp_path / "crashed").model.state_dict().keys() == exported.keys()

    # with no checkpoint at all, eval and sample use the store
    shutil.rmtree(run / "checkpoints")
    assert main(["eval", str(run), "--json"]) == 0
    loss = json.loads(capsys.readouterr().out)["eval_loss"]
    assert loss == pytest.approx(summaries["decoupled"]["eval_loss"], abs=1e-4)
    assert main(["sample", str(run), "--prompt", "KING:", "--tokens", "5", "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)["tokens"]) == 5

    # the data-parallel job's rollback checkpoints give its model back too
    out = tmp_path / "dp"
    assert main(["export", str(run), "--method", "data_parallel", "--out", str(out)]) == 0
    assert "ckpt-" in capsys.readouterr().out
    assert load_checkpoint(out).method == "data_parallel"
