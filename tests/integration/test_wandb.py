"""W&B runs hold the run's scalars: written offline (no network, no API key) and read back
from W&B's own record files (a LevelDB-style log of its protobuf records)."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import pytest

from ddiloco import train
from ddiloco.config import load_config

pytest.importorskip("wandb", reason="the W&B sink needs the extra: pip install 'ddiloco[wandb]'")

BLOCK, HEADER = 32768, 7  # the log's block size and record header (crc32, length, type)


def records(path: Path) -> list[Any]:
    """Every protobuf record of a ``.wandb`` file (file header ``:W&B``, magic, version)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B", path
    out, pos, pending = [], 7, b""
    while pos + HEADER <= len(data):
        room = BLOCK - pos % BLOCK
        if room < HEADER:  # a block's tail too short for a header is padding
            pos += room
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + HEADER])
        if length == 0 and kind == 0:
            pos += room
            continue
        chunk = data[pos + HEADER : pos + HEADER + length]
        pos += HEADER + length
        pending = chunk if kind in (1, 2) else pending + chunk  # full/first, middle/last
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(pending)
            out.append(record)
    return out


def history(path: Path) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    rows, summary = [], {}
    for r in records(path):
        kind = r.WhichOneof("record_type")
        items = (
            r.history.item if kind == "history" else r.summary.update if kind == "summary" else []
        )
        row = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in items}
        (rows.append(row) if kind == "history" else summary.update(row))
    return rows, summary


def test_an_offline_run_logs_the_named_scalars_and_the_summary_for_every_method(
    tmp_path, monkeypatch
):
    for key in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_DIR"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))  # (no key: auto is offline)
    config = load_config(
        "configs/smoke.toml",
        ["train.tokens=20000", "train.eval_every=10000", "report.wandb='ddiloco-test'"],
    )
    summaries = train(config, tmp_path, quiet=True)
    runs = sorted((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == len(summaries) == 2, runs
    by_method = {}
    for path in runs:
        rows, summary = history(path)
        (run,) = [r.run for r in records(path) if r.WhichOneof("record_type") == "run"]
        method = next(json.loads(i.value_json) for i in run.config.update if i.key == "method")
        assert run.project == "ddiloco-test" and run.run_group == tmp_path.name
        by_method[method] = (rows, summary)
    for s in summaries:
        rows, summary = by_method[s["method"]]
        losses = [
            r["loss_metrics/global_avg_loss"] for r in rows if "loss_metrics/global_avg_loss" in r
        ]
        assert len(losses) >= 2 and losses[-1] < losses[0]  # it learned, point by point
        tokens = [r["tokens"] for r in rows]
        assert tokens == sorted(tokens) and tokens[-1] <= s["tokens"]  # the x axis
        evals = [r["loss_metrics/eval_loss"] for r in rows if "loss_metrics/eval_loss" in r]
        assert evals[-1] == pytest.approx(s["eval_loss"], rel=1e-5)
        assert summary["eval_loss"] == pytest.approx(s["eval_loss"])
        assert summary["goodput"] == pytest.approx(s["goodput"])
    rows, _ = by_method["decoupled"]
    names = {k for r in rows for k in r}
    assert {
        "sync/round_close_ms",
        "sync/staleness",
        "ledger/tokens_merged",
        "learner/1/state",
    } <= names
