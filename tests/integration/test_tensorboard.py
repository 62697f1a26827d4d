"""TensorBoard event files hold the run's scalars, read back with TensorBoard's own reader."""

from __future__ import annotations

import pytest

from ddiloco import train
from ddiloco.config import load_config

event_accumulator = pytest.importorskip(
    "tensorboard.backend.event_processing.event_accumulator",
    reason="the TensorBoard sink needs the extra: pip install 'ddiloco[tensorboard]'",
)


def test_a_run_writes_the_named_scalars_for_every_method(tmp_path):
    config = load_config(
        "configs/smoke.toml",
        ["train.tokens=20000", "train.eval_every=10000", "report.tensorboard=true"],
    )
    summaries = train(config, tmp_path, quiet=True)
    for summary in summaries:
        board = event_accumulator.EventAccumulator(
            str(tmp_path / "tensorboard" / summary["method"])
        )
        board.Reload()
        tags = set(board.Tags()["scalars"])
        assert {"loss_metrics/global_avg_loss", "throughput(tps)", "loss_metrics/eval_loss"} <= tags
        losses = [e.value for e in board.Scalars("loss_metrics/global_avg_loss")]
        assert len(losses) >= 2 and losses[-1] < losses[0]  # it learned, point by point
        evals = board.Scalars("loss_metrics/eval_loss")
        assert evals[-1].value == pytest.approx(summary["eval_loss"], rel=1e-5)
        if summary["method"] == "decoupled":  # the syncer's view, the ledger, the states
            for tag in (
                "sync/round_close_ms",
                "sync/grace_ms",
                "sync/staleness",
                "sync/bytes_out_per_s",
                "ledger/tokens_merged",
                "learner/0/state",
            ):
                assert tag in tags, tag  # fmt: skip
            crashed = [e.value for e in board.Scalars("learner/1/state")]
            assert 0.0 in crashed and crashed[-1] == 1.0  # the smoke plan's crash, recovered
            merged = board.Scalars("ledger/tokens_merged")[-1].value
            assert merged == pytest.approx(summary["tokens_merged"])
            assert any(t.startswith("ledger/tokens_wasted/") for t in tags)
