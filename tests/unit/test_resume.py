"""A resumed run's clock: each method's times go on from its own last record."""

from __future__ import annotations

import json

from ddiloco.config import load_config
from ddiloco.runtime.resume import carry_bytes, finished_methods, held_summaries, last_time


def test_each_method_goes_on_from_its_own_last_record_and_a_new_one_from_zero(tmp_path):
    records = [
        {"method": "decoupled", "kind": "round", "t": 3.0},
        {"method": "decoupled", "kind": "eval", "t": 28.5},
        {"method": "data_parallel", "kind": "step", "t": 7.25},
    ]
    lines = [json.dumps(r) for r in records]
    lines.append('{"method": "decoupled", "kind": "round", "t": 99')  # cut by a crash: skipped
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n[1, 2]\n")
    assert last_time(tmp_path) == 28.5
    assert last_time(tmp_path, "decoupled") == 28.5
    assert last_time(tmp_path, "data_parallel") == 7.25
    assert last_time(tmp_path, "streaming") == 0.0  # never ran: its clock starts at 0
    assert last_time(tmp_path / "nowhere", "decoupled") == 0.0


def test_a_method_at_its_budget_is_not_run_again_and_bytes_add_up(tmp_path, capsys):
    config = load_config(None, ["methods=['decoupled', 'data_parallel']", "train.tokens=1000"])
    done = {"method": "decoupled", "tokens": 1024, "bytes_sent": 5}
    stopped = {"method": "data_parallel", "tokens": 1536, "stop_signal": "SIGINT"}
    held = {**done, "methods": {"decoupled": done, "data_parallel": stopped}}
    (tmp_path / "summary.json").write_text(json.dumps(held))
    assert finished_methods(held_summaries(tmp_path), config) == {"decoupled": done}
    assert "decoupled: finished (1,024 tokens of 1,000): not run again" in capsys.readouterr().out
    raised = load_config(None, ["methods=['decoupled']", "train.tokens=2000"])
    assert finished_methods(held_summaries(tmp_path), raised) == {}  # a raised budget trains on
    (tmp_path / "summary.json").write_text("{not json")
    assert held_summaries(tmp_path) == {}  # unreadable: every method resumes
    (tmp_path / "summary.json").unlink()
    assert held_summaries(tmp_path) == {}
    summary = {"bytes_sent": 7, "bytes_received": 3, "tokens": 3, "bytes_per_token": 10 / 3}
    carry_bytes(summary, done)  # (done received none before)
    assert summary == {"bytes_sent": 12, "bytes_received": 3, "tokens": 3, "bytes_per_token": 5}
    carry_bytes(summary, None)
    assert summary["bytes_sent"] == 12 and summary["bytes_per_token"] == 5
