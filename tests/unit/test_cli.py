"""The command line: ``ddiloco plan`` output and error handling."""

from __future__ import annotations

import json

import pytest

from ddiloco.cli import main


def test_plan_json_has_the_promised_fields(capsys):
    assert main(["plan", "--model", "gpt-tiny", "--fragments", "4", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["imbalance"] >= 1.0
    assert len(data["fragments"]) == 4
    assert data["peak_bytes_per_step"] >= data["mean_bytes_per_step"] > 0
    names = {t["name"] for f in data["fragments"] for t in f["tensors"]}
    assert "tok_emb.weight" in names and "head.weight" in names


def test_plan_table_for_people(capsys):
    assert main(["plan", "--model", "gpt-tiny", "--fragments", "3", "--partition", "layer"]) == 0
    out = capsys.readouterr().out
    assert "imbalance (max/mean fragment bytes)" in out
    assert "partition layer, P=3" in out


def test_plan_accepts_any_module_function(tmp_path, monkeypatch, capsys):
    (tmp_path / "mymodels.py").write_text(
        "import torch\n"
        "def build():\n"
        "    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["plan", "--model", "mymodels:build", "--fragments", "2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["num_fragments"] == 2


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["plan", "--model", "gpt-huge"], "model='gpt-huge'"),
        (["plan", "--model", "no_such_module_xyz:f"], "cannot import"),
        (["plan", "--fragments", "0"], "num_fragments=0"),
        (["plan", "--model", "gpt-tiny", "-P", "500", "--no-split-rows"], "num_fragments"),
    ],
)
def test_bad_input_is_a_clear_error_not_a_traceback(argv, needle, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err


def test_unknown_partition_is_refused_by_argparse(capsys):
    with pytest.raises(SystemExit):
        main(["plan", "--partition", "random"])
    assert "invalid choice" in capsys.readouterr().err


def test_plan_with_no_options_is_the_plan_a_default_training_run_uses(capsys):
    from ddiloco.config import RunConfig
    from ddiloco.runtime.run import RunSetup

    assert main(["plan", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    default = RunConfig()
    assert shown["model"] == default.model and shown["split_rows"] == default.sync.split_rows
    assert shown["num_fragments"] == default.sync.fragments
    assert shown["sync_every"] == default.sync.sync_every
    trained = RunSetup(default).plan.to_dict()  # the plan `ddiloco train` builds
    assert {k: v for k, v in shown.items() if k not in ("model", "split_rows")} == trained
    assert main(["plan"]) == 0
    out = capsys.readouterr().out
    assert f"partition balanced, split_rows, P={default.sync.fragments} fragments" in out
    assert main(["plan", "--model", "gpt-tiny", "-P", "40", "--json"]) == 0  # (rows split)
    shown = json.loads(capsys.readouterr().out)
    assert any(t.get("rows") for f in shown["fragments"] for t in f["tensors"])


def test_plan_takes_a_runs_config_and_its_options_override_it(tmp_path, capsys):
    from ddiloco.config import load_config, to_toml
    from ddiloco.runtime.run import RunSetup

    config = load_config("configs/smoke.toml", ["sync.fragments=3"])
    assert (
        main(["plan", "--config", "configs/smoke.toml", "--set", "sync.fragments=3", "--json"]) == 0
    )
    shown = json.loads(capsys.readouterr().out)
    assert shown["model"] == "gpt-tiny" and shown["num_fragments"] == 3
    assert shown["sync_every"] == config.sync.sync_every
    assert {k: v for k, v in shown.items() if k not in ("model", "split_rows")} == (
        RunSetup(config).plan.to_dict()
    )
    (tmp_path / "config.toml").write_text(to_toml(config))  # a run directory names its config
    argv = ["plan", "--config", str(tmp_path), "-P", "5", "-H", "10", "--no-split-rows"]
    assert main([*argv, "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert (shown["num_fragments"], shown["sync_every"], shown["split_rows"]) == (5, 10, False)
    assert not any(t.get("rows") for f in shown["fragments"] for t in f["tensors"])
    assert main(["plan", "--config", str(tmp_path / "nothing")]) == 2
    assert "config='" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main(["plan", "--config", str(tmp_path / "empty")]) == 2
    assert "a directory with no config.toml" in capsys.readouterr().err


def test_a_learners_log_lines_name_it_once_and_an_exit_reason_drops_the_logs_time():
    """What a user reads when a learner dies: ``learner 1: killed by ...``, not ``learner 1
    learner 1: ...`` nor the log's timestamp inside the launcher's own line."""
    import logging

    from ddiloco.commands.learner import Who
    from ddiloco.launch import exited_line
    from ddiloco.runtime.processes.launcher.supervision import reason

    who = Who(1)

    def line(msg: str) -> str:
        return who.format(logging.LogRecord("ddiloco", logging.ERROR, "", 0, msg, None, None))

    named, bare = line("learner 1: killed by an operator"), line("learner checkpoint failed")
    assert named.endswith(" learner 1: killed by an operator") and "learner 1 learner" not in named
    assert bare.endswith(" learner 1 learner checkpoint failed")
    said = reason(["", named])
    assert said == "learner 1: killed by an operator"
    record = {"process": "learner-1", "code": 1, "reason": said, "restart": True, "delay": 1.0}
    assert exited_line({**record, "failures": 1}) == (
        "learner-1 exited with code 1 (learner 1: killed by an operator): "
        "restarting in 1.0s (failure 1 in a row)"
    )
