"""A Hugging Face model on real processes: ``ddiloco train --runtime processes`` with
``model = "hf:PATH"`` (a tiny GPT-2 config saved in the test) and two learner processes, each
building the same random init from the run's seed."""

from __future__ import annotations

import json

import pytest
from bases import SHORT

from ddiloco.cli import main

transformers = pytest.importorskip("transformers")

BASE = [*SHORT, "chaos=[]", "processes.max_wall_seconds=90"]  # the model: hf:PATH, below


def test_a_tiny_gpt2_trains_as_two_learner_processes(tmp_path):
    config = transformers.GPT2Config(
        n_layer=2, n_head=2, n_embd=32, n_positions=64, vocab_size=256, bos_token_id=0,
        eos_token_id=0,
    )  # fmt: skip
    config.save_pretrained(tmp_path / "gpt2")
    out = tmp_path / "run"
    argv = ["train", "--runtime", "processes", "--quiet", "--out", str(out)]
    for item in [*BASE, f"model='hf:{tmp_path / 'gpt2'}'"]:
        argv += ["--set", item]
    assert main(argv) == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [r["loss"] for r in records if r["kind"] == "eval"]
    assert len(evals) >= 2 and evals[-1] < evals[0]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["tokens"] >= 12000 and summary["rounds"] > 0 and summary["ledger_balanced"]
    saved = json.loads((out / summary["checkpoint"] / "config.json").read_text())
    assert saved["model_type"] == "gpt2"  # the HF model itself trained, and came back out
