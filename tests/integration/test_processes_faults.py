"""Real processes behind a fault-injecting proxy: dropped, delayed, duplicated, truncated and
corrupted frames are refused or ridden through; no update is lost to them or applied twice,
and no token goes unaccounted (a lost progress report is counted from the next message)."""

from __future__ import annotations

import torch
from bases import TINY

from ddiloco.config import load_config
from ddiloco.runtime.processes.launcher.fragments import Launcher
from ddiloco.runtime.processes.syncer.store import SyncerStore, recompute

FAULTS = "drop=0.02,duplicate=0.05,corrupt=0.03,truncate=0.02,delay=0.05,delay_seconds=0.05"


def test_a_run_through_a_faulty_network_finishes_and_its_merges_audit_clean(tmp_path):
    config = load_config(
        None,
        [
            *TINY,
            "train.batch_size=4",
            "train.tokens=60000",
            "train.eval_every=20000",
            "sync.fragments=4",
            "sync.sync_every=8",
            "data.eval_batches=1",
            "processes.journal=true",
            "processes.detect_seconds=3.0",
            "processes.max_wall_seconds=150.0",
            f"processes.proxy='{FAULTS}'",
        ],
    )
    records: list[dict] = []
    summary = Launcher(config, "decoupled", tmp_path, records.append).run()
    proxy = summary["proxy"]
    assert min(proxy.get(k, 0) for k in ("dropped", "duplicated", "corrupted", "truncated")) > 0
    refused = {
        k: summary["refused"].get(k, 0) + summary["refused_by_learners"].get(k, 0)
        for k in ("checksum", "truncated", "replay")
    }
    assert min(refused.values()) > 0, refused  # each kind of damage was caught and counted
    assert summary["rounds"] > 0 and summary["tokens"] >= 60000
    # every token accounted for, though reports were lost or late (running totals)
    ledger = {k: v for k, v in summary.items() if k.startswith(("ledger", "tokens"))}
    assert summary["ledger_balanced"] and summary["ledger_errors"] == 0, ledger
    assert summary["service"].get("progress_caught_up", 0) > 0  # lost reports, recounted
    evals = [r["loss"] for r in records if r["kind"] == "eval"]
    assert min(evals[1:]) < evals[0] - 1.0  # merges through the faulty network still help
    # nothing refused was applied, nothing applied twice: the durable state is exactly the
    # journal's merges, each answer merged once
    store = SyncerStore(tmp_path / "processes" / "syncer_state")
    durable = store.load()
    fragments, merged = recompute(config, store)
    assert merged and max(merged.values()) == 1
    for p, rec in durable.items():
        for ours, theirs in zip(fragments[p], rec.values, strict=True):
            torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
