"""Same-host shared memory under real processes: used when it works, given up per learner
when the two ends do not share one /dev/shm (a container reached through a forwarded
loopback port), with the run going on inline instead of refusing every large frame."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ddiloco.config import load_config
from ddiloco.runtime.processes.launcher.fragments import SYNCER, Launcher

BASE = [
    "model='gpt-tiny'",
    "methods=['decoupled']",
    "runtime='processes'",
    "train.learners=2",
    "train.batch_size=2",
    "train.tokens=48000",
    "train.eval_every=1000000",
    "sync.fragments=1",
    "sync.sync_every=8",
    "data.eval_batches=1",
    "processes.detect_seconds=3.0",
    "processes.max_wall_seconds=120",
]


def run(tmp_path: Path, roots: dict[str, Path]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """A run whose processes see the /dev/shm stand-ins ``roots[name]`` (default: the real)."""
    records: list[dict[str, Any]] = []
    launcher = Launcher(load_config(None, BASE), "decoupled", tmp_path, records.append)
    spawn = launcher._spawn

    def spawn_in(
        name: str, args: list[str], control: bool = False, env: dict[str, str] | None = None
    ) -> None:
        root = roots.get(name.split("-")[0])
        spawn(
            name,
            args,
            control,
            {**(env or {}), **({"DDILOCO_SHM_ROOT": str(root)} if root else {})},
        )

    launcher._spawn = spawn_in  # type: ignore[method-assign]
    return launcher.run(), records


def merged(records: list[dict[str, Any]], m: int) -> int:
    return sum(1 for r in records if r["kind"] == "round" and r["weights"].get(str(m)))


def test_learners_behind_another_dev_shm_are_sent_inline_and_merged(tmp_path):
    syncer_root, learner_root = tmp_path / "shm-syncer", tmp_path / "shm-learners"
    syncer_root.mkdir()
    learner_root.mkdir()
    summary, records = run(tmp_path / "run", {SYNCER: syncer_root, "learner": learner_root})
    # the large frames were first written to slots the other side could not see ...
    missed = summary["refused"].get("shm_missing", 0)
    missed += summary["refused_by_learners"].get("shm_missing", 0)
    assert missed >= 1, (summary["refused"], summary["refused_by_learners"])
    # ... then both sides went inline, the refused answers sent again (not left pending,
    # unmerged): every learner is merged, the run ends by its tokens
    logs = tmp_path / "run" / "processes" / "logs"
    again = [line for m in (0, 1) for line in (logs / f"learner-{m}.log").read_text().splitlines()
             if "cannot read our /dev/shm" in line]  # fmt: skip
    assert again and all("(0 pending" not in line for line in again), again
    assert summary["tokens"] >= 48000 and merged(records, 0) >= 3 and merged(records, 1) >= 3
    assert summary["ledger_balanced"]
