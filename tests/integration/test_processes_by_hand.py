"""A run started by hand, as on several hosts (here all on loopback): ``ddiloco syncer
--out RUN`` and two ``ddiloco learner`` processes. The syncer writes the same run directory
as ``ddiloco train`` (metrics, summary, plots) and progress lines instead of raw events, so
``ddiloco compare`` reads a multi-host run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from bases import SHORT

from ddiloco.cli import main
from ddiloco.config import load_config, to_toml
from ddiloco.report.summary import REQUIRED
from ddiloco.runtime.processes.launcher.fragments import free_port
from ddiloco.runtime.processes.transport.events import EVENT_PREFIX

RUN_ID = "by-hand"


def ddiloco(*args: str, log: Path, env: dict[str, str]) -> subprocess.Popen[str]:
    with log.open("w") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "ddiloco.cli", *args],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            text=True,
        )


def test_a_hand_started_syncer_writes_a_run_directory_that_compare_reads(tmp_path, capsys):
    """... and export, eval and sample read it as any run; its plots show the learners'
    steps; two learners on one host take their ports from the doc's recipe (a fixed
    ``processes.peer_port``: learner m on peer_port + m) without being told one."""
    peer_port = free_port("127.0.0.1")
    config = load_config(
        None,
        [
            *SHORT,
            "train.tokens=16000",
            "report.progress_seconds=1.0",
            f"processes.peer_port={peer_port}",
        ],
    )
    (tmp_path / "run.toml").write_text(to_toml(config))
    common = ["--config", str(tmp_path / "run.toml"), "--run-id", RUN_ID]
    secret = tmp_path / "run.secret"
    secret.write_text(bytes(range(32)).hex())
    secret.chmod(0o600)
    common += ["--secret-file", str(secret)]
    env = dict(os.environ)
    address = f"127.0.0.1:{free_port('127.0.0.1')}"
    run = tmp_path / "run"
    syncer = ddiloco(
        "syncer", "--bind", address, "--out", str(run), *common, log=tmp_path / "s.log", env=env
    )
    learners = [
        ddiloco(
            "learner", "--syncer", address, "--id", str(m), *common,
            log=tmp_path / f"l{m}.log", env=env,
        )
        for m in range(2)
    ]  # fmt: skip
    try:
        assert syncer.wait(timeout=180) == 0, (tmp_path / "s.log").read_text()
        for learner in learners:
            assert learner.wait(timeout=30) == 0
    finally:
        for p in (syncer, *learners):
            if p.poll() is None:
                p.kill()
    said = (tmp_path / "s.log").read_text()
    assert EVENT_PREFIX not in said  # lines for a person, the records in the directory
    assert "syncer status: http://" in said and "tokens" in said and "eval" in said
    assert f"run directory: {run}" in said and "goodput" in said  # the final table
    row = next(line for line in said.splitlines() if line.startswith("decoupled "))
    assert row.split()[1] == row.split()[2], row  # at equal time: its own end, its last eval
    assert f"syncer for run {RUN_ID} listening on {address}" in said
    assert str(secret) in said  # where the status page's buttons' secret is
    assert (run / "config.toml").is_file() and (run / "processes" / "syncer_state").is_dir()
    for m in range(2):  # each on its own port, none told which
        up = f'"peer": "127.0.0.1:{peer_port + m}"'
        assert up in (tmp_path / f"l{m}.log").read_text(), (tmp_path / f"l{m}.log").read_text()
    up = next(line for line in said.splitlines() if "syncer status: http://" in line)
    assert (run / "status_url").read_text().strip() in up  # where the page is, for a script

    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    kinds = {r["kind"] for r in records}
    assert {"syncer_up", "round", "eval", "joined", "final_rounds", "summary"} <= kinds, kinds
    assert all(r["method"] == "decoupled" for r in records)
    rounds = [r for r in records if r["kind"] == "round"]
    assert rounds[-1]["tokens"] >= 16000 and rounds[-1]["weights"]
    summary = json.loads((run / "summary.json").read_text())
    assert set(REQUIRED) <= set(summary) and summary["runtime"] == "processes"
    assert summary["tokens"] >= 16000 and summary["ledger_balanced"], summary
    assert summary["methods"]["decoupled"]["eval_loss"] == summary["eval_loss"] < 5.0
    for plot in ("eval_loss.png", "timeline.png", "bytes.png", "train_loss.png"):
        assert (run / plot).stat().st_size > 0
    steps = [r for r in records if r["kind"] == "step"]  # what the learners reported
    assert {r["learner"] for r in steps} == {0, 1}, "the timeline and train loss have no data"
    assert all(0 < r["loss"] < 10 and r["batch_tokens"] > 0 for r in steps)
    assert summary["checkpoint"], summary  # the global model, where the tools look

    capsys.readouterr()  # the tools read it as any run: export, eval, sample
    assert main(["export", str(run), "--out", str(tmp_path / "model")]) == 0
    assert "exported decoupled" in capsys.readouterr().out
    assert main(["eval", str(run), "--secret-file", str(secret), "--json"]) == 0
    said_eval = json.loads(capsys.readouterr().out)
    assert abs(said_eval["eval_loss"] - summary["eval_loss"]) < 1e-4, said_eval
    assert main(["sample", str(run), "--prompt", "ROMEO:", "--tokens", "8"]) == 0
    assert capsys.readouterr().out.startswith("ROMEO:")

    capsys.readouterr()
    assert main(["compare", str(run), "--out", str(tmp_path / "cmp")]) == 0
    table = capsys.readouterr().out
    assert "decoupled" in table and str(tmp_path / "cmp.png") in table
