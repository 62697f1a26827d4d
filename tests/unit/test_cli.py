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
        (["plan", "--model", "gpt-tiny", "--fragments", "500"], "num_fragments"),
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
