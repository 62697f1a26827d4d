"""``ddiloco.train``, the library entry point ``ddiloco train`` calls: a config file with
overrides, a RunConfig, a resume, each writing the run directory the command writes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import ddiloco
from ddiloco.config import load_config
from ddiloco.errors import ConfigError

SMOKE = Path(__file__).resolve().parents[2] / "configs" / "smoke.toml"
SMALL = ["train.tokens=12000", "train.eval_every=6000", "methods=['decoupled']", "chaos=[]"]


def test_a_config_file_with_overrides_trains_and_writes_the_run_directory(tmp_path):
    summaries = ddiloco.train(SMOKE, tmp_path / "run", quiet=True, overrides=SMALL)
    (summary,) = summaries
    assert summary["method"] == "decoupled" and summary["tokens"] >= 12000
    assert summary["ledger_balanced"]
    on_disk = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert on_disk["method"] == "decoupled" and list(on_disk["methods"]) == ["decoupled"]
    assert (tmp_path / "run" / "metrics.jsonl").is_file()
    assert "tokens = 12000" in (tmp_path / "run" / "config.toml").read_text()


def test_a_run_config_is_taken_as_it_is_and_overrides_beside_it_are_refused(tmp_path):
    config = load_config(SMOKE, SMALL)
    with pytest.raises(ConfigError, match="overrides"):
        ddiloco.train(config, tmp_path / "x", overrides=["train.tokens=1"])
    (summary,) = ddiloco.train(config, tmp_path / "run", quiet=True)
    assert summary["tokens"] >= 12000


def test_a_resume_needs_the_run_directory():
    with pytest.raises(ConfigError, match="run directory"):
        ddiloco.train(resume=True)


def test_importing_the_package_loads_no_torch():
    code = "import sys, ddiloco; assert 'torch' not in sys.modules; ddiloco.train"
    subprocess.run([sys.executable, "-c", code], check=True)
